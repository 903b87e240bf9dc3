"""Pipeline parallelism (pp) in the Trainer equals one process on the same global batches: losses, gradient norms
and weights, with padding (microbatches of different target counts), clipping, and tied embeddings kept tied
across the first and last stage; evaluation, predictions and save_model too; sharded checkpoints resume on another
pipeline size, and a run with dropout resumes bit-identically; LoRA adapters train on every stage."""

import json
from pathlib import Path

import pytest
import torch
from launch import python, torchrun

WORKER = Path(__file__).parent / "workers" / "pipeline_run.py"


def run(tmp_path: Path, nproc: int, *args: str) -> list[dict]:
    out = tmp_path / "out"
    out.mkdir()
    proc = torchrun(WORKER, nproc, str(out), *args, timeout=300)
    # FSDP's warning of a model returning a view (the skipped head's slice, cloned by the stage) is not shown
    assert "returned a view tensor" not in proc.stderr
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def check_equal_to_one_process(results: list[dict], stages: int) -> None:
    assert sorted({r["stage"] for r in results}) == list(range(stages))
    for result in results:
        assert result["losses"] == pytest.approx(result["reference_losses"], rel=1e-5, abs=0)
        assert result["grad_norms"] == pytest.approx(result["reference_grad_norms"], rel=1e-5, abs=0)
        assert max(result["reference_grad_norms"]) > 0.5  # clipping (max_grad_norm 0.5) was active
        assert result["max_weight_change"] > 1e-3  # the steps moved the weights
        assert result["max_weight_diff"] < 1e-5


@pytest.mark.parametrize("schedule,microbatches", [("1F1B", "2"), ("GPipe", "4"), ("Interleaved1F1B", "2"),
                                                   ("LoopedBFS", "2"), ("InterleavedZeroBubble", "2"),
                                                   ("ZBVZeroBubble", "2"), ("DualPipeV", "4")])
def test_two_stages_equal_one_process_with_tied_embeddings(tmp_path, schedule, microbatches):
    results = run(tmp_path, 2, "2", schedule, microbatches, "1")
    check_equal_to_one_process(results, 2)
    first, last = results
    if schedule not in ("GPipe", "1F1B"):  # the planner's bubble is what torch's own table of the schedule gives
        assert first["table_idle_shares"] == pytest.approx([first["bubble"]] * 2, abs=1e-12)
    if schedule in ("ZBVZeroBubble", "DualPipeV"):  # a V: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2
        assert {k.split(".")[2] for k in first["keys"] if k.startswith("model.layers.")} == {"0", "3"}
        assert {k.split(".")[2] for k in last["keys"] if k.startswith("model.layers.")} == {"1", "2"}
        # both ends on rank 0: the tied pair is one parameter there, as in one process
        assert "model.embed_tokens.weight" in first["keys"] and "model.norm.weight" in first["keys"]
        assert not any(k.startswith(("model.embed_tokens", "lm_head", "model.norm")) for k in last["keys"])
        return
    if schedule in ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble"):  # two stages per rank: 0 and 2, 1 and 3
        assert {k.split(".")[2] for k in first["keys"] if k.startswith("model.layers.")} == {"0", "2"}
        assert "model.embed_tokens.weight" in first["keys"] and "lm_head.weight" in last["keys"]
        return
    # the split keeps the model's own names; the tied pair lives on both ends (embedding first, head last)
    assert "model.embed_tokens.weight" in first["keys"] and "lm_head.weight" not in first["keys"]
    assert "lm_head.weight" in last["keys"] and "model.norm.weight" in last["keys"]
    assert {k for k in first["keys"] if k.startswith("model.layers.")} == \
        {f"model.layers.{i}.{rest}" for i in (0, 1) for rest in
         {k.split(".", 3)[3] for k in first["keys"] if k.startswith("model.layers.")}}
    assert any(k.startswith("model.layers.3.") for k in last["keys"])


@pytest.mark.parametrize("schedule,microbatches", [("GPipe", "2"), ("1F1B", "2"), ("Interleaved1F1B", "2"),
                                                   ("DualPipeV", "4")])
def test_pipeline_by_fsdp_equals_one_process(tmp_path, schedule, microbatches):
    results = run(tmp_path, 4, "2", schedule, microbatches, "1", "2")
    assert results[0]["layout"].startswith("pp 2 x dp_replicate 1 x dp_shard 2")
    check_equal_to_one_process(results, 2)


