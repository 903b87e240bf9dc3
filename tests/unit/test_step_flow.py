"""The schedule's small parts: the loss window behind log entries and `train_loss`, and the best-metric rule."""

import math

import torch
from transformers import TrainerState

from shardtrain import TrainingArguments
from shardtrain.train.step.step_flow import BestMetric, LossWindow, nan_inf_filtered


def test_logging_nan_inf_filter_follows_transformers_accumulation():
    assert nan_inf_filtered([1.0, 3.0, float("nan")]) == [1.0, 3.0, 4.0 / 3]
    assert nan_inf_filtered([float("inf"), 2.0]) == [0.0, 2.0]


def test_loss_window_reduces_the_sums_once_per_entry_and_averages_steps_for_train_loss():
    reduced = []

    def all_reduce(sums: torch.Tensor, group: object = None) -> None:  # a second rank with the same local sums
        reduced.append(sums.clone())
        sums.mul_(2)

    window = LossWindow(all_reduce, nan_inf_filter=False)
    assert not window and window.training_loss == 0.0
    window.add(torch.tensor(3.0), 4)
    window.add(torch.tensor(5.0), 2)
    assert window
    assert window.fold() == [1.5, 5.0]
    assert len(reduced) == 1 and reduced[0].tolist() == [3.0, 5.0]
    assert not window
    window.add(torch.tensor(1.0), 1)
    assert window.fold() == [2.0]
    assert math.isclose(window.training_loss, (1.5 + 5.0 + 2.0) / 3)


def test_loss_window_filters_non_finite_steps_when_asked():
    window = LossWindow(lambda sums, group: None, nan_inf_filter=True)
    for value in (2.0, float("nan")):
        window.add(torch.tensor(value), 1)
    assert window.fold() == [2.0, 1.0]
    unfiltered = LossWindow(lambda sums, group: None, nan_inf_filter=False)
    unfiltered.add(torch.tensor(float("inf")), 1)
    assert unfiltered.fold() == [float("inf")]


def test_best_metric_follows_greater_is_better_and_the_eval_prefix(tmp_path):
    lower = BestMetric.of(TrainingArguments(output_dir=str(tmp_path), metric_for_best_model="loss"))
    assert lower.greater_is_better is False  # Hugging Face's default for a *loss metric
    assert lower.value({"eval_loss": 0.5}) == 0.5
    assert lower.improves({"eval_loss": 0.5}, None) and lower.improves({"eval_loss": 0.5}, 0.6)
    assert not lower.improves({"eval_loss": 0.7}, 0.6) and not lower.improves({"eval_other": 1.0}, None)
    higher = BestMetric.of(TrainingArguments(output_dir=str(tmp_path), metric_for_best_model="accuracy"))
    assert higher.improves({"eval_accuracy": 0.9}, 0.8) and not higher.improves({"eval_accuracy": 0.8}, 0.8)
    assert not BestMetric.of(TrainingArguments(output_dir=str(tmp_path))).improves({"eval_loss": 0.1}, None)


def test_best_metric_records_the_step_and_only_a_saved_checkpoint(tmp_path):
    best = BestMetric.of(TrainingArguments(output_dir=str(tmp_path), metric_for_best_model="loss"))
    state = TrainerState(global_step=3)
    best.record(state, {"eval_loss": 0.5})
    assert (state.best_metric, state.best_global_step, state.best_model_checkpoint) == (0.5, 3, None)
    state.global_step = 6
    best.record(state, {"eval_loss": 0.4}, "out/checkpoint-6")
    assert (state.best_metric, state.best_global_step, state.best_model_checkpoint) == (0.4, 6, "out/checkpoint-6")
    state.global_step = 9
    best.record(state, {"eval_loss": 0.45}, "out/checkpoint-9")
    assert (state.best_metric, state.best_global_step, state.best_model_checkpoint) == (0.4, 6, "out/checkpoint-6")
