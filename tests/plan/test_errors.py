"""Bad planner inputs: one message naming the key, the value and the fix; `shardtrain plan` exits 2.

    OMP_NUM_THREADS=1 SHARDTRAIN_CPU=1 /work/main/.venv/bin/python -m pytest tests/plan/test_errors.py -q
"""

from __future__ import annotations

import json

import pytest
from transformers import LlamaConfig

from shardtrain.cli.main import main
from shardtrain.errors import FSDPConfigError, ParallelDimsError, PlanError
from shardtrain.plan import plan
from shardtrain.plan.memory import parse_bytes


@pytest.fixture
def config_json(tmp_path):
    LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, tie_word_embeddings=False).save_pretrained(tmp_path)
    return tmp_path / "config.json"


def test_bad_inputs_name_the_key(tmp_path, config_json):
    with pytest.raises(FSDPConfigError, match="reshard_after_forwad"):
        plan(config_json, fsdp_config={"reshard_after_forwad": True})
    with pytest.raises(ParallelDimsError, match="cp_size x tp_size = 2 x 1"):
        plan(config_json, world_size=3, cp=2)
    with pytest.raises(PlanError, match="no such file"):
        plan(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(PlanError, match="'model_type'"):
        plan(tmp_path / "bad.json")
    with pytest.raises(PlanError, match="per_device_batch = 0"):
        plan(config_json, per_device_batch=0)
    with pytest.raises(PlanError, match="optimizer = 'sgd'"):
        plan(config_json, optimizer="sgd")


@pytest.mark.parametrize(("text", "expected"), [("80GiB", 80 * 2**30), ("80 GB", 80 * 10**9), ("1.5MiB", 1572864),
                                                 (1024, 1024)])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["80 gigs", "-1GiB", "0", ""])
def test_parse_bytes_rejects(text):
    with pytest.raises(PlanError, match="--device-memory"):
        parse_bytes(text)


