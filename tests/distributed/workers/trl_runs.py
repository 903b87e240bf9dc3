"""TRL's SFT (prompt-completion, completion-only loss; unpacked and packed) and DPO, run by TRL's own trainers on one
process ("trl") or by `shardtrain.trl`'s on shardtrain's engine ("ours", any number of ranks), with the same global
batch: per step 8 samples (SFT) or 4 preference pairs x 2 accumulation steps (DPO).

    python trl_runs.py trl OUT
    torchrun --nproc_per_node 2 trl_runs.py ours OUT

Cases: sft, sft_packed, dpo, dpo_path (the policy passed as a directory: TRL loads it and its reference model on
every rank, reading `args.distributed_state`) and dpo_path_meta (the same with `cpu_ram_efficient_loading` for ours:
TRL builds both on the meta device, each rank reads its shards), and (ours) sft_auto: sft with `fsdp_config`
"layout": "auto". Writes OUT/<case>.json: per-step losses, gradient norms and TRL's `num_tokens`, the eval loss
(SFT), and for the packed case the first packed row's position_ids and the largest difference between the logits of
each of its documents and those of the document run alone.
"""

import copy
import json
import logging
import os
import random
import sys
from pathlib import Path

import datasets
import torch
import trl
from launch import LogLines
from packed_rows import document_gap
from tiny_models import word_llama, word_tokenizer, words

MODE, OUT = sys.argv[1], Path(sys.argv[2])
WORLD, RANK = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))


tokenizer, text, model = word_tokenizer, words, word_llama


def classes(name: str) -> tuple[type, type]:
    if MODE == "trl":
        return getattr(trl, f"{name}Trainer"), getattr(trl, f"{name}Config")
    import shardtrain.trl

    return getattr(shardtrain.trl, f"{name}Trainer"), getattr(shardtrain.trl, f"{name}Config")


def arguments(config_cls: type, name: str, **kwargs) -> object:
    where = {"use_cpu": True} if MODE == "trl" else {"fsdp": True}
    return config_cls(output_dir=str(OUT / name), logging_steps=1, report_to="none", seed=0, save_strategy="no",
                      lr_scheduler_type="constant", learning_rate=1e-2, bf16=False, disable_tqdm=True, **where,
                      **kwargs)


def history(trainer) -> dict:
    logs = [h for h in trainer.state.log_history if "loss" in h and "grad_norm" in h]
    return {"losses": [h["loss"] for h in logs], "grad_norms": [h["grad_norm"] for h in logs],
            "num_tokens": [h.get("num_tokens") for h in logs]}


def sft(name: str, packing: bool, auto: bool = False) -> dict:
    """`auto` (ours): `fsdp_config` "layout": "auto" (TRL starts the process group before the Trainer, so the
    planner traces in a fresh process); "layout" in the result names the pick."""
    rng = random.Random(0)
    rows = [{"prompt": text(rng, 2, 6) + " ", "completion": text(rng, 2, 8)} for _ in range(40)]
    train, evaluation = datasets.Dataset.from_list(rows[:32]), datasets.Dataset.from_list(rows[32:])
    trainer_cls, config_cls = classes("SFT")
    per_device, accumulation = (8, 1) if MODE == "trl" else (8 // WORLD // 2, 2)
    args = arguments(config_cls, name, per_device_train_batch_size=per_device, per_device_eval_batch_size=4,
                     gradient_accumulation_steps=accumulation, max_steps=4, packing=packing, max_length=32,
                     completion_only_loss=True, eval_packing=False,
                     **({"fsdp_config": {"layout": "auto"}} if auto else {}))
    group_was_up = torch.distributed.is_initialized()  # TRL's config starts it (or the rank pool did)
    trainer = trainer_cls(model=model(), args=args, train_dataset=train, eval_dataset=evaluation,
                          processing_class=tokenizer())
    result = {}
    if packing:
        result["position_ids"], result["document_gap"] = document_gap(
            trainer.model, trainer.data_collator([trainer.train_dataset[0]]))
    trainer.train()
    result.update(history(trainer), eval_loss=trainer.evaluate()["eval_loss"])
    if auto and RANK == 0:
        result["layout"], result["group_was_up"] = trainer.auto_layout.choice.candidate.name, group_was_up
    return result


def dpo(name: str, by_path: bool = False, meta: bool = False) -> dict:
    """`by_path`: the policy given as a saved model's directory; TRL loads it, and the reference model from it.
    `meta` (ours): with `cpu_ram_efficient_loading`, so TRL builds both on the meta device and each rank reads its
    shards; "read_into_meta" counts the loader's reports of that, "model_init_kwargs" is what the args hold after."""
    rng = random.Random(0)
    pairs = [{"prompt": text(rng, 2, 5) + " ", "chosen": text(rng, 2, 6), "rejected": text(rng, 2, 6)}
             for _ in range(16)]
    trainer_cls, config_cls = classes("DPO")
    extra = {"fsdp_config": {"cpu_ram_efficient_loading": True}} if meta and MODE == "ours" else {}
    args = arguments(config_cls, name, per_device_train_batch_size=4 // WORLD, gradient_accumulation_steps=2,
                     max_steps=3, beta=0.1, **extra)
    policy = model()
    given = {"model": policy, "ref_model": copy.deepcopy(policy)}
    if by_path:
        policy.save_pretrained(OUT / "policy", is_main_process=RANK == 0)  # the process group is up: barrier
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        given = {"model": str(OUT / "policy")}
    said = LogLines()
    logging.getLogger("shardtrain.parallel.loading").addHandler(said)
    logging.getLogger("shardtrain.parallel.loading").setLevel(logging.INFO)
    trainer = trainer_cls(**given, args=args, train_dataset=datasets.Dataset.from_list(pairs),
                          processing_class=tokenizer())
    logging.getLogger("shardtrain.parallel.loading").removeHandler(said)
    trainer.train()
    out = history(trainer)
    if meta:
        out["read_into_meta"] = sum("into the meta-device model" in m for m in said.messages)
        out["model_init_kwargs"] = args.model_init_kwargs
    if MODE == "ours":  # the reference model is sharded like the policy
        from torch.distributed.fsdp import FSDPModule

        out["ref_sharded"] = isinstance(trainer.ref_model, FSDPModule)
    return out


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, run in (("sft", lambda: sft("sft", False)), ("sft_packed", lambda: sft("sft_packed", True)),
                      ("dpo", lambda: dpo("dpo")), ("dpo_path", lambda: dpo("dpo_path", by_path=True)),
                      ("dpo_path_meta", lambda: dpo("dpo_path_meta", by_path=True, meta=True)),
                      ("sft_auto", lambda: sft("sft_auto", False, auto=True))):
        if name == "sft_auto" and MODE == "trl":
            continue  # its reference is TRL's "sft": the layout does not change the losses
        result = run()
        if RANK == 0:
            (OUT / f"{name}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
