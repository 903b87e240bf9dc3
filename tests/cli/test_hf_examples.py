"""Hugging Face-style example scripts run on 2 ranks under torchrun and `shardtrain launch`, and - with only the
import line changed to transformers' Trainer/TrainingArguments - under Hugging Face's Trainer; the logged
losses agree (1e-5) and so do predictions.

Differences by design, handled here:
- run_classification: Hugging Face multiplies the loss (and so the gradients) by the number of processes
  when `average_tokens_across_devices` is on and the model's forward takes no `num_items_in_batch` (BERT's
  does not), so its logged loss is 2x the mean; the Hugging Face run gets `--average_tokens_across_devices
  false`, which is the plain mean there (every rank has the same number of samples).
- Hugging Face's eval_loss counts the samples Accelerate repeats to even out the last batch; the eval sets
  here are a multiple of (ranks x per_device_eval_batch_size), so nothing is repeated. (On 18 samples it
  reports 9.2968 where the token mean, recomputed in one process from its own final weights, is 9.2997 -
  the value shardtrain reports.)
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import cli_env, explain, launch_pooled
from launch import torchrun

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "examples" / "data"
SCRIPTS = {
    "clm": ["--train_file", DATA / "corpus_train.txt", "--validation_file", DATA / "corpus_validation.txt",
            "--max_eval_samples", "16", "--max_steps", "6", "--per_device_train_batch_size", "4",
            "--per_device_eval_batch_size", "4", "--learning_rate", "3e-3", "--do_train", "--do_eval"],
    "classification": ["--train_file", DATA / "reviews_train.csv", "--validation_file", DATA / "reviews_validation.csv",
                       "--test_file", DATA / "reviews_test.csv", "--max_steps", "6", "--per_device_train_batch_size",
                       "8", "--per_device_eval_batch_size", "8", "--no_dropout", "--do_train", "--do_eval",
                       "--do_predict"],
}
COMMON = ["--logging_steps", "1", "--report_to", "none", "--seed", "3", "--save_strategy", "no"]
HF_ONLY = {"clm": ["--use_cpu"], "classification": ["--use_cpu", "--average_tokens_across_devices", "false"]}


def _run(cmd, home, cwd=REPO):
    proc = subprocess.run([str(c) for c in cmd], env=cli_env(home), capture_output=True, text=True, timeout=600,
                          cwd=cwd)
    assert proc.returncode == 0, explain(proc)
    return proc


def _torchrun(script, *args):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", script, *args]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("examples")
    home = root / "home"
    for name, args in SCRIPTS.items():
        script = REPO / "examples" / f"run_{name}.py"
        hf_script = root / f"run_{name}_hf.py"
        text = script.read_text()
        swapped = text.replace("from shardtrain import Trainer, TrainingArguments",
                               "from transformers import Trainer, TrainingArguments")
        assert swapped != text
        hf_script.write_text(swapped)
        # ours under torchrun and under `shardtrain launch` (what it hands the script), on the rank pool
        torchrun(script, 2, "--output_dir", str(root / f"{name}-torchrun"), "--fsdp", "full_shard auto_wrap",
                 *map(str, args), *COMMON, env=cli_env(home))
        launch_pooled(home, "--cpu", "--num_processes", 2, script, "--output_dir", root / f"{name}-launch", *args,
                      *COMMON, cwd=REPO)
        _run(_torchrun(hf_script, "--output_dir", root / f"{name}-hf", *args, *COMMON, *HF_ONLY[name]), home)
    return root


def _logs(run: Path) -> list[dict]:
    return [e for e in json.loads((run / "trainer_state.json").read_text())["log_history"] if "loss" in e]


@pytest.mark.parametrize("name", list(SCRIPTS))
@pytest.mark.parametrize("how", ["torchrun", "launch"])
def test_losses_match_hugging_face(runs, name, how):
    ours, theirs = _logs(runs / f"{name}-{how}"), _logs(runs / f"{name}-hf")
    assert [e["step"] for e in ours] == [e["step"] for e in theirs] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(ours, theirs, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-3)
        assert a["learning_rate"] == pytest.approx(b["learning_rate"], rel=1e-6)
    ours_eval = json.loads((runs / f"{name}-{how}" / "eval_results.json").read_text())
    theirs_eval = json.loads((runs / f"{name}-hf" / "eval_results.json").read_text())
    assert ours_eval["eval_loss"] == pytest.approx(theirs_eval["eval_loss"], rel=1e-5)
    assert ours_eval["eval_accuracy"] == pytest.approx(theirs_eval["eval_accuracy"], abs=1e-9)


@pytest.mark.parametrize("how", ["torchrun", "launch"])
def test_classification_predictions_match_hugging_face(runs, how):
    ours = json.loads((runs / f"classification-{how}" / "predict_results.json").read_text())
    theirs = json.loads((runs / "classification-hf" / "predict_results.json").read_text())
    assert len(ours) == 32 and ours == theirs


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_outputs_are_what_hugging_face_scripts_leave(runs, name):
    out = runs / f"{name}-launch"
    names = {p.name for p in out.iterdir()}
    assert {"train_results.json", "eval_results.json", "all_results.json", "trainer_state.json", "config.json",
            "model.safetensors", "tokenizer_config.json", "metrics.jsonl"} <= names
    config = json.loads((out / "config.json").read_text())
    train = json.loads((out / "train_results.json").read_text())
    assert {"train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos", "train_loss"} <= \
        set(train)
    if name == "clm":
        assert config["architectures"] == ["LlamaForCausalLM"] and "generation_config.json" in names
    else:
        assert config["architectures"] == ["BertForSequenceClassification"]
        assert config["problem_type"] == "single_label_classification"
