"""Replica groups' settings and live recovery (`parallel.recovery`): JSON + safetensors, never pickle."""

from __future__ import annotations

import pickle
import threading
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from shardtrain.config.fault_tolerance import FaultTolerance
from shardtrain.errors import ReplicaGroupError, TrainingArgumentsError
from shardtrain.parallel.recovery import SafeTransport, copy_into, decode, encode, fetch_state

LIGHTHOUSE = "http://127.0.0.1:29510"


def test_settings_are_checked_once_with_the_key_and_the_fix():
    ft = FaultTolerance.resolve({"replica_group": 1, "replica_groups": 4, "lighthouse": LIGHTHOUSE}, {})
    assert (ft.replica_group, ft.replica_groups, ft.min_replicas, ft.lost_batches) == (1, 4, 1, "skip")
    refeed = {"replica_group": 0, "replica_groups": 2, "lighthouse": LIGHTHOUSE, "lost_batches": "refeed"}
    assert FaultTolerance.resolve(refeed, {}).lost_batches == "refeed"
    assert ft.data_split(2, 1) == (8, 3)  # group 1's rank 1 of 2 is the 4th of the 8 data ranks
    assert FaultTolerance.resolve(None, {}) is None
    launched = FaultTolerance.resolve(None, {"SHARDTRAIN_REPLICA_GROUP": "0", "SHARDTRAIN_REPLICA_GROUPS": "2",
                                             "TORCHFT_LIGHTHOUSE": LIGHTHOUSE})
    assert (launched.replica_group, launched.replica_groups, launched.lighthouse) == (0, 2, LIGHTHOUSE)
    assert (ft.start_timeout, ft.torchft_log) == (300.0, "warn")  # the documented defaults
    verbose = FaultTolerance.resolve({"replica_group": 0, "replica_groups": 2, "lighthouse": LIGHTHOUSE},
                                     {"SHARDTRAIN_TORCHFT_LOG": "info"})
    assert verbose.torchft_log == "info"
    cases = [({"replica_groups": 2, "lighthouse": LIGHTHOUSE}, "needs 'replica_group'"),
             ({"replica_group": 2, "replica_groups": 2, "lighthouse": LIGHTHOUSE}, "replica_group=2 is not one of"),
             ({"replica_group": 0, "replica_groups": 2, "lighthouse": "host:1"}, "give it as http://HOST:PORT"),
             ({"replica_group": 0, "replica_groups": 2, "lighthouse": LIGHTHOUSE, "min_replicas": 3}, "min_replicas=3"),
             ({"replica_group": 0, "replica_groups": 2, "lighthouse": LIGHTHOUSE, "lost": 1}, "has no key 'lost'"),
             ({"replica_group": "x", "replica_groups": 2, "lighthouse": LIGHTHOUSE}, "replica_group='x' is not an int"),
             ({"replica_group": 0, "replica_groups": 2, "lighthouse": LIGHTHOUSE, "lost_batches": "drop"},
              "lost_batches='drop' is not supported"),
             ([0, 2], r"fault_tolerance=\[0, 2\] is not a dict; give it as \{'replica_group'"),
             ({"replica_group": 0, "replica_groups": 2, "lighthouse": LIGHTHOUSE, "recovery_port": 70000},
              "recovery_port=70000 is not a port"),
             ({"replica_group": 0, "replica_groups": 2, "lighthouse": LIGHTHOUSE, "start_timeout": -1},
              "start_timeout=-1: it must be >= 0"),
             ({"replica_group": 0, "replica_groups": 2, "lighthouse": LIGHTHOUSE, "torchft_log": "loud"},
              r"torchft_log='loud' is not a level; use one of \['error', 'warn', 'info', 'debug'\]")]
    for value, message in cases:
        with pytest.raises(TrainingArgumentsError, match=message):
            FaultTolerance.resolve(value, {})


def test_the_training_arguments_refuse_a_bad_setting_before_anything_starts(tmp_path):
    from shardtrain import TrainingArguments

    with pytest.raises(TrainingArgumentsError, match="fault_tolerance needs 'lighthouse'"):
        TrainingArguments(output_dir=str(tmp_path), fault_tolerance={"replica_group": 0, "replica_groups": 2})
    with pytest.raises(TrainingArgumentsError, match="takes a dict"):
        TrainingArguments(output_dir=str(tmp_path), fault_tolerance="yes")


def test_a_state_round_trips_through_json_and_safetensors():
    tied = torch.randn(4, 3)
    state = {"model": {"embed": tied, "head": tied, "norm": torch.ones(3)},
             "optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 3)}},
                           "param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), "params": [0], "name": None}]},
             "progress": {"global_step": 7, "log_history": [{"loss": float("inf")}], "flag": True}}
    description, tensors = encode(state)
    assert len(tensors) == 4  # the tied pair is sent once
    import json

    back = decode(json.loads(json.dumps(description)), tensors)
    assert torch.equal(back["model"]["embed"], tied) and back["model"]["head"] is back["model"]["embed"]
    assert back["optimizer"]["state"][0]["step"].item() == 3.0  # integer keys stay integers
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)  # tuples stay tuples
    assert back["progress"] == state["progress"]
    with pytest.raises(TypeError, match="at /progress/when is a object"):
        encode({"progress": {"when": object()}})


