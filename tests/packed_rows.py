"""What the packing tests read off a packed row: its positions, and whether its documents stay apart."""

import torch


def document_gap(model: torch.nn.Module, batch: dict) -> tuple[list[int], float]:
    """(position_ids of the batch's first row, max |logits of each document in the row - its logits alone|)."""
    from shardtrain.parallel.fsdp import reshard_all

    ids, positions = batch["input_ids"], batch["position_ids"]
    starts = [i for i, p in enumerate(positions[0].tolist()) if p == 0] + [ids.shape[1]]
    was_training = model.training
    model.eval()
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions).logits
        gap = max(float((packed[:, a:b] - model(input_ids=ids[:, a:b]).logits).abs().max())
                  for a, b in zip(starts, starts[1:], strict=False))
    reshard_all(model)  # FSDP2 keeps the root's parameters gathered after a forward without backward
    model.train(was_training)
    return positions[0].tolist(), gap
