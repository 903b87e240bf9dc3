"""The TPU path on torch_xla's CPU device: our Trainer with fsdp_config "xla" (SPMD FSDPv2 on 4 devices, and the
v1 wrapper on one) against unsharded eager training, resume, save_model, merge, and a Hugging Face-style script
that changes only its fsdp_config.

Every run is a process in the XLA venv (`scripts/setup_xla.sh`: torch 2.9.0 + torch_xla 2.9.0), started from this
suite's own interpreter; the references run there too, in processes of their own (a CPU backward before the first
XLA backward in one process trips an autograd device assert). When the venv could not be made (the wheels could not
be installed), every test here skips with the reason setup_xla.sh recorded.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from launch import torchrun
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("xla_worker.py")
VENV = Path(os.environ.get("SHARDTRAIN_XLA_VENV", Path.home() / ".cache" / "shardtrain" / "venv-xla"))
XLA_PYTHON = VENV / "bin" / "python"
DEVICES = 4
STEPS = 10


def _xla_python() -> Path:
    failed = Path(f"{VENV}.failed")
    if failed.is_file():
        pytest.skip(f"XLA venv unavailable: {failed.read_text().strip()} (scripts/setup_xla.sh)")
    if not XLA_PYTHON.is_file():
        pytest.skip(f"XLA venv {VENV} does not exist; run bash scripts/setup_xla.sh (scripts/test.sh does)")
    return XLA_PYTHON


def _env(devices: int) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("SHARDTRAIN_CPU", None)  # the XLA device, not the CPU backend of torch.distributed
    env.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices), TF_CPP_MIN_LOG_LEVEL="2", OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO / "src"), TOKENIZERS_PARALLELISM="false")
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def _run(cmd: list, devices: int, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], env=_env(devices), capture_output=True, text=True, timeout=600,
                          cwd=REPO)
    if check:
        assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def _result(result: dict) -> dict:
    result["losses"] = {int(k): v for k, v in result["losses"].items()}
    return result


def _worker(python: Path, processes_devices: int, **spec) -> dict:
    return _workers(python, processes_devices, [spec])[0]


def _workers(python: Path, processes_devices: int, specs: list[dict]) -> list[dict]:
    """Runs that do not depend on each other, one after the other in one process."""
    proc = _run([python, WORKER, json.dumps(specs)], processes_devices)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return [_result(result) for result in json.loads(line[len("RESULT "):])]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    python = _xla_python()
    root = tmp_path_factory.mktemp("xla")
    full, sharded = {}, {"state_dict_type": "SHARDED_STATE_DICT"}
    common = {"steps": STEPS, "batch": 2, "devices": DEVICES, "save_steps": 5}
    ckpt = {"xla_fsdp_grad_ckpt": True, **sharded}
    # dropout, padding, tied embeddings and 2 micro-batches per step: resume must still be exact
    gpt2 = {"model": "gpt2", "steps": 8, "batch": 2, "devices": DEVICES, "save_steps": 4, "accumulation": 2}
    v1 = {"steps": 2, "batch": 2 * DEVICES, "save_steps": 2}  # one device, the same global batch as the reference
    out: dict = {"root": root}
    out["eager"] = _worker(python, 1, mode="eager", out=str(root / "eager"), **common)
    # the uninterrupted runs in one process, the resumed ones in another (a resume shares nothing with its run)
    out["spmd"], out["ckpt"], out["gpt2"] = _workers(python, DEVICES, [
        dict(mode="spmd", out=str(root / "spmd"), save_model=str(root / "spmd-model"), fsdp_config=full, **common),
        dict(mode="spmd", out=str(root / "ckpt"), save_model=str(root / "ckpt-model"), fsdp_config=ckpt, **common),
        dict(mode="spmd", out=str(root / "gpt2"), save_model=str(root / "gpt2-model"), **gpt2)])
    out["spmd_resumed"], out["ckpt_resumed"], out["gpt2_resumed"] = _workers(python, DEVICES, [
        dict(mode="spmd", out=str(root / "spmd-resumed"), fsdp_config=full, resume=str(root / "spmd" / "checkpoint-5"),
             save_model=str(root / "spmd-resumed-model"), **common),
        dict(mode="spmd", out=str(root / "ckpt-resumed"), fsdp_config=ckpt, resume=str(root / "ckpt" / "checkpoint-5"),
             save_model=str(root / "ckpt-resumed-model"), **common),
        dict(mode="spmd", out=str(root / "gpt2-resumed"), resume=str(root / "gpt2" / "checkpoint-4"),
             save_model=str(root / "gpt2-resumed-model"), **gpt2)])
    out["v1_layers"], out["v1_size"] = _workers(python, 1, [
        dict(mode="v1", out=str(root / "v1-layers"), fsdp_config={
            "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"], "xla_fsdp_grad_ckpt": True,
            "xla_fsdp_settings": {"compute_dtype": "float32", "flatten_parameters": True}}, **v1),
        dict(mode="v1", out=str(root / "v1-size"),
             fsdp_config={"auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": 3000}, **v1)])
    _run([python, "-m", "shardtrain.cli.main", "merge", root / "ckpt" / "checkpoint-10", root / "ckpt-merged"], 1)
    return out


def _assert_losses(ours: dict[int, float], reference: dict[int, float], tol: float, steps: range) -> None:
    assert sorted(ours) == list(steps), ours
    for step in steps:
        assert ours[step] == pytest.approx(reference[step], abs=tol), (step, ours[step], reference[step])


def test_reference_learns(runs):
    losses = runs["eager"]["losses"]
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert losses[STEPS] < losses[1] - 0.05  # a reference that trains, so agreeing with it means something


@pytest.mark.parametrize("run", ["spmd", "ckpt"])
def test_spmd_fsdpv2_on_4_devices_matches_eager(runs, run):
    _assert_losses(runs[run]["losses"], runs["eager"]["losses"], 1e-4, range(1, STEPS + 1))


def test_spmd_parameters_are_sharded_over_the_fsdp_axis(runs):
    specs = runs["spmd"]["sharding"]
    assert len(specs) == 21  # 2 layers x 9 + embeddings, final norm, lm_head
    for name, spec in specs.items():
        # each parameter split 4 ways on its largest dimension: "{devices=[4,1]0,1,2,3}" / "[1,4]" / "[4]"
        assert spec.replace("[1,4]", "[4,1]").replace("[4]", "[4,1]").startswith("{devices=[4,1]0,1,2,3"), (name, spec)


def test_resumed_parameters_stay_sharded(runs):
    assert runs["spmd_resumed"]["sharding"] == runs["spmd"]["sharding"]


def test_spmd_wraps_each_layer_and_grad_ckpt_checkpoints_them(runs):
    layers = ["_orig_module.model.layers.0", "_orig_module.model.layers.1"]
    assert runs["spmd"]["wrap"]["wrappers"] == {"": "SpmdFullyShardedDataParallel",
                                                **dict.fromkeys(layers, "SpmdFullyShardedDataParallel")}
    assert runs["spmd"]["wrap"]["checkpointed"] == []
    assert runs["ckpt"]["wrap"]["checkpointed"] == [f"{name}._orig_module" for name in layers]


@pytest.mark.parametrize(("run", "at", "steps"), [("spmd", 5, STEPS), ("ckpt", 5, STEPS), ("gpt2", 4, 8)])
def test_resume_is_bit_identical_to_the_uninterrupted_run(runs, run, at, steps):
    """FULL_STATE_DICT ("spmd") and SHARDED_STATE_DICT ("ckpt") checkpoints of the Llama, and GPT-2 with dropout 0.1,
    padded batches, tied embeddings and 2 micro-batches per step: the same losses and final weights, bit for bit
    (XLA's RNG is restored; parameters and AdamW moments keep their sharding)."""
    resumed = runs[f"{run}_resumed"]["losses"]
    assert {s: resumed[s] for s in range(at + 1, steps + 1)} == \
        {s: runs[run]["losses"][s] for s in range(at + 1, steps + 1)}
    ours = load_file(runs["root"] / f"{run}-resumed-model" / "model.safetensors")
    uninterrupted = load_file(runs["root"] / f"{run}-model" / "model.safetensors")
    assert sorted(ours) == sorted(uninterrupted)
    for name, tensor in uninterrupted.items():
        assert torch.equal(ours[name], tensor), name


@pytest.mark.parametrize("run", ["spmd", "ckpt", "gpt2"])
def test_save_model_loads_with_from_pretrained_with_the_same_logits(runs, run):
    assert runs[run]["logits_max_diff"] < 1e-5
    assert {"config.json", "model.safetensors"} <= set(runs[run]["saved_files"])


def test_no_pickled_pth_is_written(runs):
    # the XLA runs write none; the eager reference (FSDP off: one plain process) writes Hugging Face's layout,
    # whose rng_state.pth and training_args.bin transformers' Trainer writes too (shardtrain never reads the latter)
    written = [p for p in runs["root"].rglob("*") if p.suffix in (".pth", ".bin")]
    assert written and all(p.relative_to(runs["root"]).parts[0] == "eager" for p in written)
    assert {p.name for p in written} == {"rng_state.pth", "training_args.bin"}
    sharded = runs["root"] / "ckpt" / "checkpoint-5" / "sharded"
    assert sorted(p.suffix for p in sharded.iterdir()) == ["", ".distcp"]  # .metadata + DCP data


def test_merge_of_a_spmd_sharded_checkpoint_equals_save_model(runs):
    merged = load_file(runs["root"] / "ckpt-merged" / "model.safetensors")
    saved = load_file(runs["root"] / "ckpt-model" / "model.safetensors")
    assert sorted(merged) == sorted(saved) and len(saved) == 21
    for name, tensor in saved.items():
        assert torch.equal(merged[name], tensor), name


@pytest.mark.parametrize(("run", "units", "checkpointed", "settings"), [
    ("v1_layers", ["model.layers.0", "model.layers.1"], True,
     {"compute_dtype": "torch.float32", "flatten_parameters": "True", "reshard_after_forward": "True"}),
    ("v1_size", ["model.layers.0.self_attn", "model.layers.0.mlp", "model.layers.1.self_attn", "model.layers.1.mlp"],
     False, {"compute_dtype": "torch.float32", "flatten_parameters": "False", "reshard_after_forward": "True"}),
])
def test_v1_wrapping_on_one_device_steps_as_eager(runs, run, units, checkpointed, settings):
    wrap = runs[run]["wrap"]
    prefix = "_fsdp_wrapped_module._fpw_module."
    assert wrap["wrappers"] == {"": "XlaFullyShardedDataParallel",
                                **{prefix + u: "XlaFullyShardedDataParallel" for u in units}}
    inner = "._fsdp_wrapped_module._fpw_module"
    assert wrap["checkpointed"] == ([prefix + u + inner for u in units] if checkpointed else [])
    assert wrap["settings"] == settings
    # step 2's loss is the first one after an optimizer step
    _assert_losses(runs[run]["losses"], runs["eager"]["losses"], 1e-5, range(1, 3))


def test_v1_checkpoint_has_the_consolidated_model(runs):
    saved = load_file(runs["root"] / "v1-size" / "checkpoint-2" / "model.safetensors")
    assert len(saved) == 21 and "model.layers.1.mlp.down_proj.weight" in saved


CLM = ["--train_file", REPO / "examples/data/corpus_train.txt", "--validation_file",
       REPO / "examples/data/corpus_validation.txt", "--max_eval_samples", "16", "--max_steps", "6",
       "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4", "--learning_rate", "3e-3",
       "--do_train", "--do_eval", "--logging_steps", "1", "--report_to", "none", "--seed", "3",
       "--save_strategy", "no", "--fsdp", "full_shard auto_wrap"]


def test_an_fsdp2_script_runs_under_xla_by_changing_only_fsdp_config(tmp_path):
    """examples/run_clm.py: FSDP2 on 2 ranks (torchrun, this suite's torch) and SPMD on 2 XLA devices (plain python,
    torch 2.9) with `--fsdp_config '{"xla": true, "xla_fsdp_v2": true}'` log the same losses and eval loss."""
    python = _xla_python()
    script = REPO / "examples" / "run_clm.py"
    torchrun(script, 2, "--output_dir", str(tmp_path / "fsdp2"), *[str(a) for a in CLM])
    _run([python, script, "--output_dir", tmp_path / "xla", *CLM,
          "--fsdp_config", '{"xla": true, "xla_fsdp_v2": true}'], 2)
    logs = {run: json.loads((tmp_path / run / "trainer_state.json").read_text())["log_history"]
            for run in ("fsdp2", "xla")}
    losses = {run: [e["loss"] for e in log if "loss" in e] for run, log in logs.items()}
    assert len(losses["xla"]) == 6
    assert losses["xla"] == pytest.approx(losses["fsdp2"], abs=1e-4)
    evals = {run: json.loads((tmp_path / run / "eval_results.json").read_text())["eval_loss"] for run in logs}
    assert evals["xla"] == pytest.approx(evals["fsdp2"], abs=1e-4)


def test_unsupported_settings_fail_before_training_with_the_fix(tmp_path):
    python = _xla_python()
    spec = {"mode": "spmd", "out": str(tmp_path / "out"), "steps": 2, "batch": 2, "devices": 2,
            "fsdp_config": {"cpu_offload": True}}
    proc = _run([python, WORKER, json.dumps(spec)], 2, check=False)
    assert proc.returncode != 0
    assert "fsdp_config 'xla': true does not support fsdp_config 'cpu_offload'" in proc.stderr
    assert "set 'xla': false to train with FSDP2" in proc.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
