"""A transformers script that never mentions FSDP, with only its import switched: on one process it starts no
process group (as transformers' Trainer, so a library's cleanup that asks `dist.is_initialized()` takes the
one-process path); under plain torchrun on 2 ranks it trains data parallel (FSDP2 without sharding, DDP's math)
and logs the losses of the one process (padding and tied embeddings included)."""

from pathlib import Path

from launch import python, read_json, torchrun, worker_env

SCRIPT = Path(__file__).parent / "workers" / "plain_script.py"


def test_one_process_starts_no_group_and_torchrun_runs_data_parallel(tmp_path):
    python(SCRIPT, str(tmp_path / "one"), pooled=False)  # a fresh process, as a user runs it
    torchrun(SCRIPT, 2, str(tmp_path / "two"), pooled=False)
    one, two = read_json(tmp_path / "one" / "result.json"), read_json(tmp_path / "two" / "result.json")
    assert (one["group_after_train"], one["group_after_evaluate"], one["fsdp_enabled"]) == (False, False, False)
    assert (two["fsdp_enabled"], two["sharding"]) == (True, "no_shard")
    assert len(one["losses"]) == 4
    for a, b in zip(one["losses"], two["losses"], strict=True):
        assert abs(a - b) < 1e-5, (one["losses"], two["losses"])
    assert abs(one["eval_loss"] - two["eval_loss"]) < 1e-5
    for run in ("one", "two"):  # checkpoints were written on both
        assert (tmp_path / run / "checkpoint-4" / "trainer_state.json").is_file()


def test_transformers_own_arguments_under_torchrun_get_no_wrong_ddp_advice(tmp_path):
    """transformers' TrainingArguments built under torchrun on CPU log "launch your script with `python -m
    torch.distributed.launch`"; under shardtrain's Trainer the run is data parallel, so that line is not shown."""
    proc = torchrun(SCRIPT, 2, str(tmp_path / "two"), pooled=False, env=worker_env(HF_ARGS="1"))
    assert "torch.distributed.launch" not in proc.stdout + proc.stderr
    assert "Trainer got transformers.training_args.TrainingArguments" in proc.stderr  # our one warning
    assert read_json(tmp_path / "two" / "result.json")["sharding"] == "no_shard"
