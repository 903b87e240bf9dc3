# Run (prepare.sh does it): .venv/bin/python scripts/trl_peer_suite/make_standins.py OUTDIR [UPSTREAM_DIR]
"""Tiny local stand-ins for the Hub repos TRL's trainer tests load, built offline (no download).

OUTDIR/trl-internal-testing/<name>/ (and OUTDIR/Qwen/Qwen3-4B) holds each repo as a local directory: the tests
call from_pretrained / load_dataset with "trl-internal-testing/<name>", a relative path that resolves to it from
the directory pytest runs in (prepare.sh links OUTDIR/<org> there; load_dataset offline needs this). The models are also put in a Hub cache, OUTDIR/hf_home/hub
(models--org--name/snapshots/<sha>, refs/main), so HF_HOME=OUTDIR/hf_home + HF_HUB_OFFLINE=1 finds them
from any directory.

Models: random bf16 weights (fixed seed) on the shapes of scripts/generate_tiny_models/ in TRL's repo (Qwen2/3,
Qwen3-MoE, Llama-3.2, Mistral-0.2, GPT-NeoX, Cohere2, GLM-4-MoE, GPT-OSS, OLMo-3, LFM2/2.5, Nemotron-H, Gemma2,
the trust_remote_code "Remote" model; sequence-classification heads for Qwen2/Qwen3/Llama), each with a byte-level
BPE tokenizer trained here on the data sets' text (~1000 tokens: the ids are not the real ones), the family's
special tokens (eos/pad/bos as the real tokenizer) and TRL's own chat template for the family
(trl/chat_templates/*.jinja). No vision-language models, no zen-image data sets.
Data sets: zen, toolcall and harmony, made by running TRL's scripts/generate_*_dataset.py from UPSTREAM_DIR
(default /tmp/peer-trl/orig, extracted by prepare.sh) with push_to_hub replaced by a local parquet write.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

import datasets
import torch
import trl
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from torch import nn
from transformers import (
    GenerationConfig,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    GPTNeoXTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    LlamaTokenizer,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2ForSequenceClassification,
    Qwen2Tokenizer,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3ForSequenceClassification,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

ORG = "trl-internal-testing"
TEMPLATES = Path(trl.__file__).parent / "chat_templates"
QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
                "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
QWEN_ADDED = ["<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
              "<|repo_name|>", "<|file_sep|>"]
QWEN3_ADDED = ["<tool_response>", "</tool_response>", "<think>", "</think>"]
LLAMA_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad_id|>", "<|start_header_id|>",
                 "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
QWEN_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
LLAMA_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
MISTRAL_TEMPLATE = (  # mistralai/Mistral-7B-Instruct-v0.2's template (not shipped by TRL)
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")


# ---------------------------------------------------------------- data sets
def make_datasets(out: Path, upstream: Path) -> list[str]:
    """Run TRL's dataset scripts with push_to_hub writing parquet + a README `configs:` block instead."""
    made = []
    for script, name in [("generate_zen_dataset.py", "zen"), ("generate_toolcall_dataset.py", "toolcall"),
                         ("generate_harmony_dataset.py", "harmony")]:
        path = upstream / "scripts" / script
        if not path.exists():
            print(f"skip {name}: {path} missing")
            continue
        root = out / ORG / name
        shutil.rmtree(root, ignore_errors=True)
        configs: list[str] = []

        def push(dd, repo_id, config_name="default", **_):
            for split, ds in dd.items():
                if "tools" in ds.column_names:  # on the Hub `tools` is a JSON string (tests json.loads it)
                    tools = [json.dumps(t) for t in ds["tools"]]
                    ds = ds.remove_columns("tools").add_column("tools", tools)
                ds.to_parquet(str(root / config_name / f"{split}-00000-of-00001.parquet"))  # noqa: B023 - called in this iteration only
            configs.append(config_name + "".join(f"\t{s}" for s in dd))  # noqa: B023

        spec = importlib.util.spec_from_file_location(f"gen_{name}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        orig = datasets.DatasetDict.push_to_hub
        datasets.DatasetDict.push_to_hub = push
        try:
            mod.main(test_size=0.1, push_to_hub=True, repo_id=f"{ORG}/{name}")
        finally:
            datasets.DatasetDict.push_to_hub = orig
        lines = ["---", "configs:"]
        for c in configs:
            cfg, *splits = c.split("\t")
            lines += [f"- config_name: {cfg}", "  data_files:"]
            lines += [f"  - split: {s}\n    path: {cfg}/{s}-00000-of-00001.parquet" for s in splits]
        (root / "README.md").write_text("\n".join(lines + ["---", f"Local stand-in for {ORG}/{name}.", ""]))
        made.append(f"{name} ({len(configs)} configs)")
    return made


def corpus(out: Path) -> list[str]:
    """Every string in the data sets made above (message contents included), plus chat-template boilerplate."""
    texts: list[str] = []

    def walk(x):
        if isinstance(x, str):
            texts.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    for f in sorted((out / ORG).glob("*/*/*.parquet")):
        walk(datasets.Dataset.from_parquet(str(f)).to_list())
    for t in TEMPLATES.glob("*.jinja"):  # "system", "assistant", "You are Qwen ...", tool-call prose
        texts.append(t.read_text())
    return texts * 2  # min_frequency 2 keeps every word seen once


# ---------------------------------------------------------------- tokenizers
def train_bpe(texts, regex, vocab_size=1000, metaspace=False):
    tok = Tokenizer(models.BPE())
    if metaspace:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
        alphabet = []
    else:
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(texts, trainer)
    data = json.loads(tok.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in data["merges"]]
    return data["vocab"], merges


def qwen_tokenizer(texts, qwen3=False):
    vocab, merges = train_bpe(texts, QWEN_REGEX)
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, unk_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                         errors="replace", model_max_length=131072, split_special_tokens=False)
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIAL], special_tokens=True)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN_ADDED + (QWEN3_ADDED if qwen3 else [])])
    tok.add_special_tokens({"additional_special_tokens": [t for t in QWEN_SPECIAL if t != "<|endoftext|>"]})
    tok.chat_template = (TEMPLATES / ("qwen3.jinja" if qwen3 else "qwen2_5.jinja")).read_text()
    assert tok.convert_tokens_to_ids("<|im_end|>") == tok.eos_token_id and tok.pad_token == "<|endoftext|>"
    return tok


