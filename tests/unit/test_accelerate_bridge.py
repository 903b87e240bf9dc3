"""The engine's Accelerate `Accelerator`: `gather_for_metrics` leaves out placeholder micro-batches (one
process here; two ranks against TRL's own trainer in tests/distributed/test_trl.py)."""

from types import SimpleNamespace

import torch

from shardtrain.parallel.accelerate_bridge import engine_accelerator


def test_a_placeholder_micro_batch_contributes_nothing_to_gather_for_metrics():
    standing_in = [False]
    backend = SimpleNamespace(is_xla=False, world_size=1, device=torch.device("cpu"))
    accelerator = engine_accelerator(backend, standing_in=lambda: standing_in[0])
    assert accelerator.gather_for_metrics(torch.tensor(5.0)).item() == 5.0
    assert accelerator.gather_for_metrics(["a", "b"]) == ["a", "b"]
    standing_in[0] = True
    tokens = accelerator.gather_for_metrics(torch.tensor([3, 4]))
    assert tokens.tolist() == [0, 0]  # every rank stands in: zeros (sums stay exact, means finite)
    assert accelerator.gather_for_metrics(["a", "b"]) == []
