"""`fsdp_config` `"layout": "auto"`: the fastest layout that fits the per-rank memory budget, chosen by the planner.

    TrainingArguments(..., fsdp=True, fsdp_config={"layout": "auto", "max_memory_per_rank": "16GiB"})

The candidates are sharding (`no_shard`: plain data parallel, every rank holds the whole model;
`shard_grad_op`: `reshard_after_forward` false; `full_shard`) x activation checkpointing (none, selective, full) x
the loss chunk (off, "auto"), and on CPU plain data parallel with the whole model as one unit
(`no_shard_one_unit`, AC none), less every key the user set (those stay as given). A plain data-parallel run of a
model with a pipeline plan (Llama, Qwen2, ...), with the engine's own loss and no pp_size set, also gets a
pipeline of 2 stages x each checkpointing mode (its schedule and microbatches the run's `pp_schedule` and
`pp_microbatches`): pp 2 halves the data-parallel ranks, so the run then takes 2 x the accumulation steps, and the
global batch (and every loss) stays the one the arguments describe. How the choice is made:
1. rank 0 traces each candidate's step before the process group starts (`shardtrain.plan`, fake tensors: peak
   memory, FLOPs, bytes on the wire per collective kind, collective calls, ops, and the ops selective
   checkpointing's Python policy sees; the other ranks do not trace); where the process group is already up (TRL's
   trainers start it first), in a fresh process that rebuilds the model from its config (`plan.fresh_process`);
2. with the process group up, every rank takes part in timing real collectives on the run's backend (per kind:
   gloo's all-reduce moves bytes ~2x faster than its all-gather; and a tiny one's round trip), and rank 0 times its
   matmul rate and its host time per op, plainly and under the selective policy (`plan.calibration`);
3. rank 0 predicts each step as the sum of those costs (the gradient reductions counted as overlapping the
   backward, all but the last unit's: `Candidate.step_s`), keeps the candidates whose predicted peak fits the
   budget and picks the fastest; predictions within 2 % of each other count as a tie, which goes to the smaller
   peak. It broadcasts its pick, and prints the table.
The budget is `max_memory_per_rank`, else the accelerator's memory, else (CPU) the machine's memory shared by the
node's ranks. Every layout gives the same losses (the exactness tests hold for each).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import torch

from shardtrain.config.fsdp_config import FSDPConfig
from shardtrain.errors import FSDPConfigError
from shardtrain.plan.calibration import Rates, compute_rate, measure_host, measure_link
from shardtrain.plan.candidates import (
    AC_VALUES,
    SHARDINGS,
    Candidate,
    Request,
    layout_config,
    request_for,
    trace_candidates,
)

TIE = 0.02  # predicted steps this close (relative) are a tie: the smaller peak wins


def default_budget(config: FSDPConfig, device: torch.device, local_world_size: int) -> tuple[int, str]:
    """The per-rank memory budget and where it came from."""
    if config.max_memory_per_rank is not None:
        return config.max_memory_per_rank, "fsdp_config max_memory_per_rank"
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory, f"{device}'s memory"
    import psutil

    return psutil.virtual_memory().total // max(local_world_size, 1), \
        f"this machine's memory / {local_world_size} rank(s)"


@dataclass(frozen=True, kw_only=True)
class Choice:
    """The candidates, their predicted step, which fit, and the pick."""

    candidates: list[Candidate]
    chosen: int
    budget: int
    budget_source: str
    rates: Rates

    @property
    def candidate(self) -> Candidate:
        """The pick."""
        return self.candidates[self.chosen]

    def step_s(self, candidate: Candidate) -> float:
        """`candidate`'s predicted seconds per step at the measured rates."""
        return candidate.step_s(self.rates)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON: the pick, the budget, the rates, and every candidate's counts and predictions."""
        return {"chosen": self.candidate.name, "budget_bytes": self.budget, "budget_source": self.budget_source,
                "rates": dataclasses.asdict(self.rates),
                "candidates": [{"name": c.name, "sharding": c.sharding, "activation_checkpointing": c.ac,
                                "loss_chunk": c.loss_chunk, "pp": c.pp, "predicted_peak_bytes": c.peak, "ops": c.ops,
                                "collective_calls": c.collective_calls, "selective_ops": c.selective_ops,
                                "units": c.units,
                                "predicted_step_s": self.step_s(c), "fits": c.peak <= self.budget}
                               for c in self.candidates]}

    def report(self) -> str:
        """The table rank 0 prints: the pick and why, then every candidate from the fastest predicted."""
        from shardtrain.plan.memory import human

        pick = self.candidate
        fits = [c for c in self.candidates if c.peak <= self.budget]
        lines = [f"layout auto: {pick.name}: predicted {human(pick.peak)} per rank of {human(self.budget)} "
                 f"({self.budget_source}), {self.step_s(pick) * 1e3:.0f} ms per step; the fastest predicted of the "
                 f"{len(fits)} of {len(self.candidates)} candidates that fit"]
        lines.append(f"    {'candidate (*: chosen, x: does not fit)':<48} {'peak/rank':>10} {'step':>11}")
        for c in sorted(self.candidates, key=self.step_s):
            mark = "*" if c is pick else (" " if c.peak <= self.budget else "x")
            lines.append(f"  {mark} {c.name:<48} {human(c.peak):>10} {self.step_s(c) * 1e3:8.0f} ms")
        return "\n".join(lines)


