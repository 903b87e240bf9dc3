"""Expert parallelism: per-rank expert bytes and step time of a small Qwen3-MoE under the Trainer, ep 1 / 2 / 4.

    .venv/bin/python benchmarks/expert_parallel.py --out benchmarks/results/expert_parallel.json    # ~2 min, 4 ranks

One `python -m torch.distributed.run --nproc_per_node 4` launch of this file (`--worker`, gloo) trains the same
MoE (8 experts, top-2, load-balancing loss on; `MOE` below) with `shardtrain.Trainer` three ways, 6 steps each:

  * `ep1`: no expert parallelism, the reference: FSDP2 shards the experts like every other weight over 4 ranks
    and all-gathers all 8 experts of a layer on every rank for its forward and backward.
  * `ep2`: experts 0-3 / 4-7 on the two ranks of each ep group, sharded over the 2 ranks holding the same experts.
  * `ep4`: two experts per rank, not sharded further (expert-FSDP size 1); tokens move, expert weights do not.

Measured from the tensors on each rank, before the second optimizer step: expert parameter, gradient and AdamW
moment bytes (`share` = those / the experts' full parameter bytes; expected 1 / (ep x efsdp) = 1/4 in every mode,
since FSDP already shards ep1's experts 4 ways), and the expert weight bytes a rank holds unsharded while a layer
runs (a forward pre-hook: 1/ep of the layer's experts). Step time is the median wall time of steps 4-6 on this
2-core machine (4 ranks share 2 cores: compare modes, not absolute numbers). Prints JSON, writes --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MOE = {"vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 256,
       "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
       "num_experts": 8, "num_experts_per_tok": 2, "output_router_logits": True, "router_aux_loss_coef": 0.01}
SEQ, PER_DEVICE, STEPS = 128, 4, 6


def worker(cli: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from shardtrain import Trainer, TrainerCallback, TrainingArguments
    from shardtrain.parallel.distributed import destroy_distributed, init_distributed
    from shardtrain.parallel.expert import expert_modules, find_experts

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    class Probe(TrainerCallback):
        def __init__(self) -> None:
            self.bytes: dict[str, int] = {}
            self.gathered = 0
            self.times: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter())

        def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
            if state.global_step != 1:
                return
            params = [p for m in find_experts(model).values() for p in m.parameters(recurse=False)]
            size = lambda t: local(t).numel() * local(t).element_size()  # noqa: E731
            self.bytes = {"params": sum(size(p) for p in params), "grads": sum(size(p.grad) for p in params),
                          "optimizer": sum(size(v) for p in params for v in optimizer.state[p].values() if v.dim())}

    init_distributed()
    results: dict[str, Any] = {}
    for ep in (1, 2, 4):
        torch.manual_seed(0)
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**MOE, attn_implementation="sdpa"))
        full = sum(p.numel() * p.element_size() for m in find_experts(model).values()
                   for p in m.parameters(recurse=False))
        gen = torch.Generator().manual_seed(1)
        data = [{"input_ids": torch.randint(1, MOE["vocab_size"], (SEQ,), generator=gen).tolist()}
                for _ in range(PER_DEVICE * dist.get_world_size() * STEPS)]
        probe = Probe()
        args = TrainingArguments(output_dir=tempfile.mkdtemp(), fsdp=True, ep_size=ep, max_steps=STEPS,
                                 per_device_train_batch_size=PER_DEVICE, save_strategy="no", logging_steps=1,
                                 disable_tqdm=True, report_to="none", learning_rate=1e-3,
                                 fsdp_config={"transformer_layer_cls_to_wrap": ["Qwen3MoeDecoderLayer"]})
        trainer = Trainer(model, args, train_dataset=data, callbacks=[probe])
        held: list[int] = []

        def record(module: torch.nn.Module, _: Any, held: list[int] = held) -> None:
            held.append(sum(local(p).numel() * local(p).element_size() for p in module.parameters(recurse=False)))

        first = (expert_modules(trainer.model) or list(find_experts(trainer.model).values()))[0]
        hook = first.register_forward_pre_hook(record)
        trainer.train()
        hook.remove()
        steps = [b - a for a, b in zip(probe.times[2:], probe.times[3:], strict=False)]
        mine = {**probe.bytes, "held_while_running_one_layer": max(held),
                "step_ms_median": round(1000 * statistics.median(steps), 1)}
        ranks: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
        layers = MOE["num_hidden_layers"]
        results[f"ep{ep}"] = {
            "ep": ep, "efsdp": dist.get_world_size() // ep, "experts_full_bytes": full,
            "share_params": round(max(r["params"] for r in ranks) / full, 4),
            "share_grads": round(max(r["grads"] for r in ranks) / full, 4),
            "share_optimizer": round(max(r["optimizer"] for r in ranks) / (2 * full), 4),
            "layer_experts_held_unsharded_bytes": max(r["held_while_running_one_layer"] for r in ranks),
            "layer_experts_full_bytes": full // layers,
            "step_ms_median_max_rank": max(r["step_ms_median"] for r in ranks), "per_rank": ranks,
            "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e]}
    if dist.get_rank() == 0:
        Path(cli.out_file).write_text(json.dumps(results))
    destroy_distributed()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out-file", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None)
    cli = parser.parse_args()
    if cli.worker:
        worker(cli)
        return
    from bench_common import emit, launch_self

    modes = launch_self(Path(__file__), 4, [], "expert_parallel worker")
    result = {"benchmark": "expert_parallel", "ranks": 4, "model": MOE, "seq_len": SEQ, "per_device_batch": PER_DEVICE,
              "modes": modes,
              "expected": "share_* = 1 / (ep x efsdp) = 0.25 in every mode; held unsharded = layer experts / ep"}
    emit(result, cli.out)


if __name__ == "__main__":
    main()
