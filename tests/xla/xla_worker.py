"""Training runs through our Trainer in a process of their own, for tests/xla; prints `RESULT <json>` last.

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 python tests/xla/xla_worker.py '{"mode": "spmd", "out": "/tmp/x", ...}'
    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 python tests/xla/xla_worker.py '[{"mode": "spmd", ...}, {...}]'  # in turn

mode: "eager" (fsdp off, plain torch on the CPU, global batch in one process: the reference), "spmd"
(fsdp_config xla + xla_fsdp_v2 on every XLA device), "v1" (the v1 wrapper on one XLA device). Each run is its
own process: a CPU backward before the first XLA backward in one process trips an autograd device assert.
"""

from __future__ import annotations

import json
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB, SEQ = 64, 12


def tiny_llama(tie: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=tie, pad_token_id=0)
    return LlamaForCausalLM(config).float()


def tiny_gpt2(dropout: float = 0.1) -> torch.nn.Module:
    """Dropout (0.1) everywhere and tied input/output embeddings."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=dropout,
                        embd_pdrop=dropout, attn_pdrop=dropout, tie_word_embeddings=True, pad_token_id=0)
    return GPT2LMHeadModel(config)


def padded_dataset(n: int) -> list[dict]:
    """Lengths 6..12: batches are padded (two lengths only, so XLA compiles few graphs)."""
    g = torch.Generator().manual_seed(2)
    rows = []
    for i in range(n):
        length = 6 if i % 2 else SEQ
        ids = torch.randint(1, VOCAB, (length,), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": ids})
    return rows


def dataset(n: int) -> list[dict]:
    """Fixed-length samples (one graph shape for XLA); labels -100 on the first two tokens of every sample."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (n, SEQ), generator=g)
    return [{"input_ids": row.tolist(), "labels": [-100, -100] + row.tolist()[2:]} for row in ids]


def probe() -> torch.Tensor:
    return torch.arange(1, 2 * SEQ + 1).remainder(VOCAB - 1).add(1).view(2, SEQ)


def run(spec: dict) -> dict:
    from shardtrain import Trainer, TrainingArguments

    mode, devices = spec["mode"], spec.get("devices", 1)
    xla = mode != "eager"
    fsdp_config = {"xla": True, "xla_fsdp_v2": mode == "spmd", **spec.get("fsdp_config", {})} if xla else None
    # the reference feeds the whole global batch from one process; SPMD feeds per_device x devices itself
    batch = spec["batch"] * (devices if mode == "eager" else 1)
    args = TrainingArguments(output_dir=spec["out"], fsdp=xla, fsdp_config=fsdp_config, max_steps=spec["steps"],
                             per_device_train_batch_size=batch, learning_rate=1e-3, weight_decay=0.0,
                             lr_scheduler_type="constant", max_grad_norm=spec.get("max_grad_norm", 1.0),
                             logging_steps=1, save_steps=spec.get("save_steps", 10_000), seed=0, report_to="none",
                             disable_tqdm=True, gradient_accumulation_steps=spec.get("accumulation", 1))
    gpt2 = spec.get("model") == "gpt2"
    model = tiny_gpt2(spec.get("dropout", 0.1)) if gpt2 else tiny_llama(spec.get("tie", False))
    data = padded_dataset(spec.get("samples", 64)) if gpt2 else dataset(spec.get("samples", 64))
    trainer = Trainer(model, args, train_dataset=data)
    result: dict = {"wrap": describe(trainer.model) if xla else None}
    trainer.train(resume_from_checkpoint=spec.get("resume"))
    result["losses"] = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
    if mode == "spmd" and not gpt2:
        import torch_xla

        result["sharding"] = {n: torch_xla._XLAC._get_xla_sharding_spec(p) for n, p in model.named_parameters()}
    if spec.get("save_model"):
        trainer.save_model(spec["save_model"])
        trainer.model.eval()
        with torch.no_grad():
            mine = trainer.model(input_ids=probe().to(trainer.device)).logits.cpu()
        loaded = type(model).from_pretrained(spec["save_model"]).eval()
        with torch.no_grad():
            theirs = loaded(input_ids=probe()).logits
        result["logits_max_diff"] = (mine - theirs).abs().max().item()
        result["saved_files"] = sorted(p.name for p in __import__("pathlib").Path(spec["save_model"]).iterdir())
    return result


def describe(model: torch.nn.Module) -> dict:
    """What the XLA wrapping did: wrapper classes by module name, checkpointed modules, wrapper settings."""
    wrappers = {name: type(m).__name__ for name, m in model.named_modules()
                if type(m).__name__ in ("XlaFullyShardedDataParallel", "SpmdFullyShardedDataParallel")}
    checkpointed = [name for name, m in model.named_modules() if "_xla_checkpointed_forward_original" in vars(m)]
    settings = {k: str(getattr(model, k)) for k in ("compute_dtype", "flatten_parameters", "reshard_after_forward")
                if hasattr(model, k) and type(model).__name__ == "XlaFullyShardedDataParallel"}
    return {"wrappers": wrappers, "checkpointed": checkpointed, "settings": settings}


if __name__ == "__main__":
    # one run, or several one after the other in this process (runs that are independent of each other: a process
    # costs ~9 CPU-s of imports before it trains)
    spec = json.loads(sys.argv[1])
    print("RESULT " + json.dumps([run(one) for one in spec] if isinstance(spec, list) else run(spec)), flush=True)