def choose(candidates: list[Candidate], budget: int, rates: Rates) -> int:
    """Index of the fastest predicted candidate whose peak fits `budget` (ties within `TIE`: the smaller peak).

    Raises:
        FSDPConfigError: none fits (names the smallest and what else can shrink memory).
    """
    fits = [i for i, c in enumerate(candidates) if c.peak <= budget]
    if not fits:
        from shardtrain.plan.memory import human

        least = min(candidates, key=lambda c: c.peak)
        raise FSDPConfigError(f"fsdp_config 'layout': \"auto\": no layout fits {human(budget)} per rank (the "
                              f"smallest, {least.name}, needs {human(least.peak)}); raise max_memory_per_rank, add "
                              "ranks, lower per_device_train_batch_size, or set 'cpu_offload': true")
    fastest = min(candidates[i].step_s(rates) for i in fits)
    near = [i for i in fits if candidates[i].step_s(rates) <= fastest * (1 + TIE)]
    return min(near, key=lambda i: (candidates[i].peak, candidates[i].step_s(rates)))


@dataclass(kw_only=True)
class AutoLayout:
    """A Trainer run's automatic layout: traced on rank 0 before the process group starts (`before_start`),
    agreed on by every rank once it is up (`agree`)."""

    request: Request
    candidates: list[Candidate]  # rank 0's; empty on the others
    gemm: tuple[int, int, int] | None = None
    choice: Choice | None = None  # rank 0's, after `agree`
    loss_chunk: int = 0  # the chosen loss chunk (tokens; 0: off), after `agree`

    @classmethod
    def before_start(cls, spec: Any, args: Any, model: Any, train_dataset: Any,
                     can_pipeline: bool = False) -> AutoLayout:
        """Trace the candidates on rank 0 (the launcher's RANK, or the started process group's rank); the other
        ranks only read the request. `can_pipeline`: a pipeline may be offered (`candidates.request_for`).

        Raises:
            FSDPConfigError: no model to plan, no sequence length, a run the planner cannot trace, or (process
                group already started: traced in a fresh process, `plan.fresh_process`) a model that process
                cannot rebuild.
        """
        import torch.distributed as dist

        from shardtrain.parallel.distributed import device_type

        if model is None or isinstance(model, str | os.PathLike) and not os.path.isdir(model):
            raise FSDPConfigError("fsdp_config 'layout': \"auto\" plans the model passed to Trainer(model=...); "
                                  "with model_init (or a hub name) set the layout by hand ('layout': \"manual\")")
        request = request_for(spec, args, train_dataset, device_type(), can_pipeline=can_pipeline)
        if not dist.is_initialized():
            if int(os.environ.get("RANK", "0")) != 0:
                return cls(request=request, candidates=[])
            candidates, gemm = trace_candidates(model, spec.fsdp, request)
            return cls(request=request, candidates=candidates, gemm=gemm)
        # the process group is up (TRL's trainers start it): the planner's fake group cannot join this process, so
        # rank 0 traces in a fresh one, and every rank stops with its error if it cannot
        from shardtrain.parallel.collectives import agree
        from shardtrain.plan.fresh_process import trace_in_fresh_process

        candidates, gemm, problem = [], None, None
        if dist.get_rank() == 0:
            try:
                candidates, gemm = trace_in_fresh_process(model, spec.fsdp, request)
            except FSDPConfigError as err:
                problem = str(err)
        agree(problem, FSDPConfigError)
        return cls(request=request, candidates=candidates, gemm=gemm)

    def agree(self, spec: Any, backend: Any) -> Any:
        """Every rank: measure the rates, rank 0 chooses and broadcasts (sharding, AC, loss chunk); returns
        `spec` with the chosen layout, the loss chunk included when the arguments left it to the choice."""
        link, round_trip = measure_link(backend.device) if backend.world_size > 1 else ({}, 0.0)
        picked = torch.zeros(4, dtype=torch.int64, device=backend.device)
        problem = None
        if backend.rank == 0:
            per_op, per_selective_op = measure_host(backend.device)
            rates = Rates(compute_rate(self.gemm, backend.device, self.request.compute_dtype),
                          link.get("allgather", float("inf")), round_trip, per_op, per_selective_op,
                          link_by_kind=link)
            budget, source = default_budget(spec.fsdp, backend.device, spec.local_world_size or backend.world_size)
            try:
                chosen = choose(self.candidates, budget, rates)
            except FSDPConfigError as err:
                problem = str(err)
            else:
                self.choice = Choice(candidates=self.candidates, chosen=chosen, budget=budget, budget_source=source,
                                     rates=rates)
                pick = self.choice.candidate
                picked[:] = torch.tensor([SHARDINGS.index(pick.sharding), list(AC_VALUES).index(pick.ac),
                                          pick.loss_chunk, pick.pp])
                print(self.choice.report(), flush=True)
        if backend.world_size > 1:
            from shardtrain.parallel.collectives import agree

            agree(problem, FSDPConfigError)  # every rank raises rank 0's problem, before anything is built
            backend.broadcast(picked)
        elif problem is not None:
            raise FSDPConfigError(problem)
        sharding, ac, self.loss_chunk, pp = (int(v) for v in picked.cpu())
        fsdp = layout_config(spec.fsdp, SHARDINGS[sharding] if self.request.choose_sharding else None,
                             list(AC_VALUES)[ac])
        chunk = {"loss_chunk_size": self.loss_chunk or None} if self.request.choose_loss_chunk else {}
        if pp > 1:  # a pipeline: pp x the accumulation steps over world / pp data ranks, the same global batch
            chunk.update(sizes={**spec.sizes, "pp": pp}, accumulation_factor=pp)
        return dataclasses.replace(spec, fsdp=fsdp, **chunk)