def test_two_transports_hand_a_state_over_even_when_asked_before_it_is_staged():
    sender = SafeTransport("127.0.0.1", 0, timedelta(seconds=10))
    receiver = SafeTransport("127.0.0.1", 0, timedelta(seconds=10))
    try:
        state = {"user": {"w": torch.arange(6.0).reshape(2, 3)}, "torchft": {"step": 5, "batches_committed": 9}}
        later = threading.Timer(0.3, sender.send_checkpoint, args=([1], 5, state, timedelta(seconds=10)))
        later.start()  # the receiver asks first: the server waits for the state of that step
        got = receiver.recv_checkpoint(0, sender.metadata(), 5, timedelta(seconds=10))
        assert torch.equal(got["user"]["w"], state["user"]["w"]) and got["torchft"] == state["torchft"]
        sender.disallow_checkpoint()
        with pytest.raises(ReplicaGroupError, match="failed"):  # nothing staged any more: an unreachable peer
            fetch_state(sender.metadata(), 5, timedelta(seconds=0.5))
    finally:
        sender.shutdown()
        receiver.shutdown()


class _Marker:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))  # unpickling this creates the file: code run by the payload


def test_a_payload_crafted_to_run_code_when_unpickled_runs_nothing_and_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    payload = pickle.dumps({"user": _Marker(str(marker))})
    pickle.loads(pickle.dumps(_Marker(str(tmp_path / "proof"))))  # the payload is live: unpickled, it runs
    assert (tmp_path / "proof").exists()

    class Evil(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Evil)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        address = f"http://127.0.0.1:{server.server_address[1]}/checkpoint"
        with pytest.raises(ReplicaGroupError, match="not a JSON \\+ safetensors state.*nothing of it was loaded"):
            fetch_state(address, 3, timedelta(seconds=5))
    finally:
        server.shutdown()
    assert not marker.exists()


def test_a_peer_state_with_other_shapes_is_refused_with_the_key():
    local = {"model": {"w": torch.zeros(2, 3)}}
    with pytest.raises(ReplicaGroupError, match="'/model/w' is torch.float32 \\(4, 3\\) there but torch.float32 "
                                                "\\(2, 3\\) here"):
        copy_into(local, {"model": {"w": torch.ones(4, 3)}}, "state")
    with pytest.raises(ReplicaGroupError, match="lacks tensor '/model/w'"):
        copy_into(local, {"model": {"v": torch.ones(2, 3)}}, "state")
    assert torch.equal(local["model"]["w"], torch.zeros(2, 3))  # nothing copied
    copy_into(local, {"model": {"w": torch.ones(2, 3)}}, "state")
    assert torch.equal(local["model"]["w"], torch.ones(2, 3))


def test_the_recovery_server_binds_where_it_is_told_or_says_why_not():
    taken = SafeTransport("127.0.0.1", 0, timedelta(seconds=5))
    try:
        with pytest.raises(ReplicaGroupError, match=f"cannot bind the recovery server to 127.0.0.1:{taken.port}"):
            SafeTransport("127.0.0.1", taken.port, timedelta(seconds=5))
        assert taken.metadata() == f"http://127.0.0.1:{taken.port}/checkpoint"
    finally:
        taken.shutdown()


def test_a_state_this_group_cannot_give_a_peer_stops_its_next_quorum():
    """torchft only logs an error of the state it sends; the gate keeps it (not transient), so the group's next
    `begin` raises it instead of every later quorum failing the same way."""
    from types import SimpleNamespace

    from shardtrain.train.loop.replica_gate import ReplicaGate

    class Broken:
        @property
        def checkpoint_manager(self):
            raise RuntimeError("no manager")

    transport = SafeTransport("127.0.0.1", 0, timedelta(seconds=5))
    try:
        gate = object.__new__(ReplicaGate)
        gate.trainer, gate.replicas = Broken(), SimpleNamespace(transport=transport)
        with pytest.raises(RuntimeError, match="no manager"):
            gate.state_dict()
        assert isinstance(transport.failure, ReplicaGroupError) and not getattr(transport.failure, "transient", False)
        assert "could not be read (RuntimeError: no manager)" in str(transport.failure)
    finally:
        transport.shutdown()


def test_an_unreachable_lighthouse_is_named_within_seconds():
    import socket
    import time

    from shardtrain.parallel.replicas import probe_lighthouse

    with socket.socket() as taken:  # a port nothing listens on: bound, never listening
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(OSError, match="nothing accepts connections there after 1 s"):
            probe_lighthouse(f"http://127.0.0.1:{port}", within=1.0)
        assert time.monotonic() - start < 4
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        probe_lighthouse(f"http://127.0.0.1:{listening.getsockname()[1]}", within=1.0)  # answers at once
