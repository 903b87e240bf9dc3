"""save_model of an FSDP2 model: every rank writes its part of Hugging Face's layout and none gathers the model.

One launch per world size (2 and 4 ranks; `workers/sharded_save.py`) trains an untied and a tied tiny Llama and
saves each with the default split (one `model.safetensors`), a small split (5 files + index) and the rank-0
gather path; the tests check the files against the gathered weights, transformers' `save_pretrained` and
`shardtrain merge`, and what each rank gathered. FULL_STATE_DICT training checkpoints take the same path: written
and read back by every rank (its slices), none gathering or reading the model whole, and the resume is exact; with
save_async too (written in the background from the staged shards, on the checkpoint's own process group).
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launch import error_lines, torchrun, worker_env
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from shardtrain.checkpoint.full import INDEX_FILE, SINGLE_FILE, read_full_checkpoint
from shardtrain.checkpoint.hf_export import STAGING_DIR, owned_files
from shardtrain.checkpoint.layout import SHARDED_DIR
from shardtrain.checkpoint.merge import merge_checkpoint

WORKERS = Path(__file__).parent / "workers"
SPLIT = 24000  # bytes per file: the tiny Llamas (~90 KB) split into 5 files
MODELS = ["llama", "llama_tied"]


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def saved(request, tmp_path_factory) -> tuple[Path, int]:
    root = tmp_path_factory.mktemp(f"sharded_save_{request.param}")
    torchrun(WORKERS / "sharded_save.py", request.param, str(root), str(SPLIT), timeout=900)
    return root, request.param


def _weight_names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith((".safetensors", ".index.json")))


@pytest.mark.parametrize("model", MODELS)
def test_from_pretrained_loads_the_trained_weights_bit_for_bit(saved, model):
    root, _ = saved
    weights = torch.load(root / model / "weights.pt")
    total = sum(t.numel() * t.element_size() for t in weights.values())
    for kind in ("single", "split"):
        out = root / model / kind
        assert not (out / STAGING_DIR).exists()
        names = _weight_names(out)
        if kind == "single":
            assert names == [SINGLE_FILE]
        else:
            assert names == [f"model-{i:05d}-of-00005.safetensors" for i in range(1, 6)] + [INDEX_FILE]
            index = json.loads((out / INDEX_FILE).read_text())
            assert index["metadata"]["total_size"] == total
            assert sorted(index["weight_map"]) == sorted(weights)
            for key, name in index["weight_map"].items():
                assert key in load_file(out / name)
        assert {"config.json", "generation_config.json"} <= {p.name for p in out.iterdir()}
        saved_state = read_full_checkpoint(out)  # tied weights once, as in the gathered state
        assert saved_state.keys() == weights.keys()
        loaded = AutoModelForCausalLM.from_pretrained(str(out))
        assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == (model == "llama_tied")
        state = loaded.state_dict()
        for key, value in weights.items():
            assert state[key].dtype == value.dtype == torch.float32, key
            assert torch.equal(state[key], value), key
            assert torch.equal(saved_state[key], value), key


@pytest.mark.parametrize("model", MODELS)
def test_keys_are_those_save_pretrained_writes(saved, model, tmp_path):
    root, _ = saved
    AutoModelForCausalLM.from_pretrained(str(root / model / "single")).save_pretrained(tmp_path)
    theirs = read_full_checkpoint(tmp_path)
    ours = read_full_checkpoint(root / model / "single")
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[key], theirs[key]) for key in ours)


@pytest.mark.parametrize("model", MODELS)
def test_gather_path_and_merge_write_the_same_files(saved, model, tmp_path):
    root, _ = saved
    merged_split = merge_checkpoint(root / model / "checkpoint-2", tmp_path / "split", max_shard_bytes=SPLIT)
    merged_single = merge_checkpoint(root / model / "checkpoint-2", tmp_path / "single")
    for ours, other in [(root / model / "split", root / model / "gather"), (root / model / "split", merged_split),
                        (root / model / "single", merged_single)]:
        assert _weight_names(ours) == _weight_names(other)
        if (ours / INDEX_FILE).is_file():
            assert json.loads((ours / INDEX_FILE).read_text()) == json.loads((other / INDEX_FILE).read_text())
        for name in _weight_names(ours):
            if name.endswith(".safetensors"):
                a, b = load_file(ours / name), load_file(other / name)
                assert a.keys() == b.keys(), name
                assert all(torch.equal(a[key], b[key]) for key in a), name
        assert json.loads((ours / "config.json").read_text()) == json.loads((other / "config.json").read_text())


@pytest.mark.parametrize("model", MODELS)
def test_a_new_layout_replaces_the_old_one(saved, model):
    root, _ = saved
    out = root / model / "resave"
    assert _weight_names(out) == [SINGLE_FILE]  # the split files and their index are gone
    assert torch.equal(load_file(out / SINGLE_FILE)["model.norm.weight"],
                       torch.load(root / model / "weights.pt")["model.norm.weight"])


@pytest.mark.parametrize("model", MODELS)
def test_a_failed_save_raises_everywhere_and_keeps_the_previous_model(saved, model):
    root, world = saved
    for rank in range(world):
        failed = json.loads((root / model / f"rank{rank}.json").read_text())["failed"]
        assert failed is not None and "No space left on device (injected)" in failed
    out = root / model / "resave"
    assert _weight_names(out) == [SINGLE_FILE] and not (out / STAGING_DIR).exists()
    weights = torch.load(root / model / "weights.pt")
    assert all(torch.equal(value, weights[key]) for key, value in load_file(out / SINGLE_FILE).items())


@pytest.mark.parametrize("model", MODELS)
def test_no_rank_gathers_a_full_tensor(saved, model):
    """Deterministic stand-in for the memory benchmark: the sharded path gathers nothing (the gather path
    gathers every byte on every rank), and each output file is assembled by exactly one rank, the one it
    belongs to."""
    root, world = saved
    records = [json.loads((root / model / f"rank{r}.json").read_text()) for r in range(world)]
    weights = torch.load(root / model / "weights.pt")
    total = sum(t.numel() * t.element_size() for t in weights.values())
    index = json.loads((root / model / "split" / INDEX_FILE).read_text())
    for rank, record in enumerate(records):
        assert record["single"]["full_tensor_bytes"] == record["split"]["full_tensor_bytes"] == 0
        assert record["gather"]["full_tensor_bytes"] >= total  # tied: the alias is gathered too, then dropped
        assert record["gather"]["consolidated"] == []
        assert record["split"]["consolidated"] == owned_files(index["weight_map"], rank, world)
    split_files = sorted(name for record in records for name in record["split"]["consolidated"])
    assert split_files == [f"model-{i:05d}-of-00005.safetensors" for i in range(1, 6)]
    assert [name for record in records for name in record["single"]["consolidated"]] == [
        "model-00001-of-00001.safetensors"]


@pytest.mark.parametrize("model", MODELS)
def test_full_state_dict_checkpoints_are_written_and_read_by_every_rank(saved, model):
    root, world = saved
    records = [json.loads((root / model / f"rank{r}.json").read_text()) for r in range(world)]
    for record in records:
        for kind in ("full", "full_resumed"):
            assert record[kind]["full_tensor_bytes"] == 0 and record[kind]["whole_reads"] == 0, (kind, record[kind])
    checkpoint = root / model / "full" / "checkpoint-2"
    files = [name for record in records for name in record["full"]["consolidated"]]
    # checkpoint-2 and checkpoint-3 (the end of training, as Hugging Face saves), one file each, by one rank
    assert files == ["model-00001-of-00001.safetensors"] * 2 and _weight_names(checkpoint) == [SINGLE_FILE]
    loaded = AutoModelForCausalLM.from_pretrained(str(checkpoint))
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == (model == "llama_tied")
    full, resumed = records[0]["full"]["losses"], records[0]["full_resumed"]["losses"]
    assert len(full) == 3 and resumed[-1] == full[-1]  # step 3 after the resume: bit-identical


@pytest.mark.parametrize("model", MODELS)
def test_async_full_state_dict_checkpoints_are_written_by_every_rank(saved, model):
    root, world = saved
    records = [json.loads((root / model / f"rank{r}.json").read_text()) for r in range(world)]
    for record in records:
        run = record["full_async"]
        assert run["full_tensor_bytes"] == 0 and run["rank0_gathers"] == 0, run
        assert run["losses"] == record["full"]["losses"]  # the background save changes nothing in training
    files = [name for record in records for name in record["full_async"]["consolidated"]]
    assert files == ["model-00001-of-00001.safetensors"] * 2  # checkpoint-2 and -3, each file by one rank
    for step in (2, 3):
        sync = read_full_checkpoint(root / model / "full" / f"checkpoint-{step}")
        background = read_full_checkpoint(root / model / "full_async" / f"checkpoint-{step}")
        assert sync.keys() == background.keys()
        assert all(torch.equal(sync[key], background[key]) for key in sync)
    checkpoint = root / model / "full_async" / "checkpoint-2"
    assert _weight_names(checkpoint) == [SINGLE_FILE] and not (checkpoint / STAGING_DIR).exists()
    loaded = AutoModelForCausalLM.from_pretrained(str(checkpoint))
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == (model == "llama_tied")


def _merge_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardtrain.cli.main", "merge", *args], capture_output=True,
                          text=True, timeout=300, env=worker_env())


def test_merge_refuses_a_corrupt_shard_or_a_file_as_output_in_one_line(saved, tmp_path):
    root, _ = saved
    checkpoint = tmp_path / "checkpoint-2"
    shutil.copytree(root / "llama" / "checkpoint-2", checkpoint)
    shard = max((checkpoint / SHARDED_DIR).glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte changed: only the manifest's checksum sees it
    shard.write_bytes(bytes(data))
    proc = _merge_cli(str(checkpoint), str(tmp_path / "merged"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert error_lines(proc.stderr) == [f"error: cannot merge {checkpoint}: {SHARDED_DIR}/{shard.name} does not match "
                                        f"its checksum in manifest.json (the file was modified or damaged); merge an "
                                        f"intact checkpoint (nothing was written)"], proc.stderr
    assert not (tmp_path / "merged").exists()
    target = tmp_path / "model.bin"
    target.write_text("not a directory")
    proc = _merge_cli(str(root / "llama" / "checkpoint-2"), str(target))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert error_lines(proc.stderr) == [f"error: output path {target} is a file, not a directory; choose a new "
                                        f"directory (nothing was written)"], proc.stderr
    assert target.read_text() == "not a directory"
    under = target / "merged" / "final"  # an output path below a regular file: one line, not NotADirectoryError
    proc = _merge_cli(str(root / "llama" / "checkpoint-2"), str(under))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert error_lines(proc.stderr) == [f"error: output directory {under} cannot be created: {target} is a file, not "
                                        f"a directory; choose another directory (nothing was written)"], proc.stderr
    assert target.read_text() == "not a directory"
