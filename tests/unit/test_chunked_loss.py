"""The chunked cross entropy equals the unchunked one (loss and every gradient), and is refused where it is not."""

import copy

import pytest
import torch
import torch.distributed as dist
from tiny_models import tiny_gpt2, tiny_llama
from transformers import CohereConfig, CohereForCausalLM, Gemma2Config, Gemma2ForCausalLM

from shardtrain.errors import ChunkedLossError
from shardtrain.train.step.chunked_loss import chunking_blocker, parse_setting, resolve_chunk_size
from shardtrain.train.step.loss import LossComputer


def _batch(vocab: int = 64, seed: int = 5) -> dict[str, torch.Tensor]:
    """3 sequences of 11 tokens (33 tokens: no chunk size below divides it evenly), padded, some labels ignored."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (3, 11), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0  # right padding
    mask[2, 4:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, :3] = -100  # a prompt that is not learned
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _loss_and_grads(model: torch.nn.Module, chunk_size: int, batch: dict) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss, outputs = LossComputer(model, torch.device("cpu"), chunk_size=chunk_size).compute(batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, outputs


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("chunk_size", [1, 5, 7, 32, 1000])
def test_chunked_equals_unchunked(tie, chunk_size):
    model, batch = tiny_llama(tie=tie), _batch()
    ref_loss, ref_grads, ref_out = _loss_and_grads(model, 0, batch)
    loss, grads, outputs = _loss_and_grads(model, chunk_size, batch)
    assert ref_out.logits.shape == (3, 11, 64)
    assert "logits" not in outputs  # the head's input is not handed out as logits
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-6, atol=1e-6, msg=name)
    head = model.lm_head.weight
    assert head.grad is not None and head.grad.abs().sum() > 0  # the head learns (tied: through the embedding too)
    if tie:
        assert head is model.model.embed_tokens.weight


def test_the_head_is_restored_and_the_loss_matches_the_models_own():
    model, batch = tiny_llama(), _batch()
    loss, _ = LossComputer(model, torch.device("cpu"), chunk_size=4).compute(batch)
    assert "forward" not in vars(model.lm_head)  # the instance's forward was put back
    own = model(**batch)  # transformers' mean loss over the (shifted) target tokens
    targets = (batch["labels"][:, 1:] != -100).sum()
    torch.testing.assert_close(loss / targets, own.loss, rtol=1e-6, atol=1e-6)
    assert own.logits.shape == (3, 11, 64)


def test_keep_logits_and_evaluation():
    model, batch = tiny_llama(), _batch()
    computer = LossComputer(model, torch.device("cpu"), chunk_size=5)
    with torch.no_grad():
        chunked, no_logits = computer.forward(batch)
        full, logits = computer.forward(batch, keep_logits=True)  # predictions need the logits: unchunked
    assert no_logits is None and logits.shape == (3, 11, 64)
    torch.testing.assert_close(chunked, full, rtol=1e-6, atol=1e-6)


def test_context_parallel_style_shift_labels():
    """Under context parallelism the batch carries already shifted `shift_labels` for its local tokens."""
    model, batch = tiny_llama(), _batch()
    shifted = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=-100)
    local = {"input_ids": batch["input_ids"][:, 2:9], "shift_labels": shifted[:, 2:9],
             "position_ids": torch.arange(2, 9).expand(3, -1)}
    ref, ref_grads, _ = _loss_and_grads(model, 0, local)
    loss, grads, _ = _loss_and_grads(model, 4, local)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-6, atol=1e-6, msg=name)


def test_gpt2_with_tied_head():
    model, batch = tiny_gpt2(dropout=0.0), _batch()
    assert chunking_blocker(model) is None
    ref, ref_grads, _ = _loss_and_grads(model, 0, batch)
    loss, grads, _ = _loss_and_grads(model, 6, batch)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grads["transformer.wte.weight"], ref_grads["transformer.wte.weight"],
                               rtol=1e-6, atol=1e-6)


def _gemma2():
    return Gemma2ForCausalLM(Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=1, head_dim=16))


def _cohere():
    return CohereForCausalLM(CohereConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=1))


@pytest.mark.parametrize("build,needle", [(_gemma2, "final_logit_softcapping"), (_cohere, "logit_scale")])
def test_models_that_change_the_logits_are_refused(build, needle):
    model = build()
    reason = chunking_blocker(model)
    assert reason is not None and needle in reason
    assert resolve_chunk_size("auto", model) == 0  # auto falls back to the unchunked loss
    with pytest.raises(ChunkedLossError, match="cannot be exact"):
        resolve_chunk_size(512, model)


def test_forward_source_is_read_even_without_config_keys():
    model = _gemma2()
    model.config.final_logit_softcapping = None  # the config key unset: Gemma 2's forward is still not plain
    assert "Gemma2ForCausalLM.forward does more than" in chunking_blocker(model)
    plain = tiny_llama()
    assert chunking_blocker(plain) is None
    plain.lm_head.register_forward_hook(lambda module, args, out: out * 2)  # a user's hook on the logits
    assert "hooks" in chunking_blocker(plain)


def test_other_refusals():
    model = tiny_llama()
    with pytest.raises(ChunkedLossError, match="tensor parallelism"):
        resolve_chunk_size(64, model, tensor_parallel=True)
    assert resolve_chunk_size("auto", model, tensor_parallel=True) == 0
    wrapped = copy.deepcopy(model)
    wrapped.lm_head = torch.nn.Sequential(wrapped.lm_head)
    assert "not a plain nn.Linear" in chunking_blocker(wrapped)


def test_settings():
    assert parse_setting(None) is None and parse_setting(0) is None and parse_setting("0") is None
    assert parse_setting("auto") == "auto" and parse_setting("4096") == 4096 and parse_setting(256) == 256
    for bad in (-1, 1.5, True, "many"):
        with pytest.raises(ChunkedLossError, match="loss_chunk_size"):
            parse_setting(bad)
    model = tiny_llama(vocab=128256, hidden=32, layers=1)
    assert resolve_chunk_size("auto", model) == 512  # 512 x 128256 fp32 logits: 245 MiB per chunk
    assert resolve_chunk_size(None, model) == 0 and resolve_chunk_size(300, model) == 300


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("tie,fsdp_keys", [(False, {"output_unit": True}), (False, {"output_unit": False}),
                                          (True, {})], ids=["output_unit", "head_in_root", "tied"])
def test_fsdp2_one_rank_gradients(one_rank_group, tie, fsdp_keys):
    """Under FSDP2 the head's gradient reaches its sharded parameter (reduce-scatter included) and equals the
    unsharded model's."""
    from shardtrain.config.fsdp_config import FSDPConfig
    from shardtrain.parallel.fsdp import apply_fsdp

    reference, batch = tiny_llama(tie=tie), _batch()
    _, ref_grads, _ = _loss_and_grads(reference, 0, batch)
    for chunk_size in (0, 7):
        model = tiny_llama(tie=tie)
        apply_fsdp(model, FSDPConfig.load({"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"], **fsdp_keys}))
        assert resolve_chunk_size(chunk_size or None, model) == chunk_size
        loss, _ = LossComputer(model, torch.device("cpu"), chunk_size=chunk_size).compute(batch)
        loss.backward()
        for name, param in model.named_parameters():
            grad = param.grad.full_tensor()
            torch.testing.assert_close(grad, ref_grads[name], rtol=1e-6, atol=1e-6, msg=f"{chunk_size} {name}")


def test_fsdp2_head_unit_that_reshards_is_refused(one_rank_group):
    from shardtrain.config.fsdp_config import FSDPConfig
    from shardtrain.parallel.fsdp import apply_fsdp

    model = tiny_llama()
    apply_fsdp(model, FSDPConfig.load({"auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": 1000}))
    assert "reshards after forward" in chunking_blocker(model)
    assert resolve_chunk_size("auto", model) == 0


def test_training_arguments(tmp_path):
    from shardtrain import TrainingArguments
    from shardtrain.errors import TrainingArgumentsError

    assert TrainingArguments(output_dir=str(tmp_path)).loss_chunk_size is None  # off unless asked for
    assert TrainingArguments(output_dir=str(tmp_path), loss_chunk_size="512").loss_chunk_size == 512
    assert TrainingArguments(output_dir=str(tmp_path), loss_chunk_size="auto").loss_chunk_size == "auto"
    with pytest.raises(TrainingArgumentsError, match="loss_chunk_size"):
        TrainingArguments(output_dir=str(tmp_path), loss_chunk_size=-1)
