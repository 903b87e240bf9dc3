"""TRL's GRPO, RLOO (transformers' generation, no vLLM), KTO (its default KL loss and apo_zero_unpaired) and reward
trainers, run by TRL's own classes ("trl") or by `shardtrain.trl`'s on shardtrain's engine ("ours"), with the same
global batch and seeds.

    python trl_rl.py trl OUT kto,kto_apo,reward                       (layout-independent: TRL on one process)
    torchrun --nproc_per_node 2 trl_rl.py trl OUT grpo,rloo           (prompts split per process: TRL on 2)
    torchrun --nproc_per_node 2 trl_rl.py ours OUT grpo,rloo,kto,kto_apo,reward

Writes OUT/<case>.json: per-step losses and gradient norms, and for GRPO / RLOO the mean reward, its standard
deviation and the completion lengths of each step (the generations).
"""

import copy
import json
import random
import sys

import datasets
from transformers import LlamaConfig, LlamaForSequenceClassification
from trl_runs import MODE, OUT, RANK, WORLD, arguments, classes, model, text, tokenizer

CASES = sys.argv[3].split(",")
GLOBAL = 8  # samples per optimizer step


def length_reward(completions, **kwargs) -> list[float]:
    return [len(completion.split()) / 10.0 for completion in completions]


def history(trainer, *keys: str) -> dict:
    logs = [h for h in trainer.state.log_history if "loss" in h and "grad_norm" in h]
    out = {"losses": [h["loss"] for h in logs], "grad_norms": [h["grad_norm"] for h in logs]}
    out.update({key: [h[key] for h in logs] for key in keys})
    return out


def online(name: str) -> dict:
    """GRPO or RLOO: 4 generations of each of 2 prompts per process and step, rewarded by their length."""
    rng = random.Random(0)
    rows = datasets.Dataset.from_list([{"prompt": text(rng, 2, 5)} for _ in range(16)])
    trainer_cls, config_cls = classes(name.upper())
    args = arguments(config_cls, name, per_device_train_batch_size=GLOBAL // WORLD, num_generations=4,
                     max_completion_length=6, max_steps=3, beta=0.0)  # no reference model
    trainer = trainer_cls(model=model(), reward_funcs=length_reward, args=args, train_dataset=rows,
                          processing_class=tokenizer())
    trainer.train()
    return history(trainer, "reward", "reward_std", "completions/mean_length", "num_tokens")


def kto(name: str, loss_type: str) -> dict:
    rng = random.Random(0)
    rows = [{"prompt": text(rng, 2, 5) + " ", "completion": text(rng, 2, 6), "label": i % 3 != 0} for i in range(32)]
    trainer_cls, config_cls = classes("KTO")
    args = arguments(config_cls, name, per_device_train_batch_size=GLOBAL // WORLD, max_steps=3, beta=0.1,
                     loss_type=loss_type)
    policy = model()
    trainer = trainer_cls(model=policy, ref_model=copy.deepcopy(policy), args=args,
                          train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer())
    trainer.train()
    return history(trainer)


def reward(name: str) -> dict:
    rng = random.Random(0)
    pairs = [{"chosen": text(rng, 2, 8), "rejected": text(rng, 2, 8)} for _ in range(32)]
    scorer = model()  # the same backbone weights, with a one-score head
    config = LlamaConfig(**{**scorer.config.to_dict(), "num_labels": 1})
    head = LlamaForSequenceClassification(config)
    head.model.load_state_dict(scorer.model.state_dict())
    trainer_cls, config_cls = classes("Reward")
    args = arguments(config_cls, name, per_device_train_batch_size=GLOBAL // WORLD, max_steps=3)
    trainer = trainer_cls(model=head, args=args, train_dataset=datasets.Dataset.from_list(pairs),
                          processing_class=tokenizer())
    trainer.train()
    return history(trainer)


RUNS = {"grpo": lambda: online("grpo"), "rloo": lambda: online("rloo"), "kto": lambda: kto("kto", "kto"),
        "kto_apo": lambda: kto("kto_apo", "apo_zero_unpaired"), "reward": lambda: reward("reward")}


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for name in CASES:
        result = RUNS[name]()
        if RANK == 0:
            (OUT / f"{name}.json").write_text(json.dumps(result))
    if MODE == "ours":
        import shardtrain

        shardtrain.destroy_distributed()


if __name__ == "__main__":
    main()
