"""Run the bad-input cases in one process group and record, per case, what was raised and what changed on disk.

    torchrun --nproc_per_node 2 bad_inputs.py ROOT_DIR [CASE,CASE]   # rank 0 writes ROOT_DIR/results.json

Every case builds its Trainer the way a user would and must fail with a `UserError` that every rank raises
at the same point (so the group stays usable for the next case), before any file under the case's
directory changes. A few cases are expected to succeed (an explicit argument beats the environment, a
damaged newest checkpoint is skipped): they record what happened instead.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist
from tiny_models import tiny_gpt2, tiny_llama, tiny_qwen3_moe, variable_length_dataset

from shardtrain import Trainer, TrainingArguments
from shardtrain.errors import UserError
from shardtrain.parallel.distributed import barrier, init_distributed
from shardtrain.train.data.batch_plan import PaddingCollator

DATA = variable_length_dataset(n=32)
BASE = {"fsdp": True, "max_steps": 2, "per_device_train_batch_size": 4, "save_strategy": "no",
        "disable_tqdm": True, "logging_steps": 1}


def args(out: Path, **kw) -> TrainingArguments:
    return TrainingArguments(output_dir=str(out), **{**BASE, **kw})


def train(out: Path, data=DATA, resume=None, model=None, **kw) -> None:
    Trainer(model or tiny_llama(), args(out, **kw), train_dataset=data).train(resume_from_checkpoint=resume)


def tiny_llama_one_kv_head():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64))


def lora_llama():
    from peft import LoraConfig, get_peft_model

    return get_peft_model(tiny_llama(), LoraConfig(r=4, target_modules=["q_proj"]))


def lora_moe():
    from peft import LoraConfig, get_peft_model

    return get_peft_model(tiny_qwen3_moe(), LoraConfig(r=4, target_modules=["q_proj"]))


def tiny_bert_classifier():
    from transformers import BertConfig, BertForSequenceClassification

    return BertForSequenceClassification(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                                    num_attention_heads=2, intermediate_size=64))


def ids(*rows: list) -> list[dict]:
    return [{"input_ids": row} for row in rows] + DATA[:8]


@contextlib.contextmanager
def environ(**values: str):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def damage(kind: str) -> Callable[[Path], None]:
    """Return a function that damages checkpoint-4 of a copied run directory."""
    def apply(out: Path) -> None:
        ckpt = out / "checkpoint-4"
        if kind == "state":
            (ckpt / "trainer_state.json").write_text("{not json")
        elif kind == "scheduler":
            text = (ckpt / "scheduler.json").read_text()
            (ckpt / "scheduler.json").write_text(text.replace('"last_epoch": 4', '"last_epoch": 3'))
        elif kind == "rng":
            (ckpt / "rng_state_0.pt").unlink()
        elif kind == "metadata":
            (ckpt / "sharded" / ".metadata").unlink()
        elif kind == "shard":
            shard = ckpt / "sharded" / "__1_0.distcp"
            shard.write_bytes(shard.read_bytes()[:100])
        elif kind == "manifest":
            (ckpt / "manifest.json").unlink()
    return apply


# name -> (group, expected message fragments, setup(out) or None, body(out))
CASES: dict[str, tuple[str, list[str], Callable | None, Callable]] = {}


def case(name: str, group: str, fragments: list[str], body: Callable, setup: Callable | None = None) -> None:
    CASES[name] = (group, fragments, setup, body)


# -- arguments: types, ranges, NaN/inf, choices, contradictions ---------------------------------------------
for field, value, words in [
    ("max_grad_norm", math.nan, ["max_grad_norm", "nan"]), ("learning_rate", math.nan, ["learning_rate", "nan"]),
    ("learning_rate", math.inf, ["learning_rate", "inf"]), ("learning_rate", -1e-3, ["learning_rate"]),
    ("adam_beta1", "0.9", ["adam_beta1", "'0.9'"]), ("adam_beta2", 1.5, ["adam_beta2", "1.5"]),
    ("adam_epsilon", math.nan, ["adam_epsilon"]), ("weight_decay", -0.1, ["weight_decay"]),
    ("seed", "abc", ["seed", "'abc'"]), ("seed", 1.5, ["seed", "1.5"]),
    ("per_device_train_batch_size", 0, ["per_device_train_batch_size"]),
    ("per_device_train_batch_size", "8", ["per_device_train_batch_size", "'8'"]),
    ("per_device_eval_batch_size", -2, ["per_device_eval_batch_size"]),
    ("gradient_accumulation_steps", 0, ["gradient_accumulation_steps"]), ("max_steps", 0, ["max_steps"]),
    ("max_steps", -5, ["max_steps"]), ("warmup_steps", -1, ["warmup_steps"]), ("logging_steps", 0, ["logging_steps"]),
    ("save_steps", 0, ["save_steps"]), ("save_total_limit", 0, ["save_total_limit"]), ("eval_steps", 0, ["eval_steps"]),
    ("lr_scheduler_type", "cosine_warm", ["lr_scheduler_type", "cosine_warm"]),
    ("optim", "adafactor", ["optim", "adafactor"]),
    ("eval_strategy", "sometimes", ["eval_strategy", "sometimes"]),
    ("report_to", "wandbb", ["report_to", "wandbb", "mlflow"]),
    ("bf16", "yes", ["bf16", "'yes'"]), ("ddp_timeout", 0, ["ddp_timeout"]), ("ddp_timeout", "30", ["ddp_timeout"]),
    ("resume_from_checkpoint", 3, ["resume_from_checkpoint", "3"]), ("dataloader_num_workers", -1, ["dataloader"]),
]:
    case(f"args_{field}_{value}", "arguments", words, lambda out, f=field, v=value: args(out, **{f: v}))
case("args_max_steps_and_epochs", "arguments", ["num_train_epochs"],
     lambda out: args(out, max_steps=-1, num_train_epochs=0))
case("args_bf16_and_fp16", "arguments", ["bf16", "fp16"], lambda out: args(out, bf16=True, fp16=True))
case("args_fsdp_config_typo", "arguments", ["reshard_after_forwad", "reshard_after_forward"],
     lambda out: args(out, fsdp_config={"reshard_after_forwad": True}))
case("args_fsdp_string", "arguments", ["fsdp", "fulll_shard"], lambda out: args(out, fsdp="fulll_shard"))
case("args_cp_and_sp", "arguments", ["cp_size", "sp_size"], lambda out: args(out, cp_size=2, sp_size=2))
case("args_cp_twice", "arguments", ["cp_size", "parallelism_config"],
     lambda out: args(out, cp_size=2, parallelism_config={"cp_size": 1}))
case("args_parallelism_typo", "arguments", ["cp_sise", "cp_size"],
     lambda out: args(out, parallelism_config={"parallelism_config_cp_sise": 2}))
case("args_cp_alltoall", "arguments", ["cp_comm_strategy", "alltoall", "allgather"],
     lambda out: args(out, parallelism_config={"cp_size": 2, "cp_comm_strategy": "alltoall"}))
case("args_ep_without_fsdp", "arguments", ["ep_size", "fsdp"], lambda out: args(out, ep_size=2, fsdp=""))
case("parallel_ep_dense_model", "parallelism", ["ep_size = 2", "LlamaForCausalLM", "no routed experts"],
     lambda out: train(out, ep_size=2))
case("parallel_ep_not_dividing_experts", "parallelism", ["ep_size = 2", "does not divide the 3 experts"],
     lambda out: train(out, ep_size=2, model=tiny_qwen3_moe(experts=3)))
case("parallel_ep_not_dividing_ranks", "parallelism", ["ep_size = 4", "dp_shard x cp x tp = 2"],
     lambda out: train(out, ep_size=4, model=tiny_qwen3_moe()))
case("parallel_ep_no_shard", "parallelism", ["ep_size = 2", "dp_shard x cp x tp = 1"],
     lambda out: train(out, ep_size=2, model=tiny_qwen3_moe(), fsdp_config={"sharding_strategy": "NO_SHARD"}))
case("parallel_tp_moe_without_ep", "parallelism", ["tp_size = 2", "Qwen3MoeForCausalLM", "experts", "ep_size"],
     lambda out: train(out, tp_size=2, model=tiny_qwen3_moe()))
case("parallel_ep_lora", "parallelism", ["ep_size = 2", "LoRA"],
     lambda out: train(out, ep_size=2, model=lora_moe()))
case("args_compile_cuda_graphs", "arguments", ["torch_compile_mode", "reduce-overhead", "CUDA graphs"],
     lambda out: args(out, torch_compile=True, torch_compile_mode="reduce-overhead"))
case("args_compile_with_ep", "arguments", ["torch_compile", "ep_size = 2"],
     lambda out: args(out, torch_compile=True, ep_size=2))
case("parallel_cp_router_loss", "parallelism", ["cp_size = 2", "output_router_logits"],
     lambda out: train(out, cp_size=2, model=tiny_qwen3_moe()))
case("args_cp_and_tp", "arguments", ["cp_size", "tp_size"], lambda out: args(out, cp_size=2, tp_size=2))
case("args_tp_plan_type", "arguments", ["tp_plan"], lambda out: args(out, tp_plan=["colwise"]))
case("args_batch_metrics_signature", "arguments", ["batch_eval_metrics", "compute_result"],
     lambda out: Trainer(tiny_llama(), args(out, batch_eval_metrics=True), train_dataset=DATA,
                         compute_metrics=lambda prediction: {}))
case("args_pack_sequences_type", "arguments", ["pack_sequences", "'yes'"], lambda out: args(out, pack_sequences="yes"))
case("args_pack_with_collator", "arguments", ["pack_sequences", "DataCollatorWithFlattening", "PaddingCollator",
                                              "drop data_collator"],
     lambda out: Trainer(tiny_llama(), args(out, pack_sequences=True), train_dataset=DATA,
                         data_collator=PaddingCollator()))
case("args_pack_not_causal", "arguments", ["pack_sequences", "BertForSequenceClassification", "causal"],
     lambda out: Trainer(tiny_bert_classifier(), args(out, pack_sequences=True), train_dataset=DATA))
case("args_pack_with_cache", "arguments", ["pack_sequences", "use_cache", "set use_cache False"],
     lambda out: Trainer(tiny_llama(), args(out, pack_sequences=True, use_cache=True), train_dataset=DATA))
case("parallel_tp_not_dividing", "parallelism", ["tp_size=3", "3 does not divide the 2 ranks"],
     lambda out: train(out, tp_size=3))
case("parallel_tp_bad_style", "parallelism", ["packed_colwise", "model.layers.*.mlp.down_proj", "colwise"],
     lambda out: train(out, tp_size=2, tp_plan={"model.layers.*.mlp.down_proj": "packed_colwise"}))
case("parallel_tp_no_match", "parallelism", ["model.layer.*.mlp", "matches no module"],
     lambda out: train(out, tp_size=2, tp_plan={"model.layer.*.mlp": "colwise"}))
case("parallel_tp_heads", "parallelism", ["tp_size = 2", "num_key_value_heads = 1"],
     lambda out: train(out, tp_size=2, model=tiny_llama_one_kv_head()))
case("parallel_tp_no_plan", "parallelism", ["tp_size = 2", "GPT2LMHeadModel", "tp_plan"],
     lambda out: train(out, tp_size=2, model=tiny_gpt2(dropout=0.0)))
case("parallel_tp_lora", "parallelism", ["tp_size = 2", "LoRA"],
     lambda out: train(out, tp_size=2, model=lora_llama()))
case("args_cp_without_fsdp", "arguments", ["cp_size", "fsdp"], lambda out: args(out, cp_size=2, fsdp=""))
case("parallel_cp_not_dividing", "parallelism", ["cp_size", "3", "divide", "2 ranks"],
     lambda out: train(out, cp_size=3))
case("parallel_dp_shard_too_big", "parallelism", ["dp_shard", "4", "2 ranks"],
     lambda out: train(out, parallelism_config={"dp_shard_size": 4}))
case("parallel_cp_not_causal", "parallelism", ["cp_size", "BertForSequenceClassification", "causal"],
     lambda out: train(out, cp_size=2, model=tiny_bert_classifier()))
case("parallel_cp_custom_loss", "parallelism", ["cp_size", "compute_loss"],
     lambda out: Trainer(tiny_llama(), args(out, cp_size=2), train_dataset=DATA,
                         compute_loss_func=lambda outputs, labels, num_items_in_batch: outputs.logits.sum()).train())
case("args_save_only_model_sharded", "arguments", ["save_only_model", "SHARDED_STATE_DICT"],
     lambda out: args(out, save_only_model=True, fsdp_config={"state_dict_type": "SHARDED_STATE_DICT"}))
case("args_ac_and_gc", "arguments", ["gradient_checkpointing", "activation_checkpointing"],
     lambda out: args(out, gradient_checkpointing=True, fsdp_config={"activation_checkpointing": True}))
case("args_best_without_eval", "arguments", ["load_best_model_at_end", "eval_strategy"],
     lambda out: args(out, load_best_model_at_end=True))

# -- environment set by the launcher ------------------------------------------------------------------------
ENV_CASES = {
    "use_fsdp": ("SHARDTRAIN_USE_FSDP", "maybe", ["SHARDTRAIN_USE_FSDP", "maybe"]),
    "fsdp_config": ("SHARDTRAIN_FSDP_CONFIG", "{oops", ["SHARDTRAIN_FSDP_CONFIG", "JSON"]),
    "mixed_precision": ("SHARDTRAIN_MIXED_PRECISION", "fp8", ["SHARDTRAIN_MIXED_PRECISION", "fp8"]),
    "parallelism_json": ("SHARDTRAIN_PARALLELISM", "{cp: 2", ["SHARDTRAIN_PARALLELISM", "JSON"]),
    "parallelism_value": ("SHARDTRAIN_PARALLELISM", '{"cp_size": "two"}', ["SHARDTRAIN_PARALLELISM", "cp_size", "two"]),
    "parallelism_key": ("SHARDTRAIN_PARALLELISM", '{"cp_sise": 2}', ["SHARDTRAIN_PARALLELISM", "cp_sise", "cp_size"]),
}
for key, (var, value, words) in ENV_CASES.items():
    def body(out, var=var, value=value):
        with environ(**{var: value}):
            TrainingArguments(output_dir=str(out))
    case(f"env_{key}", "environment", words, body)

# -- datasets -------------------------------------------------------------------------------------------------
for name, data, words in [
    ("empty", [], ["train_dataset", "empty"]),
    ("none", None, ["train_dataset"]),
    ("no_input_ids", [{"text": "hello"}] * 8, ["train_dataset[0]", "input_ids", "text"]),
    ("str_ids", ids("1 2 3"), ["train_dataset[0]", "input_ids", "str", "tokenize"]),
    ("float_ids", ids([1.0, 2.5, 3.0]), ["train_dataset[0]", "float"]),
    ("nested_ids", ids([[1, 2], [3, 4]]), ["train_dataset[0]", "nested"]),
    ("empty_ids", ids([]), ["train_dataset[0]", "empty"]),
    ("id_too_large", ids([1, 2, 64]), ["train_dataset[0]", "64", "vocabulary", "[0, 64)"]),
    ("negative_id", ids([1, -3, 2]), ["train_dataset[0]", "-3"]),
    ("too_long", ids(list(range(1, 60)) * 2), ["train_dataset[0]", "118 tokens", "max_position_embeddings (64)"]),
    ("labels_length", [{"input_ids": [1, 2, 3], "labels": [1, 2]}] + DATA[:8], ["train_dataset[0]", "2 labels"]),
    ("label_out_of_vocab", [{"input_ids": [1, 2, 3], "labels": [1, 99, 2]}] + DATA[:8], ["train_dataset[0]", "99"]),
    ("all_ignored", [{"input_ids": r["input_ids"], "labels": [-100] * len(r["input_ids"])} for r in DATA],
     ["no target token", "-100"]),
    ("not_a_dict", [[1, 2, 3]] * 8, ["train_dataset[0]", "list", "dict"]),
    ("late_bad_sample", DATA[:20] + ids([1, 2, 70])[:1], ["train_dataset[20]", "70"]),
    ("ragged_tensor", [{"input_ids": __import__("torch").ones(2, 3, dtype=__import__("torch").long)}] * 8,
     ["train_dataset[0]", "2-D"]),
]:
    case(f"data_{name}", "dataset", words, lambda out, d=data: train(out, data=d))


class Broken:
    def __len__(self):
        return 8

    def __getitem__(self, i):
        raise KeyError(f"row {i}")


case("data_unreadable", "dataset", ["train_dataset[0]", "cannot be read", "KeyError"],
     lambda out: train(out, data=Broken()))
case("data_eval_strategy_without_eval_set", "dataset", ["eval_strategy", "eval_dataset"],
     lambda out: train(out, eval_strategy="steps", eval_steps=1))


def bad_eval(out):
    trainer = Trainer(tiny_llama(), args(out), train_dataset=DATA, eval_dataset=ids([1, 2, 99]))
    trainer.evaluate()


case("data_bad_eval_set", "dataset", ["eval_dataset[0]", "99"], bad_eval)

# -- checkpoints ----------------------------------------------------------------------------------------------
SHARDED = {"fsdp_config": {"state_dict_type": "SHARDED_STATE_DICT"}}
for kind, words in [("state", ["trainer_state.json", "9 bytes"]), ("scheduler", ["scheduler.json", "checksum"]),
                    ("rng", ["rng_state_0.pt", "missing"]), ("metadata", [".metadata", "missing"]),
                    ("shard", ["__1_0.distcp", "bytes"]), ("manifest", ["manifest.json", "missing"])]:
    case(f"ckpt_damaged_{kind}", "checkpoint", ["checkpoint-4", *words],
         lambda out: train(out, resume=str(out / "checkpoint-4"), **SHARDED), setup=damage(kind))
case("ckpt_missing_path", "checkpoint", ["resume_from_checkpoint", "not a directory"],
     lambda out: train(out, resume=str(out / "checkpoint-999"), **SHARDED))
case("ckpt_true_without_any", "checkpoint", ["resume_from_checkpoint=True", "No valid checkpoint found"],
     lambda out: train(out / "empty", resume=True))
# fsdp=False said: on several ranks without a word of FSDP the run is data parallel (FSDP2 no_shard) and resumes it
case("ckpt_without_fsdp", "checkpoint", ["fsdp", "fsdp=True"],
     lambda out: Trainer(tiny_llama(), TrainingArguments(output_dir=str(out), max_steps=2, save_strategy="no",
                                                         fsdp=False),
                         train_dataset=DATA).train(resume_from_checkpoint=str(out / "checkpoint-4")))
case("ckpt_other_model", "checkpoint", ["does not match the model", "shape"],
     lambda out: train(out, resume=str(out / "checkpoint-4"), model=tiny_llama(hidden=48), **SHARDED))

# -- output paths ---------------------------------------------------------------------------------------------
case("out_unwritable_output_dir", "output", ["output_dir", "not writable"],
     lambda out: train(out / "keep.txt" / "run"))


def unwritable_save_model(out):
    trainer = Trainer(tiny_llama(), args(out), train_dataset=DATA)
    trainer.save_model(str(out / "keep.txt" / "final"))


case("out_unwritable_save_model", "output", ["save_model directory", "not writable"], unwritable_save_model)


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def main() -> None:
    root = Path(sys.argv[1])
    init_distributed(timeout_s=120)  # a case that desynchronises the ranks fails in 2 minutes, not 30
    rank = dist.get_rank()
    base = root / "base"
    train(base, max_steps=4, save_strategy="steps", save_steps=2, **SHARDED)  # checkpoint-2 and checkpoint-4
    only = set(sys.argv[2].split(",")) if len(sys.argv) > 2 else None
    results = {}
    for name, (group, fragments, setup, body) in CASES.items():
        if only and name not in only:
            continue
        out = root / name
        if rank == 0:
            shutil.copytree(base, out)
            (out / "keep.txt").write_text("user data")
            if setup:
                setup(out)
        barrier()
        before = snapshot(out)
        try:
            body(out)
            outcome = {"raised": None}
        except UserError as err:
            outcome = {"raised": type(err).__name__, "message": str(err), "chained": err.__cause__ is not None
                       and not err.__suppress_context__}
        except Exception as err:  # noqa: BLE001 - recorded: the test fails on anything but a UserError
            outcome = {"raised": type(err).__name__, "message": str(err)[:500], "not_user_error": True}
        barrier()
        outcome["files_unchanged"] = snapshot(out) == before
        outcome.update(group=group, fragments=fragments)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, outcome.get("raised"))
        outcome["same_on_every_rank"] = len(set(gathered)) == 1
        results[name] = outcome
    if rank == 0:
        (root / "results.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
