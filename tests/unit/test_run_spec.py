"""The run description (`config/run_spec.py`): resolved once from the arguments and the launcher's environment,
frozen, and independent of later changes to either; and the package's layers import downwards only."""

import ast
import dataclasses
from pathlib import Path

import pytest

from shardtrain import TrainingArguments
from shardtrain.config import env
from shardtrain.config.run_spec import RunSpec

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "shardtrain"


def test_resolved_from_arguments_and_the_launchers_environment(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), fsdp=True, cp_size=2, bf16=True, torch_compile=True,
                             gradient_checkpointing=False, ddp_timeout=77, tp_plan={"model.layers.*.mlp": "colwise"})
    spec = RunSpec.resolve(args, {env.WORLD_SIZE: "4", env.LOCAL_WORLD_SIZE: "2", env.RESTART_COUNT: "3"})
    assert spec.output_dir == tmp_path and spec.fsdp_enabled and not spec.xla
    assert spec.sizes["cp"] == 2 and spec.world_size == 4 and spec.local_world_size == 2 and spec.restart_count == 3
    assert spec.mixed_precision == "bf16" and spec.ddp_timeout == 77 and spec.gradient_checkpointing is None
    assert dict(spec.compile_options) == {"backend": "inductor"}
    assert dict(spec.tp_plan) == {"model.layers.*.mlp": "colwise"}
    unlaunched = RunSpec.resolve(args, {})
    assert unlaunched.world_size == 1 and unlaunched.local_world_size is None and unlaunched.restart_count == 0


def test_frozen_and_independent_of_later_changes(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), fsdp=True, gradient_checkpointing=True)
    spec = RunSpec.resolve(args, {})
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.output_dir = Path("elsewhere")
    with pytest.raises(TypeError):
        spec.gradient_checkpointing["use_reentrant"] = True
    assert dict(spec.gradient_checkpointing) == {"use_reentrant": False}
    args.fsdp_config.cpu_offload = True  # the arguments change after the Trainer read them: the run does not
    assert spec.fsdp.cpu_offload is False
    assert RunSpec.resolve(TrainingArguments(output_dir=str(tmp_path)), {}).fsdp is None


# each layer may import the ones after it in this list, never one before it
LAYERS = ["cli", "plan", "train", "checkpoint", "parallel", "config"]
# none: the planner reaches the Trainer through parallel.layout_choice, registered by the package's __init__
ALLOWED: set[tuple[str, str]] = set()


def test_lower_layers_never_import_upper_ones():
    wrong = []
    for path in PACKAGE.rglob("*.py"):
        layer = path.relative_to(PACKAGE).parts[0]
        if layer not in LAYERS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            for name in names:
                parts = name.split(".")
                if parts[0] != "shardtrain" or len(parts) < 2 or parts[1] not in LAYERS:
                    continue
                upward = LAYERS.index(parts[1]) < LAYERS.index(layer)
                if upward and (str(path.relative_to(PACKAGE)), name) not in ALLOWED:
                    wrong.append(f"{path.relative_to(PACKAGE)} imports {name}")
    assert wrong == []


def test_model_facts_find_tied_weights_one_way():
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardtrain.model_facts import tied_aliases, tied_embedding_modules, tied_groups, tied_parameter_ids

    def llama(tie: bool) -> LlamaForCausalLM:
        return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                            num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tie))

    tied, untied = llama(True), llama(False)
    assert tied_aliases(tied) == {"lm_head.weight": "model.embed_tokens.weight"}
    assert tied_parameter_ids(tied) == {id(tied.lm_head.weight)}
    assert tied_embedding_modules(tied) == {"lm_head", "model.embed_tokens"}
    assert ["model.embed_tokens.weight", "lm_head.weight"] in tied_groups(tied)
    assert tied_aliases(untied) == {} and tied_parameter_ids(untied) == set()
    assert tied_embedding_modules(untied) == set()


def test_no_module_imports_itself_back():
    """No import circle between the package's modules (imports inside functions and type-only ones count)."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        graph[module] = {node.module for node in ast.walk(ast.parse(path.read_text()))
                         if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("shardtrain")}
    circles = set()

    def visit(module: str, path: list[str]) -> None:
        for imported in graph.get(module, ()):
            if imported in path:
                circles.add(" -> ".join(path[path.index(imported):] + [imported]))
            elif imported in graph and len(path) < 10:
                visit(imported, [*path, imported])

    for module in graph:
        visit(module, [module])
    assert circles == set()