def llama3_tokenizer(texts):
    vocab, merges = train_bpe(texts, LLAMA_REGEX)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA_REGEX), behavior="isolated"),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in LLAMA_SPECIAL])
    bos = tk.token_to_id("<|begin_of_text|>")
    tk.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|>:1 $B:1",
        special_tokens=[("<|begin_of_text|>", bos)])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                                  model_max_length=131072, clean_up_tokenization_spaces=True)
    tok.chat_template = (TEMPLATES / "llama3_2.jinja").read_text()
    return tok


def mistral_tokenizer(texts):
    trained, merges = train_bpe(texts, None, vocab_size=800, metaspace=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for t in sorted(trained, key=trained.get):
        vocab.setdefault(t, len(vocab))
    tok = LlamaTokenizer(vocab=vocab, merges=merges, add_bos_token=True, add_eos_token=False, legacy=False)
    tok.chat_template = MISTRAL_TEMPLATE
    return tok


def generic_tokenizer(texts, specials, template=None, bos=None, eos=None, pad=None, unk=None, add_bos=False):
    """Byte-level BPE, `specials` first (ids 0..), for the families without a tokenizer class of their own here."""
    trained, merges = train_bpe(texts, QWEN_REGEX)
    vocab = {t: i for i, t in enumerate(specials)}
    for t in sorted(trained, key=trained.get):
        vocab.setdefault(t, len(vocab))
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN_REGEX), behavior="isolated"),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    if add_bos:
        tk.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1",
                                                          special_tokens=[(bos, vocab[bos])])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=bos, eos_token=eos, pad_token=pad, unk_token=unk,
                                  model_max_length=131072)
    if template:
        tok.chat_template = (TEMPLATES / template).read_text() if template.endswith(".jinja") else template
    return tok


CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# name: (config class, model class, config kwargs, tokenizer kwargs); shapes of scripts/generate_tiny_models
FAMILIES = {
    "tiny-Cohere2ForCausalLM": ("Cohere2Config", "Cohere2ForCausalLM", dict(logit_scale=1.0), dict(
        specials=["<PAD>", "<UNK>", "<BOS_TOKEN>", "<EOS_TOKEN>", "<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>",
                  "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>", "<|SYSTEM_TOKEN|>", "<|START_RESPONSE|>", "<|END_RESPONSE|>"],
        template="cohere2.jinja", bos="<BOS_TOKEN>", eos="<|END_OF_TURN_TOKEN|>", pad="<PAD>", unk="<UNK>", add_bos=True)),
    "tiny-Glm4MoeForCausalLM": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        moe_intermediate_size=32, head_dim=2, n_routed_experts=4, num_experts_per_tok=2, attention_bias=True,
        use_qk_norm=True, routed_scaling_factor=2.5), dict(
        specials=["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
                  "<|assistant|>", "<|observation|>", "<think>", "</think>"],
        template="glm4moe.jinja", eos="<|endoftext|>", pad="<|endoftext|>")),
    "tiny-GptOssForCausalLM": ("GptOssConfig", "GptOssForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2), dict(
        specials=["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>",
                  "<|end|>", "<|message|>", "<|call|>"],
        template="gptoss.jinja", bos="<|startoftext|>", eos="<|return|>", pad="<|endoftext|>")),
    "tiny-Olmo3ForCausalLM": ("Olmo3Config", "Olmo3ForCausalLM", dict(use_cache=False), dict(
        specials=["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"], template=CHATML, eos="<|endoftext|>",
        pad="<|pad|>")),
    "tiny-Lfm2ForCausalLM": ("Lfm2Config", "Lfm2ForCausalLM", dict(
        full_attn_idxs=[1], block_multiple_of=8, conv_L_cache=3, conv_bias=False, block_auto_adjust_ff_dim=True,
        use_cache=False), dict(
        specials=["<|pad|>", "<|startoftext|>", "<|endoftext|>", "<|fim_pre|>", "<|fim_mid|>", "<|fim_suf|>",
                  "<|im_start|>", "<|im_end|>", "<|tool_list_start|>", "<|tool_list_end|>", "<|tool_call_start|>",
                  "<|tool_call_end|>", "<|tool_response_start|>", "<|tool_response_end|>"],
        template="lfm2.jinja", bos="<|startoftext|>", eos="<|im_end|>", pad="<|pad|>", add_bos=True)),
    "tiny-Lfm2ForCausalLM-2.5": ("Lfm2Config", "Lfm2ForCausalLM", dict(
        layer_types=["conv", "full_attention"], conv_L_cache=3, conv_bias=False, block_auto_adjust_ff_dim=False,
        use_cache=False), dict(
        specials=["<|pad|>", "<|startoftext|>", "<|endoftext|>", "<|fim_pre|>", "<|fim_mid|>", "<|fim_suf|>",
                  "<|im_start|>", "<|im_end|>", "<|tool_list_start|>", "<|tool_list_end|>", "<|tool_call_start|>",
                  "<|tool_call_end|>", "<|tool_response_start|>", "<|tool_response_end|>", "<think>", "</think>"],
        template="lfm2_2_5.jinja", bos="<|startoftext|>", eos="<|im_end|>", pad="<|pad|>", add_bos=True)),
    "tiny-NemotronHForCausalLM-nano": ("NemotronHConfig", "NemotronHForCausalLM", dict(
        hidden_size=16, num_hidden_layers=3, layers_block_type=["mamba", "attention", "moe"], mamba_num_heads=8, mamba_head_dim=4,
        mamba_n_groups=1, ssm_state_size=16, mamba_d_conv=4, mamba_expand=2, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, moe_shared_expert_intermediate_size=32, use_mamba_kernels=False), dict(
        specials=["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>",
                  "</tool_call>"],
        template="nemotron_3_nano.jinja", bos="<s>", eos="<|im_end|>", unk="<unk>")),
    "tiny-Gemma2ForCausalLM": ("Gemma2Config", "Gemma2ForCausalLM", {}, dict(
        specials=["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"],
        template="gemma.jinja", bos="<bos>", eos="<eos>", pad="<pad>", unk="<unk>", add_bos=True)),
}


