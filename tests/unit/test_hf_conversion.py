"""Which checkpoint tensors build which model tensors (transformers' conversion rules), and reading any box of a fused
tensor from its sources' slices: equal to `from_pretrained`'s tensor cut to the box, bit for bit, in one process."""

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tiny_models import tiny_qwen3_moe
from transformers import AutoConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.core_model_loading import Transpose

from shardtrain.parallel.hf_conversion import ReadStats, plan_read, read_box, safetensors_index


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("moe") / "model"
    tiny_qwen3_moe(seed=4).save_pretrained(path, max_shard_size="20KB")
    return path


def meta_model(path: Path) -> torch.nn.Module:
    with torch.device("meta"):
        return Qwen3MoeForCausalLM._from_config(AutoConfig.from_pretrained(str(path)), dtype=torch.float32)


def test_plan_follows_transformers_fusion(saved):
    plan, why = plan_read(meta_model(saved), safetensors_index(saved))
    assert why == "" and len(list(saved.glob("*.safetensors"))) > 2
    assert sorted(plan.fused) == [f"model.layers.{i}.mlp.experts.{w}" for i in (0, 1) for w in ("down_proj",
                                                                                                  "gate_up_proj")]
    gate_up = plan.fused["model.layers.1.mlp.experts.gate_up_proj"]
    # the converter's own source order (gate before up), experts in transformers' natural order (0..7)
    assert list(gate_up.sources) == ["mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"]
    assert gate_up.sources["mlp.experts.*.up_proj.weight"] == [f"model.layers.1.mlp.experts.{e}.up_proj.weight"
                                                               for e in range(8)]
    assert not any(".experts." in key for key in plan.dense) and "model.embed_tokens.weight" in plan.dense


@pytest.mark.parametrize("box", [((0, 0, 0), (8, 32, 32)),     # whole
                                 ((4, 0, 0), (4, 32, 32)),     # ep / FSDP: experts 4..7
                                 ((2, 10, 3), (3, 12, 20)),    # gate columns 10..15 and up columns 0..5
                                 ((7, 16, 0), (1, 16, 32))])   # up only: gate reached with zero width
def test_any_box_equals_from_pretrained(saved, box):
    plan, _ = plan_read(meta_model(saved), safetensors_index(saved))
    ref = Qwen3MoeForCausalLM.from_pretrained(str(saved), dtype=torch.float32).state_dict()
    handles = {}

    def handle(file):
        return handles.setdefault(file, safe_open(str(file), framework="pt"))

    offsets, sizes = box
    key = "model.layers.0.mlp.experts.gate_up_proj"
    stats = ReadStats()
    got = read_box(plan, key, offsets, sizes, torch.float32, handle, stats)
    want = ref[key][tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
    assert torch.equal(got, want)
    # only the experts of the box, and of each only the columns it needs
    experts = sorted({int(k.split(".")[5]) for k in stats.keys})
    assert experts == list(range(offsets[0], offsets[0] + sizes[0]))
    assert stats.bytes == got.numel() * 4


class TransposedConfig(Qwen3MoeConfig):
    """Qwen3-MoE under its own model type, for which a conversion that also transposes down_proj is registered
    (transformers' own registration API)."""

    model_type = "shardtrain_transposed_moe"


def test_other_conversions_are_refused_with_the_reason(saved):
    from transformers.conversion_mapping import (
        get_checkpoint_conversion_mapping,
        register_checkpoint_conversion_mapping,
    )

    mapping = [type(c)(c.source_patterns, c.target_patterns, operations=[*c.operations, Transpose(1, 2)])
               if "down_proj" in c.source_patterns[0] else c for c in get_checkpoint_conversion_mapping("qwen2_moe")]
    register_checkpoint_conversion_mapping(TransposedConfig.model_type, mapping, overwrite=True)
    saved_config = AutoConfig.from_pretrained(str(saved)).to_dict()
    saved_config.pop("model_type")  # the class's own, so that its registered conversion applies
    config = TransposedConfig(**saved_config)
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM._from_config(config, dtype=torch.float32)
    plan, why = plan_read(model, safetensors_index(saved))
    assert plan is None and "Transpose" in why and "down_proj" in why, why
