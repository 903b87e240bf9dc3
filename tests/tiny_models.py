"""Tiny models built from configs (no downloads) and deterministic data for tests."""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM


def tiny_llama(seed: int = 0, tie: bool = False, layers: int = 2, vocab: int = 64,
               hidden: int = 32, attention_dropout: float = 0.0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=tie, attn_implementation="eager", attention_dropout=attention_dropout)
    model = LlamaForCausalLM(config)
    if tie:
        model.tie_weights()
    return model


def tiny_gpt2(seed: int = 0, dropout: float = 0.1, vocab: int = 64, hidden: int = 32) -> GPT2LMHeadModel:
    """GPT-2 with dropout on embeddings, attention and residuals, and tied input/output embeddings."""
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=2, n_head=4, n_positions=64,
                        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, attn_implementation="eager")
    return GPT2LMHeadModel(config)


def token_batches(steps: int, batch: int, seq: int = 12, vocab: int = 64, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq), generator=gen) for _ in range(steps)]


def variable_length_dataset(n: int = 96, vocab: int = 64, min_len: int = 4, max_len: int = 16, seed: int = 3) -> list:
    """Samples of different lengths (so batches are padded), as a list of dicts."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=gen).tolist()
    return [{"input_ids": torch.randint(1, vocab, (length,), generator=gen).tolist()} for length in lengths]


def tiny_qwen2(seed: int = 0, sliding_window: int | None = 4):
    """Qwen2 (grouped-query attention); with `sliding_window`, its second layer attends to the last 4 tokens only."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         use_sliding_window=sliding_window is not None, sliding_window=sliding_window,
                         max_window_layers=1, attn_implementation="sdpa")
    return Qwen2ForCausalLM(config)


def tiny_qwen3_moe(seed: int = 0, experts: int = 8, top_k: int = 2, aux_coef: float = 0.1):
    """Qwen3-MoE: 2 layers of `experts` routed experts (fused 3-D weights), top-k routing, and the router's
    load-balancing loss on (output_router_logits) with a large coefficient, so that it moves the weights."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_experts=experts, num_experts_per_tok=top_k, max_position_embeddings=64,
                            output_router_logits=True, router_aux_loss_coef=aux_coef, norm_topk_prob=True,
                            attn_implementation="eager")
    return Qwen3MoeForCausalLM(config)


def word_tokenizer(chat_template: str | None = None):
    """A tokenizer of 60 words w0..w59 (ids 0-59) plus <pad> 60, <eos> 61, <unk> 62, split on whitespace: TRL's
    trainers and `Auto*.from_pretrained` take it as a real one (it saves and loads)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(60)} | {"<pad>": 60, "<eos>": 61, "<unk>": 62}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>",
                                        unk_token="<unk>")
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def words(rng, low: int, high: int) -> str:
    """A text of `low` to `high` - 1 words of `word_tokenizer`, drawn from `rng` (a `random.Random`)."""
    return " ".join(f"w{rng.randrange(60)}" for _ in range(rng.randrange(low, high)))


def word_llama(seed: int = 0) -> LlamaForCausalLM:
    """The 2-layer Llama for `word_tokenizer` (vocab 64, pad 60, eos 61)."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, pad_token_id=60,
                                        eos_token_id=61))
