"""The Trainer's loss of a mixture-of-experts model is transformers' own: cross entropy + coef x load-balancing
loss (`load_balancing_loss_func`, padding masked), from token sums and the router term's local share."""

import pytest
import torch
from tiny_models import tiny_qwen3_moe

from shardtrain.train.step.loss import LossComputer
from shardtrain.train.step.router_loss import RouterLoss


def _batch():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 64, (3, 10), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0  # padded samples: the router statistics skip their padding, as transformers' do
    mask[2, 4:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@pytest.mark.parametrize("coef", [0.1, 0.001])
def test_loss_equals_transformers_moe_loss(coef):
    model = tiny_qwen3_moe(aux_coef=coef)
    batch = _batch()
    expected = model(**batch).loss
    losses = LossComputer(model, torch.device("cpu"))
    router = RouterLoss(model, None)
    assert router.enabled
    ce_sum, outputs = losses.compute(batch)
    ours = ce_sum / losses.items(batch) + router.local_share(outputs, batch)
    assert ours.item() == pytest.approx(expected.item(), abs=1e-6)
    ours.backward()
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0  # the router learns from the term


def test_mixtral_config_names_its_experts_num_local_experts():
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                             num_experts_per_tok=2, output_router_logits=True,
                                             router_aux_loss_coef=0.1, max_position_embeddings=64))
    batch = _batch()
    losses, router = LossComputer(model, torch.device("cpu")), RouterLoss(model, None)
    ce_sum, outputs = losses.compute(batch)
    ours = ce_sum / losses.items(batch) + router.local_share(outputs, batch)
    assert ours.item() == pytest.approx(model(**batch).loss.item(), abs=1e-6)


def test_router_loss_off_without_router_logits():
    model = tiny_qwen3_moe()
    model.config.output_router_logits = False
    assert not RouterLoss(model, None).enabled
    from tiny_models import tiny_llama

    assert not RouterLoss(tiny_llama(), None).enabled