def test_pipeline_by_tensor_parallel_equals_one_process(tmp_path):
    results = run(tmp_path, 4, "2", "GPipe", "2", "0", "1", "2")
    assert "tp 2" in results[0]["layout"]
    check_equal_to_one_process(results, 2)


RUN = Path(__file__).parent / "workers" / "train_run.py"
SHARDED = {"fsdp_config": {"state_dict_type": "SHARDED_STATE_DICT"}, "model": "llama_tied4"}
PP2 = {"pp_size": 2, "pp_microbatches": 2}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """pp 2 x dp 2 (4 ranks) and the same global batch of 8 on dp 2, on pp 2 alone and on one process; sharded
    checkpoints at step 5 resumed on the other layouts; a tied, dropout model's run on pp 2 stopped at step 5 and
    resumed from its full (safetensors) checkpoint in a new process."""
    root = tmp_path_factory.mktemp("pipeline")
    saved = {"save_strategy": "steps", "save_steps": 5}
    dropout = {"model": "llama_dropout", "per_device_train_batch_size": 4, **PP2}
    lora = {"lora": True, "per_device_train_batch_size": 4, **PP2}
    torchrun(RUN, 2, json.dumps([
        {"out": str(root / "dp2"), "per_device_train_batch_size": 4, **SHARDED, **saved},
        {"out": str(root / "dropout"), **dropout},
        {"out": str(root / "dropout-resumed"), **dropout, **saved, "stop_after": 5},
        {"out": str(root / "lora"), **lora, "save_model": str(root / "lora-adapter")},
        {"out": str(root / "lora-resumed"), **lora, **saved, "stop_after": 5},
        {"out": str(root / "uneven"), "per_device_train_batch_size": 8, **PP2, "pp_layers": [3, 1],
         "model": "llama_tied4"}]), timeout=300)
    # epoch ends: 20 samples, 16 per step (2 accumulation steps): short steps, placeholder micro-batches
    short = {"dataset_size": 20, "max_steps": 6, "model": "llama_tied4", "per_device_train_batch_size": 4}
    torchrun(RUN, 4, json.dumps([{"out": str(root / "pp2dp2"), "per_device_train_batch_size": 4, **PP2, **SHARDED,
                                  **saved, "predict": True, "save_model": str(root / "pp2dp2-model")},
                                 {"out": str(root / "epoch-ends"), **short, **PP2, "gradient_accumulation_steps": 2}]),
             timeout=300)
    torchrun(RUN, 2, json.dumps([
        {"out": str(root / "pp-to-dp"), "per_device_train_batch_size": 4, **SHARDED,
         "resume": str(root / "pp2dp2" / "checkpoint-5")},
        {"out": str(root / "pp-to-pp"), "per_device_train_batch_size": 8, **PP2, **SHARDED,
         "resume": str(root / "pp2dp2" / "checkpoint-5")},
        {"out": str(root / "dp-to-pp"), "per_device_train_batch_size": 8, **PP2, **SHARDED,
         "resume": str(root / "dp2" / "checkpoint-5")},
        {"out": str(root / "dp-to-interleaved"), "per_device_train_batch_size": 8, **PP2, **SHARDED,
         "pp_schedule": "Interleaved1F1B", "resume": str(root / "dp2" / "checkpoint-5")},
        {"out": str(root / "dp-to-dualpipev"), "per_device_train_batch_size": 8, **PP2, **SHARDED,
         "pp_schedule": "DualPipeV", "pp_microbatches": 4, "resume": str(root / "dp2" / "checkpoint-5")},
        {"out": str(root / "dropout-resumed"), **dropout, **saved, "resume": True},
        {"out": str(root / "lora-resumed"), **lora, **saved, "resume": True}]), timeout=300)
    python(RUN, json.dumps([{"out": str(root / "one"), "per_device_train_batch_size": 8, "model": "llama_tied4",
                             "predict": True, "save_model": str(root / "one-model")},
                            {"out": str(root / "lora-one"), "lora": True, "per_device_train_batch_size": 4,
                             "save_model": str(root / "lora-one-adapter")},
                            {"out": str(root / "epoch-ends-one"), **short, "gradient_accumulation_steps": 4}]))
    return root


def _result(path: Path) -> dict:
    return json.loads((path / "result.json").read_text())


