"""`shardtrain verify` on our example scripts and on the mistake it exists to catch.

    /work/main/.venv/bin/python -m pytest tests/cli/test_verify.py -q

A classifier (the real BERT, dropout off), a causal LM with padding and a script with AdamW at a high rate,
accumulation and dropout equal one process on 2 ranks and on 2 ranks x accumulation 2; the contrastive
sentence-transformers loss (in-batch negatives) is reported as layout-dependent by nature; five mistakes (a
per-micro-batch mean, a rank-dependent term, per-rank data, a loader that ignores the rank, a seed per rank) are
each named from their evidence.
"""

from __future__ import annotations

import subprocess
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO, SCRIPTS, cli_cmd, explain
from launch import worker_env
from tiny_models import tiny_gpt2, tiny_llama

from shardtrain.cli.verify_cmd import parse_layouts
from shardtrain.errors import LaunchConfigError
from shardtrain.train.verify import layout_dependence, turn_off_dropout

EXAMPLES = REPO / "examples"
DATA = EXAMPLES / "data"


def test_layouts_are_read_by_count_and_by_axis():
    layouts = parse_layouts("2,dp2xcp2,tp2", [1, 2])
    assert [(layout.label, layout.world_size) for layout in layouts] == [
        ("2 x acc 1", 2), ("2 x acc 2", 2), ("dp2xcp2 x acc 1", 4), ("dp2xcp2 x acc 2", 4), ("tp2 x acc 1", 2),
        ("tp2 x acc 2", 2)]
    with pytest.raises(LaunchConfigError, match="dp2xcp2"):
        parse_layouts("dp2-cp2", [1])


def test_dropout_is_turned_off_and_named():
    assert turn_off_dropout(tiny_llama()) is None
    model = tiny_gpt2(dropout=0.1)
    assert turn_off_dropout(model).endswith("dropout modules and 0 attention dropouts (p up to 0.1)")
    assert all(m.p == 0 for m in model.modules() if isinstance(m, torch.nn.Dropout))
    llama = tiny_llama(attention_dropout=0.1)
    assert turn_off_dropout(llama) == "0 dropout modules and 2 attention dropouts (p up to 0.1)"
    assert {m.attention_dropout for m in llama.modules() if hasattr(m, "attention_dropout")} == {0.0}
    assert layout_dependence(SimpleNamespace(model=model)) is None  # no longer "by nature": verify compares it


def _verify(tmp_path, *args: object) -> subprocess.CompletedProcess:
    proc = subprocess.run(cli_cmd("verify", "--cpu", "--keep", tmp_path / "runs", *args), env=worker_env(),
                          capture_output=True, text=True, timeout=900, cwd=tmp_path)
    print(proc.stdout)
    return proc


def _row(proc: subprocess.CompletedProcess, label: str) -> list[str]:
    line = next(line for line in proc.stdout.splitlines() if line.startswith(label))
    return line[len(label):].split()


@pytest.mark.parametrize("script", ["causal_lm_with_padding", "classifier"])
def test_our_examples_equal_one_process_on_every_layout(tmp_path, script):
    args = [EXAMPLES / "train_demo.py", "--output_dir", tmp_path / "out"] if script == "causal_lm_with_padding" else \
        [EXAMPLES / "run_classification.py", "--output_dir", tmp_path / "out", "--train_file",
         DATA / "reviews_train.csv", "--validation_file", DATA / "reviews_validation.csv", "--do_train",
         "--per_device_train_batch_size", "8", "--no_dropout", "--max_steps", "30", "--fsdp", "full_shard auto_wrap"]
    proc = _verify(tmp_path, "--layouts", "2", "--accumulation", "1,2", "--steps", "2", *args)
    assert proc.returncode == 0, explain(proc)
    assert "verdict: same run - every layout equals one process within the tolerances" in proc.stdout
    for label in ("2 x acc 1", "2 x acc 2"):
        *diffs, first_step, first_parameter = _row(proc, label)[3:]
        assert all(float(d) <= 1e-5 for d in diffs) and (first_step, first_parameter) == ("-", "-"), proc.stdout
    assert not (tmp_path / "out").exists()  # verify's runs write under --keep only


