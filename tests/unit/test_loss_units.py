"""`LossUnits`: Hugging Face's loss units and the engine's token sums convert into each other exactly; the factor
is the number of ranks with distinct data under `average_tokens_across_devices`, 1 otherwise."""

import torch

from shardtrain.train.step.loss_units import LossUnits


def test_the_factor_counts_the_ranks_with_distinct_data():
    assert LossUnits.of(world_size=8, copies=2, average_tokens_across_devices=True).scale == 4
    assert LossUnits.of(world_size=8, copies=2, average_tokens_across_devices=False).scale == 1


def test_a_token_sum_goes_to_hugging_faces_units_and_back():
    units, loss_sum, items = LossUnits(4), torch.tensor(12.5), torch.tensor(10)
    hf = units.from_sum(loss_sum, items)
    assert hf.item() == 12.5 / 10 * 4 == units.hf(loss_sum / items).item()
    assert units.to_sum(hf, items).item() == 12.5