def test_cli_json_and_exit_codes(config_json, capsys):
    assert main(["plan", str(config_json), "--world-size", "2", "--batch", "2", "--seq-len", "16", "--json",
                 "--no-step-time", "--device-memory", "1GiB", "--target", "cpu"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fit"]["fits"] is True and out["predicted_peak_bytes"] == out["fit"]["peak"]
    assert out["settings"]["parallel"].endswith("= 2 ranks")
    assert main(["plan", str(config_json), "--device-memory", "lots"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --device-memory = 'lots'")
    assert main(["plan", str(config_json), "--world-size", "4", "--cp", "3"]) == 2
    assert "cp_size x tp_size = 3 x 1" in capsys.readouterr().err


def test_what_the_trainer_refuses_is_refused(config_json):
    """The planner refuses what the Trainer refuses, with its message: experts parallelism of a dense model,
    LoRA with tensor or expert parallelism."""
    from shardtrain.errors import ExpertParallelError

    with pytest.raises(ExpertParallelError, match="ep_size = 2: LlamaForCausalLM has no routed experts"):
        plan(config_json, world_size=2, ep=2, estimate_step_time=False)
    for kwargs in ({"tp": 2}, {"ep": 2}):
        name = next(iter(kwargs))
        with pytest.raises(PlanError, match=f"lora_rank = 4 with {name} = 2: the Trainer does not train LoRA"):
            plan(config_json, world_size=2, lora_rank=4, **kwargs)


def test_cli_plans_for_this_machine_by_default_and_takes_launch_spelling(config_json, capsys):
    """No --target: the device kind of the machine it runs on (no GPU here: cpu), said on the first line; the
    flags also take the underscore spelling of `shardtrain launch`."""
    import torch

    assert not torch.cuda.is_available()
    assert main(["plan", str(config_json), "--world_size", "2", "--batch", "2", "--seq_len", "16",
                 "--no_step_time", "--no_what_if"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == "Planned for cpu (no GPU is visible here; --target cuda for GPUs)."
    assert main(["plan", str(config_json), "--world-size", "2", "--batch", "2", "--seq-len", "16", "--json",
                 "--no-step-time", "--no-what-if"]) == 0
    assert json.loads(capsys.readouterr().out)["settings"]["target"] == "cpu"


def test_a_gpu_target_gets_no_step_time_measured_on_this_cpu(config_json, capsys):
    """--target cuda (or --device-memory, which names a GPU) without a GPU here and without a rate: the memory plan,
    and no step time (a CPU matmul says nothing of a GPU); --accelerator NAME plans with the table's figures."""
    base = ["plan", str(config_json), "--world-size", "2", "--batch", "2", "--seq-len", "16", "--no-what-if"]
    for extra in (["--target", "cuda"], ["--device-memory", "80GiB"]):
        assert main([*base, *extra]) == 0
        out = capsys.readouterr().out
        assert out.splitlines()[0].startswith("Planned for cuda (")
        assert "no step time: no GPU here to measure one, pass --accelerator NAME" in out.splitlines()[0]
        assert "step time" not in "\n".join(out.splitlines()[1:]).lower()
    assert main([*base, "--bf16", "--accelerator", "h100-sxm", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["settings"]["target"] == "cuda"
    assert result["step_time"]["flops_rate"] == pytest.approx(989e12)  # the table's bf16 peak, not a CPU's
    assert result["step_time"]["link_rate"] == pytest.approx(450e9)
    assert main([*base, "--accelerator", "tpu-v9"]) == 2
    assert "--accelerator 'tpu-v9' is not in the table (h100-sxm, " in capsys.readouterr().err


def test_plan_help_describes_and_shows_examples(capsys):
    assert main(["plan", "--help"]) == 0
    out = capsys.readouterr().out
    assert "examples:" in out and "--accelerator h100-sxm" in out and "mi300x" in out


def test_torch_older_than_the_traced_step_needs_is_refused():
    """torch 2.11 traced a 1.2B Llama's peak at 36.8 GiB where an H100 measured 20.55 GiB, torch 2.9 cannot trace
    at all: the planner names the version and the fix instead of predicting wrong figures."""
    from shardtrain.plan.trace import MIN_TORCH, require_torch_for_tracing

    assert MIN_TORCH == (2, 13)
    for fine in ("2.13.0+cpu", "2.13.0a0+git1234", "2.14.1", "3.0.0"):
        require_torch_for_tracing(fine)
    require_torch_for_tracing()  # the torch the tests run on
    for old in ("2.11.0+cu130", "2.12.1", "2.9.0"):
        expected = rf"torch >= 2\.13; this is torch {old.replace('+', '.')}.*set the layout by hand"
        with pytest.raises(PlanError, match=expected):
            require_torch_for_tracing(old)


def test_planning_leaves_the_error_hook_as_it_was(config_json):
    """`init_process_group` wraps `sys.excepthook` to prefix "[rank0]: " and destroying the group does not unwrap it:
    the planner's fake group must not leave a wrapper behind ("auto" traces ~10 layouts, and a run's error line came
    out with 11 prefixes)."""
    import sys

    before = sys.excepthook
    plan(config_json, world_size=2, estimate_step_time=False)
    assert sys.excepthook is before


def test_rates_are_named_by_their_source_and_host_memory_is_checked(config_json, capsys):
    """--accelerator's rate is its datasheet peak (not a rate the user gave): the step time is shown at MFU 40 %
    beside the full-rate floor; rank 0's machine's host memory is weighed against --host-memory."""
    argv = ["plan", str(config_json), "--world-size", "2", "--batch", "2", "--seq-len", "16", "--no-what-if",
            "--accelerator", "h100-sxm"]
    assert main([*argv, "--host-memory", "1KiB"]) == 0
    out = capsys.readouterr().out
    assert "at 67 TFLOP/s, h100-sxm datasheet peak, fp32)" in out and "given (--tflops)" not in out
    assert "GB/s, h100-sxm datasheet, NVLink 4)" in out
    assert "(no overlap) at the full rate: a floor" in out and "at MFU 40% of that rate (--mfu)" in out
    assert "Host memory, rank 0's machine (2 ranks): " in out and "1.00 KiB available (--host-memory): does NOT fit" \
        in out
    assert main([*argv, "--json", "--mfu", "0.5", "--tflops", "100"]) == 0
    step = json.loads(capsys.readouterr().out)["step_time"]
    assert step["flops_rate_source"] == "given (--tflops)" and step["mfu"] == 0.5
    assert step["compute_s_at_mfu"] == pytest.approx(2 * step["compute_s"])
    assert main([*argv, "--mfu", "1.5"]) == 2  # before anything is traced
    assert "error: --mfu 1.5: give the share of the compute rate a step reaches" in capsys.readouterr().err