def test_in_batch_negatives_are_reported_as_layout_dependent_by_nature(tmp_path):
    proc = _verify(tmp_path, "--layouts", "2", "--steps", "2", EXAMPLES / "train_embeddings.py",
                   "--output_dir", tmp_path / "out")
    assert proc.returncode == 3, explain(proc)
    assert "verdict: layout-dependent by nature - MultipleNegativesRankingLoss takes its negatives" in proc.stdout


def test_a_per_micro_batch_mean_is_named_from_the_numbers(tmp_path):
    proc = _verify(tmp_path, "--layouts", "2", "--accumulation", "1,2", "--steps", "2", SCRIPTS / "per_device_mean.py")
    assert proc.returncode == 1, explain(proc)
    loss, grad, weight, first_step, first_parameter = _row(proc, "2 x acc 1")[3:]
    assert first_step == "1" and float(loss) > 1e-3 and first_parameter == "model.embed_tokens.weight"
    assert proc.stdout.splitlines()[-1].startswith(f"verdict: DIFFERS - 2 x acc 1 leaves one process at step 1, by "
                                                   f"up to {max(float(loss), float(grad), float(weight)):.3g}")
    assert "step 1's loss already differs" in proc.stdout
    assert "the step-1 difference changes with accumulation (acc 1: " in proc.stdout
    assert proc.stdout.split("candidate causes, most likely first:\n")[1].startswith("  1. normalisation:")
    assert proc.stdout.splitlines()[-1].endswith("most likely: normalisation")


def test_a_rank_dependent_term_is_not_blamed_on_normalisation(tmp_path):
    proc = _verify(tmp_path, "--layouts", "2", "--accumulation", "1,2", "--steps", "2", SCRIPTS / "rank_term.py")
    assert proc.returncode == 1, explain(proc)
    assert "step 1's loss already differs (0.005 on 2 x acc 1)" in proc.stdout
    assert "the step-1 difference does not change with accumulation" in proc.stdout
    assert "the final weights agree: the difference is in the reported loss only" in proc.stdout
    assert proc.stdout.split("candidate causes, most likely first:\n")[1].startswith("  1. rank-dependent code:")
    assert proc.stdout.splitlines()[-1].endswith("most likely: rank-dependent code")


@pytest.mark.parametrize("script,evidence,cause", [
    ("per_rank_data", "step 1 on 2 x acc 1 trained 4 of 8 samples that one process never saw", "data"),
    ("own_loader", "step 1 on 2 x acc 1 trains 4 of its 8 samples twice, where one process trains them once",
     "sampler"),
    ("rank_seed", "the random state at the first step differs from one process's on rank(s) 1", "seeds")])
def test_each_mistake_is_named_from_its_evidence(tmp_path, script, evidence, cause):
    proc = _verify(tmp_path, "--layouts", "2", "--steps", "2", SCRIPTS / f"{script}.py")
    assert proc.returncode == 1, explain(proc)
    assert f"  - {evidence}" in proc.stdout
    assert proc.stdout.split("candidate causes, most likely first:\n")[1].startswith(f"  1. {cause}:")
    assert proc.stdout.splitlines()[-1].endswith(f"most likely: {cause}")


def test_a_correct_script_with_adamw_at_a_high_rate_accumulation_and_dropout_passes(tmp_path):
    """AdamW at lr 3e-3 moves weights by more than 1e-5 from rounding alone; the tolerance follows the run's own."""
    proc = _verify(tmp_path, "--layouts", "2", "--accumulation", "1,2", "--steps", "3", SCRIPTS / "correct_adamw.py")
    assert proc.returncode == 0, explain(proc)
    assert "dropout off in every run (0 dropout modules and 2 attention dropouts" in proc.stdout
    assert "rounding: the reordered run differs by " in proc.stdout
    assert "verdict: same run - every layout equals one process within the tolerances" in proc.stdout