def test_pipeline_by_fsdp_equals_one_process_in_training_and_evaluation(runs):
    pp, one, dp = _result(runs / "pp2dp2"), _result(runs / "one"), _result(runs / "dp2")
    assert pp["layout"].startswith("pp 2 x dp_replicate 1 x dp_shard 2") and len(pp["losses"]) == 10
    assert pp["losses"] == pytest.approx(one["losses"], rel=1e-6, abs=0)
    assert pp["losses"] == pytest.approx(dp["losses"], rel=1e-6, abs=0)
    assert pp["grad_norms"] == pytest.approx(one["grad_norms"], rel=1e-5, abs=0)
    assert pp["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-6)
    got, ref = (torch.load(runs / name / "predict.pt", weights_only=True) for name in ("pp2dp2", "one"))
    assert got["predictions"].shape == ref["predictions"].shape and len(got["predictions"]) == 20
    # (after 10 AdamW steps at lr 1e-2 the float noise of another summation order reaches ~1e-5 in the logits)
    assert torch.allclose(got["predictions"], ref["predictions"], atol=1e-4, rtol=0)
    assert torch.equal(got["label_ids"], ref["label_ids"])
    assert got["metrics"]["test_accuracy"] == ref["metrics"]["test_accuracy"]


def test_a_users_layer_split_trains_the_same_model(runs):
    got, ref = _result(runs / "uneven"), _result(runs / "pp2dp2")  # layers 3 + 1 against 2 + 2 (and dp 2)
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-6, abs=0)


def test_epoch_ends_with_placeholder_micro_batches_equal_one_process(runs):
    got, ref = _result(runs / "epoch-ends"), _result(runs / "epoch-ends-one")
    assert len(got["losses"]) == 6
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-6, abs=0)
    assert got["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-6)


def test_save_model_under_a_pipeline_writes_one_hugging_face_model(runs):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    files = load_file(runs / "pp2dp2-model" / "model.safetensors")
    reference = load_file(runs / "one-model" / "model.safetensors")
    assert files.keys() == reference.keys() and "lm_head.weight" not in files  # tied: saved once, as HF saves it
    model = AutoModelForCausalLM.from_pretrained(runs / "pp2dp2-model")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ref_model = AutoModelForCausalLM.from_pretrained(runs / "one-model")
    batch = torch.tensor([[5, 9, 14, 3, 7, 7, 2]])
    with torch.no_grad():
        assert torch.allclose(model(batch).logits, ref_model(batch).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("resumed,origin", [("pp-to-dp", "pp2dp2"), ("pp-to-pp", "pp2dp2"), ("dp-to-pp", "dp2"),
                                            ("dp-to-interleaved", "dp2"), ("dp-to-dualpipev", "dp2")])
def test_sharded_checkpoint_resumes_on_another_pipeline_size(runs, resumed, origin):
    got, ref = _result(runs / resumed), _result(runs / origin)
    assert got["layout"] != ref["layout"]
    assert got["losses"][5:] == pytest.approx(ref["losses"][5:], rel=1e-6, abs=0)
    assert got["grad_norms"][5:] == pytest.approx(ref["grad_norms"][5:], rel=1e-5, abs=0)
    assert got["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-6)


def test_resume_under_a_pipeline_is_bit_identical_with_dropout(runs):
    ref, got = _result(runs / "dropout"), _result(runs / "dropout-resumed")
    assert got["steps"] == list(range(1, 11))
    assert got["losses"] == ref["losses"] and got["grad_norms"] == ref["grad_norms"]  # exact, not a tolerance
    assert got["eval_loss"] == ref["eval_loss"]


def test_lora_under_a_pipeline_equals_one_process_and_resumes_bit_identically(runs):
    from safetensors.torch import load_file

    got, ref, resumed = (_result(runs / name) for name in ("lora", "lora-one", "lora-resumed"))
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-6, abs=0)
    assert got["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-6)
    assert resumed["losses"] == got["losses"] and resumed["grad_norms"] == got["grad_norms"]
    # every stage's adapters in one adapter_model.safetensors, as one process writes it
    adapters, expected = (load_file(runs / name / "adapter_model.safetensors")
                          for name in ("lora-adapter", "lora-one-adapter"))
    assert adapters.keys() == expected.keys() and any(".layers.1." in k for k in adapters)
    for key, value in expected.items():
        assert torch.allclose(adapters[key], value, atol=1e-6, rtol=0), key


def test_a_pipeline_loads_its_stages_from_a_directory_and_from_rank0(tmp_path):
    torchrun(Path(__file__).parent / "workers" / "pipeline_loading.py", 2, str(tmp_path), timeout=300)
    got = json.loads((tmp_path / "losses.json").read_text())
    assert len(got["memory"]) == 3
    assert got["directory"] == pytest.approx(got["memory"], rel=1e-6, abs=0)
    assert got["rank0"] == pytest.approx(got["memory"], rel=1e-6, abs=0)
