"""When the Trainer logs, evaluates and saves (Hugging Face's DefaultFlowCallback and the control flags), under
shardtrain's Trainer or transformers' own (one process).

    python flow.py ours|hf OUT.json

Four runs of a tiny BERT classifier: step strategies with logging_first_step and eval_delay; epoch strategies
stopped by max_steps in the middle of an epoch; the step strategies with DefaultFlowCallback removed; a callback
of the user's that asks for evaluations, with save_strategy "best". Writes each run's events in order:
("log", step, what the entry holds), ("evaluate", step), ("save", step), ("epoch_end", step), and the checkpoints.
"""

import json
import sys
from pathlib import Path

import torch
from transformers import BertConfig, BertForSequenceClassification, DefaultFlowCallback, TrainerCallback

STEPS = dict(max_steps=11, logging_strategy="steps", logging_steps=3, logging_first_step=True,
             eval_strategy="steps", eval_steps=4, eval_delay=5, save_strategy="steps", save_steps=5)
EPOCHS = dict(num_train_epochs=3, max_steps=7, logging_strategy="epoch", eval_strategy="epoch", save_strategy="epoch")
BEST = dict(max_steps=8, logging_steps=100, eval_strategy="steps", eval_steps=3, save_strategy="best",
            metric_for_best_model="eval_loss")


def data(n: int, seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % 2
    ids = torch.randint(10, 50, (n, 8), generator=gen) + 40 * labels[:, None]
    return [{"input_ids": ids[i].tolist(), "attention_mask": [1] * 8, "labels": int(labels[i])} for i in range(n)]


class Events(TrainerCallback):
    def __init__(self) -> None:
        self.seen = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        kind = "train" if "train_runtime" in logs else "eval" if "eval_loss" in logs else \
            "loss" if "loss" in logs else "other"
        self.seen.append(("log", state.global_step, kind))

    def on_evaluate(self, args, state, control, **kwargs):
        self.seen.append(("evaluate", state.global_step))

    def on_save(self, args, state, control, **kwargs):
        self.seen.append(("save", state.global_step))

    def on_epoch_end(self, args, state, control, **kwargs):
        self.seen.append(("epoch_end", state.global_step))


class AskForEvaluation(TrainerCallback):
    """The user's flow: evaluate at steps 2, 5 and 8 too."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step in (2, 5, 8):
            control.should_evaluate = True


def main() -> None:
    which, out = sys.argv[1], Path(sys.argv[2])
    if which == "ours":
        from shardtrain import Trainer, TrainingArguments
    else:
        from transformers import Trainer, TrainingArguments
    result = {}
    for name, settings, no_flow, ask in (("steps", STEPS, False, False), ("epochs", EPOCHS, False, False),
                                         ("no_flow", STEPS, True, False), ("best", BEST, False, True)):
        torch.manual_seed(0)
        config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                            intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0, classifier_dropout=0.0, num_labels=2, pad_token_id=0)
        run_dir = out.with_suffix("") / name
        args = TrainingArguments(output_dir=str(run_dir), per_device_train_batch_size=8, per_device_eval_batch_size=8,
                                 learning_rate=1e-3, report_to=[], disable_tqdm=True, seed=0, use_cpu=True,
                                 **settings)
        events = Events()
        callbacks = [events, AskForEvaluation()] if ask else [events]
        trainer = Trainer(BertForSequenceClassification(config), args, train_dataset=data(24, 1),
                          eval_dataset=data(8, 2), callbacks=callbacks)
        if no_flow:
            trainer.remove_callback(DefaultFlowCallback)
        trainer.train()
        result[name] = {"events": events.seen, "best": trainer.state.best_model_checkpoint,
                        "checkpoints": sorted(p.name for p in run_dir.glob("checkpoint-*"))}
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