def neox_tokenizer(texts):  # EleutherAI/pythia-14m: no chat template, no pad token
    vocab, merges = train_bpe(texts, QWEN_REGEX)
    vocab = {"<|endoftext|>": 0, "<|padding|>": 1, **{t: i + 2 for t, i in vocab.items()}}
    return GPTNeoXTokenizer(vocab=vocab, merges=merges, pad_token=None)


# ---------------------------------------------------------------- models
def init_tiny(model):  # as scripts/generate_tiny_models/_common.py: init_weights_tiny_model
    for m in model.modules():
        if isinstance(m, nn.Linear):
            nn.init.xavier_uniform_(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
    return model


def save(out: Path, name: str, model_cls, config, tok, gen: dict | None, dtype=torch.bfloat16):
    torch.manual_seed(0)
    model = init_tiny(model_cls(config)).to(dtype=dtype)
    d = out / ORG / name
    shutil.rmtree(d, ignore_errors=True)
    model.save_pretrained(d)
    tok.save_pretrained(d)
    if gen is not None:
        GenerationConfig(**gen).save_pretrained(d)
    (d / "README.md").write_text(f"Local stand-in for {ORG}/{name} (random weights, trained-here tokenizer).\n")
    with torch.no_grad():  # smoke test
        assert not model(**tok("Beautiful is better than", return_tensors="pt")).logits.isnan().any()
    return name


def make_models(out: Path, texts: list[str], upstream: Path) -> list[str]:
    small = dict(hidden_size=8, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, intermediate_size=32)
    seqcls = {**small, "hidden_size": 16, "num_labels": 1}
    made = []
    q = qwen_tokenizer(texts)
    ids = q.convert_tokens_to_ids
    eot, im_end = ids("<|endoftext|>"), ids("<|im_end|>")
    qgen = dict(bos_token_id=eot, pad_token_id=eot, eos_token_id=[im_end, eot], do_sample=True, temperature=0.7,
                top_p=0.8, top_k=20, repetition_penalty=1.05)
    made.append(save(out, "tiny-Qwen2ForCausalLM-2.5", Qwen2ForCausalLM, Qwen2Config(vocab_size=len(q), **small), q, qgen))
    made.append(save(out, "tiny-Qwen2ForSequenceClassification-2.5", Qwen2ForSequenceClassification,
                     Qwen2Config(vocab_size=len(q), bos_token_id=eot, eos_token_id=im_end, rope_theta=1e6,
                                 max_position_embeddings=32768, **seqcls), q, qgen))
    q3 = qwen_tokenizer(texts, qwen3=True)
    q3gen = dict(bos_token_id=eot, pad_token_id=eot, eos_token_id=[im_end, eot], do_sample=True, temperature=0.6,
                 top_p=0.95, top_k=20)
    made.append(save(out, "tiny-Qwen3ForCausalLM", Qwen3ForCausalLM, Qwen3Config(vocab_size=len(q3), **small), q3, q3gen))
    made.append(save(out, "tiny-Qwen3ForSequenceClassification", Qwen3ForSequenceClassification,
                     Qwen3Config(vocab_size=len(q3), bos_token_id=eot, eos_token_id=im_end, tie_word_embeddings=True,
                                 **seqcls), q3, q3gen))
    made.append(save(out, "tiny-Qwen3MoeForCausalLM", Qwen3MoeForCausalLM,
                     Qwen3MoeConfig(vocab_size=len(q3), num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                                    bos_token_id=eot, eos_token_id=im_end, **small), q3, q3gen))
    ll = llama3_tokenizer(texts)
    lid = ll.convert_tokens_to_ids
    lgen = dict(bos_token_id=lid("<|begin_of_text|>"), do_sample=True, temperature=0.6, top_p=0.9,
                eos_token_id=[lid("<|end_of_text|>"), lid("<|eom_id|>"), lid("<|eot_id|>")])
    made.append(save(out, "tiny-LlamaForCausalLM-3.2", LlamaForCausalLM, LlamaConfig(vocab_size=len(ll), **small), ll, lgen))
    made.append(save(out, "tiny-LlamaForSequenceClassification-3.2", LlamaForSequenceClassification,
                     LlamaConfig(vocab_size=len(ll), bos_token_id=lgen["bos_token_id"], eos_token_id=lgen["eos_token_id"],
                                 tie_word_embeddings=True, **seqcls), ll, lgen))
    mi = mistral_tokenizer(texts)
    made.append(save(out, "tiny-MistralForCausalLM-0.2", MistralForCausalLM, MistralConfig(vocab_size=len(mi), **small),
                     mi, dict(bos_token_id=1, eos_token_id=2)))
    nx = neox_tokenizer(texts)
    made.append(save(out, "tiny-GPTNeoXForCausalLM", GPTNeoXForCausalLM, GPTNeoXConfig(vocab_size=len(nx), **small),
                     nx, dict(bos_token_id=0, eos_token_id=0), dtype=torch.float16))
    import transformers

    for name, (cfg_cls, model_cls, cfg_kw, tok_kw) in FAMILIES.items():
        tok = generic_tokenizer(texts, **tok_kw)
        tid = {k: tok.convert_tokens_to_ids(tok_kw[k]) for k in ("bos", "eos", "pad") if tok_kw.get(k)}
        ids_kw = {f"{k}_token_id": tid.get(k) for k in ("bos", "eos", "pad")}
        config = getattr(transformers, cfg_cls)(vocab_size=len(tok), **{**small, **ids_kw, **cfg_kw})
        made.append(save(out, name, getattr(transformers, model_cls), config, tok, ids_kw))
    remote = upstream / "scripts" / "remote_code"
    if remote.exists():  # TRL's RemoteForCausalLM (a LlamaForCausalLM under model_type "remote"), via trust_remote_code
        sys.path.insert(0, str(remote.parent))
        from remote_code.configuration_remote import RemoteConfig
        from remote_code.modeling_remote import RemoteForCausalLM, RemoteForSequenceClassification, RemoteModel

        RemoteConfig.register_for_auto_class()
        RemoteModel.register_for_auto_class("AutoModel")
        RemoteForCausalLM.register_for_auto_class("AutoModelForCausalLM")
        RemoteForSequenceClassification.register_for_auto_class("AutoModelForSequenceClassification")
        config = RemoteConfig(vocab_size=len(ll), **small)
        config.auto_map = {"AutoModel": "modeling_remote.RemoteModel",
                           "AutoModelForSequenceClassification": "modeling_remote.RemoteForSequenceClassification"}
        made.append(save(out, "tiny-RemoteForCausalLM", RemoteForCausalLM, config, ll, lgen))
    # chat_template_path="Qwen/Qwen3-4B" (tokenizer only)
    shutil.rmtree(out / "Qwen" / "Qwen3-4B", ignore_errors=True)
    q3.save_pretrained(out / "Qwen" / "Qwen3-4B")
    return made


def hub_cache(out: Path, names: list[str]) -> None:
    """HF_HOME=OUTDIR/hf_home: a Hub cache whose snapshots link to the model directories."""
    for name in names:
        repo = out / "hf_home" / "hub" / f"models--{ORG}--{name}"
        shutil.rmtree(repo, ignore_errors=True)
        sha = hashlib.sha1(f"{ORG}/{name}".encode()).hexdigest()
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text(sha)
        snap = repo / "snapshots" / sha
        snap.mkdir(parents=True)
        for f in (out / ORG / name).iterdir():
            os.symlink(f.resolve(), snap / f.name)


def main(out: str, upstream: str = "/tmp/peer-trl/orig") -> None:
    out_p = Path(out).resolve()
    (out_p / ORG).mkdir(parents=True, exist_ok=True)
    ds = make_datasets(out_p, Path(upstream))
    models_made = make_models(out_p, corpus(out_p), Path(upstream))
    hub_cache(out_p, models_made)
    print("datasets:", ", ".join(ds))
    print("models:", ", ".join(models_made))


if __name__ == "__main__":
    main(*sys.argv[1:])
