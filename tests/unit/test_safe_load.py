"""Reading a checkpoint never runs code from it: DCP metadata and non-tensor entries go through allow-lists.

    /work/main/.venv/bin/python -m pytest tests/unit/test_safe_load.py -q

Each crafted file's payload creates a marker file when unpickled; the tests check that shardtrain refuses the
file with a message naming it, and that the marker does not exist afterwards. The controls show that torch's
own readers do run the same payloads (so the tests exercise a live exploit, not a broken file).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from launch import REPO, python, worker_env
from safetensors.torch import load_file
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from shardtrain.checkpoint.safe_load import ALLOWED_GLOBALS, dcp_load, read_dcp_metadata
from shardtrain.errors import CheckpointError

WORKER = REPO / "tests" / "distributed" / "workers" / "train_run.py"


class ExecPayload:
    """Unpickling this runs `builtins.exec`, which creates `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


class SystemPayload:
    """Unpickling this runs `os.system("touch marker")`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch '{self.marker}'",)


def reseal(checkpoint: Path) -> None:
    """Rewrite the checkpoint's manifest (if this version writes one), as an attacker would after editing."""
    if (checkpoint / "manifest.json").is_file():
        from shardtrain.checkpoint.manifest import write_manifest

        write_manifest(checkpoint)


def tampered_metadata(real: Path, payload: object) -> bytes:
    """The real `.metadata` at `real` with `payload` hidden inside (a plain pickle.load runs it)."""
    metadata = read_dcp_metadata(real.parent)
    metadata.storage_meta.modules = [payload]
    return pickle.dumps(metadata)


@pytest.fixture(scope="module")
def real(tmp_path_factory) -> Path:
    """1-rank Trainer checkpoints after 2 AdamW steps: root/FULL_STATE_DICT, root/SHARDED_STATE_DICT."""
    root = tmp_path_factory.mktemp("real")
    jobs = [{"out": str(root / kind), "per_device_train_batch_size": 4, "max_steps": 2, "save_strategy": "steps",
             "save_steps": 2, "fsdp_config": {"state_dict_type": kind}}
            for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT")]
    python(WORKER, json.dumps(jobs))
    return root


def _recorded_globals(path: Path) -> set[tuple[str, str]]:
    seen = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module, name):
            seen.add((module, name))
            return super().find_class(module, name)

    Recorder(io.BytesIO(path.read_bytes())).load()  # a file this test run just wrote
    return seen


@pytest.mark.parametrize("sub", ["FULL_STATE_DICT/checkpoint-2/optimizer", "SHARDED_STATE_DICT/checkpoint-2/sharded"])
def test_real_metadata_reads_the_same(real, sub) -> None:
    directory = real / sub
    assert _recorded_globals(directory / ".metadata") <= set(ALLOWED_GLOBALS)
    safe, plain = read_dcp_metadata(directory), FileSystemReader(str(directory)).read_metadata()
    assert isinstance(safe, Metadata) and safe.state_dict_metadata
    assert safe.state_dict_metadata == plain.state_dict_metadata and safe.storage_data == plain.storage_data
    assert safe.planner_data == plain.planner_data and safe.version == plain.version
    assert safe.storage_meta.checkpoint_id == plain.storage_meta.checkpoint_id and safe.storage_meta.load_id


@pytest.mark.parametrize("payload", [ExecPayload, SystemPayload])
def test_crafted_metadata_is_refused(tmp_path, payload) -> None:
    marker = tmp_path / "pwned"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(payload(marker), protocol=4))
    with pytest.raises(CheckpointError) as err:
        read_dcp_metadata(tmp_path)
    name = "builtins.exec" if payload is ExecPayload else f"{os.system.__module__}.system"
    assert str(err.value) == (f"refusing to load {tmp_path / '.metadata'}: it references {name}, which a shardtrain "
                              "checkpoint never contains; the file was not written by shardtrain or was tampered with")
    assert not marker.exists()
    with pytest.raises(CheckpointError, match=f"it references {name}"):
        dcp_load({"x": torch.zeros(1)}, tmp_path, no_dist=True)
    assert not marker.exists()


def test_payload_inside_real_metadata_is_refused_and_live(real, tmp_path) -> None:
    source = real / "SHARDED_STATE_DICT" / "checkpoint-2" / "sharded"
    target = tmp_path / "sharded"
    shutil.copytree(source, target)
    marker = tmp_path / "pwned"
    (target / ".metadata").write_bytes(tampered_metadata(source / ".metadata", ExecPayload(marker)))
    with pytest.raises(CheckpointError, match=r"it references builtins\.exec"):
        read_dcp_metadata(target)
    assert not marker.exists()
    FileSystemReader(str(target)).read_metadata()  # control: torch's own reader runs the payload
    assert marker.exists()


def test_build_on_a_class_and_foreign_objects_are_refused(tmp_path) -> None:
    # GLOBAL Metadata; BUILD (None, {"x": 1}): would set an attribute on the class itself
    build_on_class = (b"\x80\x04ctorch.distributed.checkpoint.metadata\nMetadata\n"
                      b"N}X\x01\x00\x00\x00xK\x01s\x86b.")
    (tmp_path / ".metadata").write_bytes(build_on_class)
    with pytest.raises(CheckpointError, match="sets the state of a type object"):
        read_dcp_metadata(tmp_path)
    assert not hasattr(Metadata, "x")
    (tmp_path / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": {}}))
    with pytest.raises(CheckpointError, match="it holds a dict, not DCP metadata"):
        read_dcp_metadata(tmp_path)


def test_data_file_outside_the_checkpoint_is_refused(real, tmp_path) -> None:
    source = real / "SHARDED_STATE_DICT" / "checkpoint-2" / "sharded"
    metadata = read_dcp_metadata(source)
    info = next(iter(metadata.storage_data.values()))
    info.relative_path = "../../etc/passwd"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        read_dcp_metadata(tmp_path)


def _adamw(seed: int) -> torch.optim.AdamW:
    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3 * (seed + 1), betas=(0.8, 0.95), weight_decay=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    return optim


def test_optimizer_state_round_trips_with_weights_only(tmp_path) -> None:
    saved = _adamw(0).state_dict()
    dcp.save({"optimizer": saved}, checkpoint_id=str(tmp_path), no_dist=True)
    loaded = {"optimizer": _adamw(1).state_dict()}
    dcp_load(loaded, tmp_path, no_dist=True)
    assert loaded["optimizer"]["param_groups"] == saved["param_groups"]
    for index, state in saved["state"].items():
        for key, value in state.items():
            assert torch.equal(loaded["optimizer"]["state"][index][key], value)


def test_crafted_optimizer_entry_is_refused_and_live(tmp_path) -> None:
    marker = tmp_path / "pwned"
    saved = _adamw(0).state_dict()
    saved["param_groups"][0]["lr"] = ExecPayload(marker)  # DCP stores non-tensor values with torch.save
    dcp.save({"optimizer": saved}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    with pytest.raises(CheckpointError) as err:
        dcp_load({"optimizer": _adamw(1).state_dict()}, tmp_path / "ckpt", no_dist=True)
    message = str(err.value)
    assert message.startswith("refusing to load the non-tensor entry 'optimizer.param_groups")
    assert message.endswith(f" of {tmp_path / 'ckpt'}: it references builtins.exec, which a shardtrain checkpoint "
                            "never contains (only plain values and tensors); the file was not written by shardtrain "
                            "or was tampered with")
    assert not marker.exists()
    dcp.load({"optimizer": _adamw(1).state_dict()}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    assert marker.exists()  # control: torch's default planner runs it


def _merge(checkpoint: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardtrain.cli.main", "merge", str(checkpoint), str(out)],
                          env=worker_env(), capture_output=True, text=True, timeout=240, cwd=REPO)


def test_merge_refuses_crafted_metadata(real, tmp_path) -> None:
    checkpoint = tmp_path / "checkpoint-2"
    shutil.copytree(real / "SHARDED_STATE_DICT" / "checkpoint-2", checkpoint)
    marker = tmp_path / "pwned"
    metadata = checkpoint / "sharded" / ".metadata"
    metadata.write_bytes(tampered_metadata(metadata, SystemPayload(marker)))
    reseal(checkpoint)
    proc = _merge(checkpoint, tmp_path / "out")
    assert proc.returncode != 0
    assert f"refusing to load {metadata}: it references {os.system.__module__}.system" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_merge_of_a_real_checkpoint_still_works(real, tmp_path) -> None:
    checkpoint = real / "SHARDED_STATE_DICT" / "checkpoint-2"
    proc = _merge(checkpoint, tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    merged = load_file(tmp_path / "out" / "model.safetensors")
    metadata = FileSystemReader(str(checkpoint / "sharded")).read_metadata()  # a file this test run wrote
    expected = {k[len("model."):]: torch.empty(m.size, dtype=m.properties.dtype)
                for k, m in metadata.state_dict_metadata.items() if k.startswith("model.")}
    dcp.load({"model": expected}, checkpoint_id=str(checkpoint / "sharded"), no_dist=True)
    assert merged.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(merged[key], value), key
