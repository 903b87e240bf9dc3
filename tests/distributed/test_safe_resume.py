"""Resuming from a tampered checkpoint refuses it on every rank without running the planted code.

    /work/main/.venv/bin/python -m pytest tests/distributed/test_safe_resume.py -q

A real 2-rank checkpoint gets a payload that creates a marker file when unpickled: inside DCP's `.metadata`
(read with `pickle.load` by torch) or as an optimizer `param_groups` value (read with
`torch.load(weights_only=False)` by torch's default planner). The manifest is rewritten, as an attacker would.
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from launch import shardtrain_launch, torchrun
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from shardtrain.checkpoint.safe_load import dcp_load, read_dcp_metadata

WORKER = Path(__file__).parent / "workers" / "train_run.py"
KNOBS = {"per_device_train_batch_size": 4, "max_steps": 2, "save_strategy": "steps", "save_steps": 2}


class ExecPayload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


def _reseal(checkpoint: Path) -> None:
    if (checkpoint / "manifest.json").is_file():
        from shardtrain.checkpoint.manifest import write_manifest

        write_manifest(checkpoint)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("saved")
    torchrun(WORKER, 2, json.dumps([{**KNOBS, "out": str(root / kind), "fsdp_config": {"state_dict_type": kind}}
                                    for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT")]))
    return root


def _copy(saved: Path, kind: str, tmp_path: Path) -> Path:
    checkpoint = tmp_path / "checkpoint-2"
    shutil.copytree(saved / kind / "checkpoint-2", checkpoint)
    return checkpoint


def _resume(checkpoint: Path, kind: str, tmp_path: Path) -> str:
    job = {**KNOBS, "max_steps": 4, "out": str(tmp_path / "resumed"), "resume": str(checkpoint),
           "fsdp_config": {"state_dict_type": kind}}
    proc = torchrun(WORKER, 2, json.dumps([job]), check=False)
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert not (tmp_path / "resumed" / "result.json").exists()
    return proc.stdout + proc.stderr


@pytest.mark.parametrize("kind, sub", [("FULL_STATE_DICT", "optimizer"), ("SHARDED_STATE_DICT", "sharded")])
def test_crafted_metadata_is_refused_on_resume(saved, tmp_path, kind, sub) -> None:
    checkpoint = _copy(saved, kind, tmp_path)
    marker = tmp_path / "pwned"
    metadata = read_dcp_metadata(checkpoint / sub)
    metadata.storage_meta.modules = [ExecPayload(marker)]  # pickle.load of this file would create the marker
    (checkpoint / sub / ".metadata").write_bytes(pickle.dumps(metadata))
    _reseal(checkpoint)
    output = _resume(checkpoint, kind, tmp_path)
    assert (f"refusing to load {checkpoint / sub / '.metadata'}: it references builtins.exec, which a shardtrain "
            "checkpoint never contains") in output
    assert not marker.exists()


def test_crafted_optimizer_entry_is_refused_on_resume(saved, tmp_path) -> None:
    checkpoint = _copy(saved, "FULL_STATE_DICT", tmp_path)
    optimizer = checkpoint / "optimizer"
    # every entry as one flat dict (tensors whole), then written back with one param_groups value replaced
    entries: dict = {}
    for key, meta in read_dcp_metadata(optimizer).state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            entries[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
        else:
            assert isinstance(meta, BytesStorageMetadata)
            entries[key] = None
    dcp_load(entries, optimizer, no_dist=True)
    target = sorted(k for k in entries if k.startswith("optimizer.param_groups.") and k.endswith(".lr"))[0]
    assert isinstance(entries[target], float)
    marker = tmp_path / "pwned"
    entries[target] = ExecPayload(marker)
    shutil.rmtree(optimizer)
    dcp.save(entries, checkpoint_id=str(optimizer), no_dist=True)
    _reseal(checkpoint)
    output = _resume(checkpoint, "FULL_STATE_DICT", tmp_path)
    assert (f"refusing to load the non-tensor entry {target!r} of {optimizer}: it references builtins.exec") in output
    assert not marker.exists()


def test_crafted_rng_file_is_one_error_line(saved, tmp_path) -> None:
    """A pickle in place of rank 1's RNG file (manifest resealed): torch's safe loading refuses it, and both
    ranks stop with one `error:` line naming the file (no traceback, no rank left waiting), changing nothing."""
    checkpoint = _copy(saved, "SHARDED_STATE_DICT", tmp_path)
    marker = tmp_path / "pwned"
    rng = checkpoint / "rng_state_1.pt"
    assert rng.is_file()
    rng.write_bytes(pickle.dumps({"torch": ExecPayload(marker)}))
    _reseal(checkpoint)
    before = {p.name: p.read_bytes() for p in checkpoint.iterdir() if p.is_file()}
    job = {**KNOBS, "max_steps": 4, "out": str(tmp_path / "resumed"), "resume": str(checkpoint),
           "fsdp_config": {"state_dict_type": "SHARDED_STATE_DICT"}}
    proc = shardtrain_launch(WORKER, 2, json.dumps([job]))
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert f"could not read {rng} with torch.load(weights_only=True): UnpicklingError" in errors[0]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not marker.exists()
    assert {p.name: p.read_bytes() for p in checkpoint.iterdir() if p.is_file()} == before
