"""Activation memory and step time of no / selective / full activation checkpointing, measured and as planned.

    .venv/bin/python benchmarks/selective_ac.py --out benchmarks/results/selective_ac.json     # ~2 min on 2 cores
    .venv/bin/python benchmarks/selective_ac.py --steps 3 --out /tmp/sac.json           # shorter

Each mode runs in its own process (`torch.distributed.run --nproc_per_node 1`, gloo, 1 thread, so peak RSS
belongs to that mode alone): a Llama (hidden 256, 4 layers, 8 heads, vocab 2048, SDPA attention) sharded by
`apply_fsdp` with `fsdp_config` `{"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
"activation_checkpointing": MODE}`, AdamW, batch 4 x 512 tokens. Measured:

  * `forward_live_bytes`: what the forward leaves alive for backward (`ForwardResidue`: storages its ops
    created that are still alive when it returns; includes logits and loss, which every mode keeps);
  * `layer_activation_bytes`: the same, per decoder layer (live bytes after the layer minus before it; the
    planner's own per-layer measure, `layer_activations`);
  * `step_time_s_median` (wall) and `cpu_time_per_step_s_median` (this process's CPU time: steadier on a shared
    machine) over the steps after one warm-up, no meter attached; and the process's peak RSS.

`planned` is `shardtrain.plan(...)` for the same model, batch and config (fake tensors, no weights): predicted
peak, per-layer activations, FLOPs (recomputation included) and step time (`--tflops`, default: measured once
here, for every mode). Prints JSON, writes --out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MODES = ("none", "selective", "full")
VALUES: dict[str, Any] = {"none": False, "selective": "selective", "full": True}
SHAPE = {"vocab_size": 2048, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 512,
         "tie_word_embeddings": False, "use_cache": False, "attn_implementation": "sdpa"}
BATCH, SEQ = 4, 512


def _fsdp_config(mode: str) -> dict[str, Any]:
    return {"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"], "activation_checkpointing": VALUES[mode]}


def worker(cli: argparse.Namespace) -> None:
    import torch
    from bench_common import MemoryBaseline, StepTimer, summarize_steps
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardtrain.config.fsdp_config import FSDPConfig
    from shardtrain.parallel.activation_checkpoint import ForwardResidue
    from shardtrain.parallel.distributed import destroy_distributed, init_distributed
    from shardtrain.parallel.fsdp import apply_fsdp

    init_distributed()
    baseline = MemoryBaseline()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE))
    apply_fsdp(model, FSDPConfig.load(_fsdp_config(cli.mode)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randint(0, SHAPE["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(1))

    # one measured forward (the meter slows ops down, so it is not timed)
    meter = ForwardResidue()
    marks: dict[int, int] = {}
    layers: list[int] = []
    handles = []
    for index, layer in enumerate(model.model.layers):
        handles.append(layer.register_forward_pre_hook(lambda m, a, i=index: marks.__setitem__(i, meter.live_bytes())))
        handles.append(layer.register_forward_hook(lambda m, a, o, i=index: layers.append(meter.live_bytes()
                                                                                           - marks[i])))
    with meter:
        loss = model(input_ids=batch, labels=batch).loss
    live = meter.live_bytes()
    loss.backward()
    optimizer.zero_grad()
    for handle in handles:
        handle.remove()
    del loss

    timer = StepTimer()
    timer.mark()
    losses = []
    for _ in range(cli.steps + 1):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        timer.mark()
    result = {"forward_live_bytes": live, "layer_activation_bytes": layers, "losses": losses,
              **summarize_steps(timer.durations(), timer.cpu_durations(), warmup=1, tokens_per_step=BATCH * SEQ),
              **baseline.report()}
    Path(cli.out_file).write_text(json.dumps(result))
    destroy_distributed()


def planned(mode: str, tflops: float | None) -> dict[str, Any]:
    from transformers import LlamaConfig

    from shardtrain.plan import plan

    result = plan(LlamaConfig(**SHAPE), fsdp_config=_fsdp_config(mode), world_size=1, per_device_batch=BATCH,
                  seq_len=SEQ, target="cpu", what_if=False, tflops=tflops, link_gbps=10.0)
    layers = [size for name, size in result.trace.layer_activations if ".layers." in name]
    return {"predicted_peak_bytes": result.peak, "layer_activation_bytes": layers,
            "step_s": result.step["step_s_no_overlap"], "flops": result.step["flops"],
            "flops_rate": result.step["flops_rate"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out-file", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per mode (after one warm-up)")
    parser.add_argument("--tflops", type=float, default=None, help="planner compute rate (default: measured)")
    parser.add_argument("--out", default=None)
    cli = parser.parse_args()
    if cli.worker:
        worker(cli)
        return
    from bench_common import emit, launch_self

    measured = {mode: launch_self(Path(__file__), 1, ["--mode", mode, "--steps", str(cli.steps)],
                                  f"selective_ac worker ({mode})") for mode in MODES}
    plans = {"none": planned("none", cli.tflops)}
    tflops = cli.tflops or plans["none"]["flops_rate"] / 1e12  # one calibration: the modes differ in FLOPs only
    plans.update({mode: planned(mode, tflops) for mode in MODES[1:]})
    none = measured["none"]
    summary = {}
    for mode in MODES:
        got, plan_ = measured[mode], plans[mode]
        summary[mode] = {
            "forward_live_bytes": got["forward_live_bytes"],
            "forward_live_vs_none": round(got["forward_live_bytes"] / none["forward_live_bytes"], 4),
            "layer_activation_bytes_measured": got["layer_activation_bytes"][0],
            "layer_activation_bytes_planned": plan_["layer_activation_bytes"][0],
            "layer_activation_vs_none_measured": round(got["layer_activation_bytes"][0]
                                                       / none["layer_activation_bytes"][0], 4),
            "peak_rss_delta_bytes": got["peak_rss_delta_bytes"],
            "predicted_peak_bytes": plan_["predicted_peak_bytes"],
            "step_time_s_median": round(got["step_time_s_median"], 4),
            "step_time_vs_none": round(got["step_time_s_median"] / none["step_time_s_median"], 4),
            "cpu_time_per_step_s_median": round(got["cpu_time_per_step_s_median"], 4),
            "cpu_time_vs_none": round(got["cpu_time_per_step_s_median"] / none["cpu_time_per_step_s_median"], 4),
            "planned_step_s": round(plan_["step_s"], 4),
            "planned_flops": plan_["flops"],
            "same_losses_as_none": got["losses"] == none["losses"],
        }
    emit({"benchmark": "selective_ac", "model": SHAPE, "batch": BATCH, "seq_len": SEQ, "ranks": 1,
          "threads": 1, "summary": summary, "measured": measured, "planned": plans}, cli.out)


if __name__ == "__main__":
    main()
