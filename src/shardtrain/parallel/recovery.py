"""Live recovery between replica groups without pickle: a state as JSON plus safetensors, over HTTP.

torchft hands a recovering group the state of a healthy peer through a `CheckpointTransport`. Its own transports
unpickle what the peer sends (`torch.load(weights_only=False)`, `pickle.loads`), so a peer, or anything that can
answer on its port, could run code in the recovering process. `SafeTransport` carries two things only: the
tensors, as one safetensors blob (a JSON header and raw bytes: nothing is executed when it is read), and the rest
of the state (step counts, learning rates, the scheduler's and the trainer's numbers) as JSON, in which each
tensor is a reference into the blob. The server binds to the address and port the configuration names and serves
a state only between `send_checkpoint` and `disallow_checkpoint` (the step it was staged for).

    transport = SafeTransport(host="10.0.0.5", port=29600, timeout=timedelta(seconds=60))
    manager = torchft.Manager(..., checkpoint_transport=transport)

`encode` / `decode` are the codec; `copy_into` checks a received state against the local one (the same keys,
shapes and dtypes, or one line naming the first difference) and copies it in place.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import urllib.error
import urllib.request
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import safetensors.torch
import torch
from torch.distributed.tensor import DTensor
from torchft.checkpointing.transport import CheckpointTransport

from shardtrain.errors import ReplicaGroupError

MAX_METADATA_BYTES = 256 * 2**20  # the JSON part (a log history at most); the tensors have no limit but the peer's


def encode(state: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(JSON-ready description, tensors by name) of a nested state of dicts, lists, tuples, numbers, strings and
    tensors (a DTensor as this rank's shard). Tensors that share storage (tied weights) are sent once.

    Raises:
        TypeError: a leaf of another type, named by its path.
    """
    tensors: dict[str, torch.Tensor] = {}
    seen: dict[tuple[int, tuple[int, ...], torch.dtype], str] = {}

    def walk(value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            local = value.to_local() if isinstance(value, DTensor) else value
            key = (local.data_ptr(), tuple(local.shape), local.dtype)
            if local.numel() and key in seen:
                return {"tensor": seen[key]}
            name = seen[key] = str(len(tensors))
            tensors[name] = local.detach().to("cpu").contiguous().clone()
            return {"tensor": name}
        if isinstance(value, dict):
            for k in value:
                if not isinstance(k, str | int) or isinstance(k, bool):
                    raise TypeError(f"state key {k!r} at {path or '/'} is neither a string nor an integer")
            return {"dict": [[k, walk(v, f"{path}/{k}")] for k, v in value.items()]}
        if isinstance(value, list | tuple):
            kind = "list" if isinstance(value, list) else "tuple"
            return {kind: [walk(v, f"{path}/{i}") for i, v in enumerate(value)]}
        if value is None or isinstance(value, bool | int | float | str):
            return {"value": value}
        raise TypeError(f"state value at {path or '/'} is a {type(value).__name__}, which recovery cannot send "
                        "(tensors, numbers, strings, lists and dicts only)")

    return walk(state, ""), tensors


def decode(description: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The nested state `encode` described, its tensors taken from `tensors`.

    Raises:
        ValueError: a description that `encode` cannot have written.
    """
    def walk(node: Any) -> Any:
        if not isinstance(node, dict) or len(node) != 1:
            raise ValueError(f"malformed state node {str(node)[:80]!r}")
        (kind, body), = node.items()
        if kind == "tensor":
            if body not in tensors:
                raise ValueError(f"the state names tensor {body!r}, which the payload lacks")
            return tensors[body]
        if kind == "dict":
            out = {}
            for pair in body:
                if not isinstance(pair, list) or len(pair) != 2 or not isinstance(pair[0], str | int):
                    raise ValueError(f"malformed state entry {str(pair)[:80]!r}")
                out[pair[0]] = walk(pair[1])
            return out
        if kind in ("list", "tuple"):
            if not isinstance(body, list):
                raise ValueError(f"malformed state {kind}")
            items = [walk(v) for v in body]
            return items if kind == "list" else tuple(items)
        if kind == "value" and (body is None or isinstance(body, bool | int | float | str)):
            return body
        raise ValueError(f"unknown state node {kind!r}")

    return walk(description)


def tensor_leaves(state: Any, path: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a nested state by its path (a DTensor as the DTensor)."""
    if isinstance(state, torch.Tensor):
        return {path: state}
    if isinstance(state, dict):
        return {k: v for key, value in state.items() for k, v in tensor_leaves(value, f"{path}/{key}").items()}
    if isinstance(state, list | tuple):
        return {k: v for i, value in enumerate(state) for k, v in tensor_leaves(value, f"{path}/{i}").items()}
    return {}


def copy_into(local: Any, received: Any, what: str) -> None:
    """Copy the received tensors into the local state's, in place, after checking that both have the same tensor
    paths and each the same shape (this rank's shard) and dtype.

    Raises:
        ReplicaGroupError: the first difference, named.
    """
    mine, theirs = tensor_leaves(local), tensor_leaves(received)
    missing, extra = sorted(set(mine) - set(theirs)), sorted(set(theirs) - set(mine))
    if missing or extra:
        key, side = (missing[0], "lacks") if missing else (extra[0], "has an unexpected")
        raise ReplicaGroupError(f"refused the {what} a peer sent: it {side} tensor {key!r}; the replica groups "
                                "must run the same model, layout and optimizer")
    with torch.no_grad():
        for path, target in mine.items():
            shard = target.to_local() if isinstance(target, DTensor) else target
            got = theirs[path]
            if tuple(got.shape) != tuple(shard.shape) or got.dtype != shard.dtype:
                raise ReplicaGroupError(f"refused the {what} a peer sent: {path!r} is {got.dtype} "
                                        f"{tuple(got.shape)} there but {shard.dtype} {tuple(shard.shape)} here; "
                                        "the replica groups must run the same model, layout and optimizer")
        for path, target in mine.items():
            shard = target.to_local() if isinstance(target, DTensor) else target
            shard.copy_(theirs[path])


class PeerUnreachable(ReplicaGroupError):
    """The peer did not answer (it may have died): the group tries again at the next quorum."""

    transient = True


class _QuietServer(ThreadingHTTPServer):
    """An HTTP server that says nothing when a peer hangs up before its answer (it stopped waiting: its own
    timeout reports that); any other error is printed, as http.server does."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class SafeTransport(CheckpointTransport[Any]):
    """torchft's `CheckpointTransport` carrying JSON and safetensors only (see the module docstring).

    Args:
        host: the address to bind and to advertise to peers.
        port: the port to bind (0: a free one).
        timeout: how long a fetch may take.
    """

    def __init__(self, host: str, port: int, timeout: timedelta) -> None:
        self.host, self.timeout = host, timeout
        # why the last receive failed (torchft's quorum thread swallows it): a refused state is fatal, an
        # unreachable peer is retried at the next quorum
        self.failure: ReplicaGroupError | None = None
        self._staged_cond = threading.Condition()
        self._staged: tuple[int, bytes, bytes] | None = None  # (step, JSON, safetensors)
        transport = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                parts = self.path.strip("/").split("/")
                if len(parts) != 3 or parts[0] != "checkpoint" or parts[2] not in ("meta", "tensors"):
                    self.send_error(404, "expected /checkpoint/<step>/meta or /checkpoint/<step>/tensors")
                    return
                # the quorum tells both sides at once: the peer may ask before this side has staged the state
                with transport._staged_cond:
                    transport._staged_cond.wait_for(lambda: transport._staged is not None and
                                                    str(transport._staged[0]) == parts[1],
                                                    timeout=transport.timeout.total_seconds())
                    staged = transport._staged
                if staged is None or parts[1] != str(staged[0]):
                    self.send_error(409, f"no state staged for step {parts[1]}")
                    return
                body = staged[1] if parts[2] == "meta" else staged[2]
                self.send_response(200)
                self.send_header("Content-Type", "application/json" if parts[2] == "meta" else
                                 "application/octet-stream")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:  # quiet: a recovery is logged by the trainer
                pass

        try:
            self._server = _QuietServer((host, port), Handler)
        except OSError as err:
            raise ReplicaGroupError(f"cannot bind the recovery server to {host}:{port} ({err.strerror}); set "
                                    "fault_tolerance's recovery_host to an address of this machine and "
                                    "recovery_port to a free port (0: any)") from None
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="shardtrain-recovery", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def metadata(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/checkpoint"

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
        description, tensors = encode(state_dict)
        blob = safetensors.torch.save(tensors)
        with self._staged_cond:
            self._staged = (step, json.dumps(description).encode(), blob)
            self._staged_cond.notify_all()

    def disallow_checkpoint(self) -> None:
        with self._staged_cond:
            self._staged = None

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        self.failure = None
        try:
            return fetch_state(metadata, step, timeout)
        except ReplicaGroupError as err:
            self.failure = err
            raise

    def shutdown(self, wait: bool = True) -> None:
        self._server.shutdown()
        self._server.server_close()
        if wait:
            self._thread.join()


def fetch_state(address: str, step: int, timeout: timedelta) -> Any:
    """The state a peer staged for `step` at `address` (its `metadata()`), decoded without unpickling anything.

    Raises:
        ReplicaGroupError: the peer cannot be reached, or what it sent is not a state `encode` wrote.
    """
    seconds = timeout.total_seconds()
    try:
        with urllib.request.urlopen(f"{address}/{step}/meta", timeout=seconds) as reply:
            meta = reply.read(MAX_METADATA_BYTES + 1)
        with urllib.request.urlopen(f"{address}/{step}/tensors", timeout=seconds) as reply:
            blob = reply.read()
    except (urllib.error.URLError, OSError) as err:
        raise PeerUnreachable(f"recovery from the peer at {address} (step {step}) failed: {err}") from None
    if len(meta) > MAX_METADATA_BYTES:
        raise ReplicaGroupError(f"refused the state from {address}: its description is over "
                                f"{MAX_METADATA_BYTES >> 20} MiB")
    try:
        description = json.loads(meta)
        tensors = safetensors.torch.load(blob)
        return decode(description, tensors)
    except Exception as err:  # a peer that is not one of ours, or a crafted payload: nothing was executed
        raise ReplicaGroupError(f"refused the state from {address}: it is not a JSON + safetensors state "
                                f"({type(err).__name__}: {str(err)[:120]}); nothing of it was loaded") from None


def advertised_host() -> str:
    """This machine's name, as peers reach it (the default recovery address)."""
    return socket.gethostname()
