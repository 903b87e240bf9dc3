"""manifest.json: written over a checkpoint directory, and every kind of later damage is named."""

import json

import pytest

from shardtrain.checkpoint.manifest import HASHED_MAX_BYTES, MANIFEST_FILE, manifest_problem, write_manifest


@pytest.fixture
def ckpt(tmp_path):
    (tmp_path / "sharded").mkdir()
    (tmp_path / "sharded" / ".metadata").write_bytes(b"meta" * 10)
    (tmp_path / "sharded" / "__0_0.distcp").write_bytes(b"x" * (HASHED_MAX_BYTES + 10))  # size-checked only
    (tmp_path / "trainer_state.json").write_text(json.dumps({"global_step": 4}))
    write_manifest(tmp_path)
    return tmp_path


def test_intact_checkpoint_has_no_problem(ckpt):
    assert manifest_problem(ckpt) is None
    files = json.loads((ckpt / MANIFEST_FILE).read_text())["files"]
    assert set(files) == {"sharded/.metadata", "sharded/__0_0.distcp", "trainer_state.json"}
    assert "sha256" in files["trainer_state.json"] and "sha256" not in files["sharded/__0_0.distcp"]


@pytest.mark.parametrize("damage,words", [
    (lambda d: (d / "trainer_state.json").write_text(json.dumps({"global_step": 5})), ["trainer_state.json",
                                                                                       "checksum"]),
    (lambda d: (d / "sharded" / ".metadata").unlink(), ["sharded/.metadata", "missing"]),
    (lambda d: (d / "sharded" / "__0_0.distcp").write_bytes(b"x"), ["__0_0.distcp", "1 bytes"]),
    (lambda d: (d / MANIFEST_FILE).unlink(), [MANIFEST_FILE, "missing"]),
    (lambda d: (d / MANIFEST_FILE).write_text("{"), [MANIFEST_FILE, "damaged"]),
])
def test_damage_is_named(ckpt, damage, words):
    damage(ckpt)
    problem = manifest_problem(ckpt)
    for word in words:
        assert word in problem, problem
