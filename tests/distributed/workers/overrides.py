"""A `Trainer` subclass that overrides Hugging Face's override points with Hugging Face's signatures and counts
the calls, on shardtrain's Trainer or on transformers' own (one process).

    python overrides.py ours|hf OUT.json

The `compute_loss` override doubles the loss, so training and evaluation losses show whether it was used; the
`get_train_dataloader` override feeds two batches of 4 per epoch in dataset order, and `get_eval_dataloader`
returns a plain DataLoader of its own.
Writes the call counts, the losses, predictions on unlabeled data, what `isinstance` and the callback handler
say.
"""

import collections
import json
import sys

import torch
from transformers import BertConfig, BertForSequenceClassification, DefaultFlowCallback, PrinterCallback

N = 8


def data(seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 60, (N, 6), generator=gen)
    return [{"input_ids": ids[i].tolist(), "attention_mask": [1] * 6, "labels": int(ids[i, 0] > 30)}
            for i in range(N)]


def counting(base: type) -> type:
    class Counting(base):
        counts: collections.Counter = collections.Counter()

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            self.counts["compute_loss"] += 1
            out = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                       num_items_in_batch=num_items_in_batch)
            return (out[0] * 2.0, out[1]) if return_outputs else out * 2.0

        def training_step(self, model, inputs, num_items_in_batch=None):
            self.counts["training_step"] += 1
            return super().training_step(model, inputs, num_items_in_batch)

        def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
            self.counts["prediction_step"] += 1
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)

        def create_optimizer(self, model=None):
            self.counts["create_optimizer"] += 1
            return super().create_optimizer(model)

        def create_scheduler(self, num_training_steps, optimizer=None):
            self.counts["create_scheduler"] += 1
            return super().create_scheduler(num_training_steps, optimizer)

        def get_decay_parameter_names(self, model):
            self.counts["get_decay_parameter_names"] += 1
            return super().get_decay_parameter_names(model)

        def get_train_dataloader(self):  # two batches of 4 per epoch, in dataset order
            self.counts["get_train_dataloader"] += 1
            return torch.utils.data.DataLoader(self.train_dataset, batch_size=N // 2, collate_fn=self.data_collator)

        def get_eval_dataloader(self, eval_dataset=None):  # its own loader: batches of 4 in dataset order
            self.counts["get_eval_dataloader"] += 1
            dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
            return torch.utils.data.DataLoader(dataset, batch_size=4, collate_fn=self.data_collator)

        def get_test_dataloader(self, test_dataset):
            self.counts["get_test_dataloader"] += 1
            return super().get_test_dataloader(test_dataset)

        def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                            metric_key_prefix="eval"):
            self.counts["evaluation_loop"] += 1
            return super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys,
                                           metric_key_prefix)

        def log(self, logs, start_time=None):
            self.counts["log"] += 1
            return super().log(logs, start_time)

    return Counting


def main() -> None:
    which, out = sys.argv[1], sys.argv[2]
    if which == "ours":
        import shardtrain as lib
    else:
        import transformers as lib
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        pad_token_id=0))
    args = lib.TrainingArguments(out + ".dir", max_steps=4, per_device_train_batch_size=N,
                                 per_device_eval_batch_size=4, learning_rate=0.05, logging_steps=1,
                                 eval_strategy="steps", eval_steps=2, save_strategy="no", report_to="none",
                                 disable_tqdm=True, seed=3, use_cpu=True)
    trainer = counting(lib.Trainer)(model, args, train_dataset=data(1), eval_dataset=data(2))
    result = {"callbacks": [type(c).__name__ for c in trainer.callback_handler.callbacks]}
    trainer.remove_callback(PrinterCallback)
    result["callbacks_after_remove"] = [type(c).__name__ for c in trainer.callback_handler.callbacks]
    trainer.train()
    history = trainer.state.log_history
    # run_glue.py --do_predict on a test file without labels: compute_metrics is skipped, predictions come back
    trainer.compute_metrics = lambda p: {"accuracy": float((p.predictions.argmax(-1) == p.label_ids).mean())}
    unlabeled = [{k: v for k, v in row.items() if k != "labels"} for row in data(3)]
    prediction = trainer.predict(unlabeled)
    result.update(predictions=prediction.predictions.tolist(), label_ids=prediction.label_ids,
                  predict_metrics=sorted(prediction.metrics))
    import transformers

    result.update(
        counts=dict(trainer.counts), losses=[e["loss"] for e in history if "loss" in e],
        eval_losses=[e["eval_loss"] for e in history if "eval_loss" in e],
        trainable=trainer.get_num_trainable_parameters(),
        is_trainer=isinstance(trainer, transformers.Trainer),
        is_arguments=isinstance(args, transformers.TrainingArguments),
        has_flow=any(isinstance(c, DefaultFlowCallback) for c in trainer.callback_handler.callbacks),
        output_dir=args.output_dir)
    with open(out, "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main()
