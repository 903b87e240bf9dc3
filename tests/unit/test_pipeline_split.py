"""The pipeline split (`parallel/pipeline.py`) in one process: stages chained by hand give the unsplit model's
logits, keep the model's names (a PEFT model's too), keep tied embeddings on both ends; settings and models a
pipeline cannot run are refused with the numbers."""

import copy

import pytest
import torch
from tiny_models import tiny_gpt2, tiny_llama

from shardtrain.errors import ParallelDimsError, PipelineError
from shardtrain.parallel.dims import ParallelDims
from shardtrain.parallel.pipeline import StageModule, split_for_rank
from shardtrain.parallel.pipeline_settings import PipelineSettings, check_settings
from shardtrain.parallel.pipeline_split import Skipped, layer_ranges, published_aliases, split_model, stage_split


def test_layers_are_split_evenly_the_first_stages_taking_the_rest():
    assert layer_ranges(5, 2) == [range(0, 3), range(3, 5)]
    assert layer_ranges(4, 4) == [range(i, i + 1) for i in range(4)]


@pytest.mark.parametrize("tie", [False, True])
def test_stages_chained_by_hand_give_the_unsplit_logits(tie):
    model = tiny_llama(tie=tie, layers=5).eval()
    ids = torch.tensor([[3, 9, 14, 2, 7, 1], [5, 5, 8, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    stages = [copy.deepcopy(model) for _ in range(3)]
    splits = [split_model(stage, held=(i,), stages=3) for i, stage in enumerate(stages)]
    assert [s.layers for s in splits] == [(range(0, 2),), (range(2, 4),), (range(4, 5),)]
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
        hidden = ids
        for i, stage in enumerate(stages):
            hidden = StageModule(stage, first=i == 0)(hidden, attention_mask=mask)
    assert hidden.shape == expected.shape
    assert torch.allclose(hidden, expected, atol=1e-6, rtol=0)
    # the kept modules keep their names (a stage's checkpoint keys are the model's own)
    keys = [set(stage.state_dict()) for stage in stages]
    assert set().union(*keys) == set(model.state_dict())
    assert "model.embed_tokens.weight" in keys[0] and "lm_head.weight" in keys[2]
    assert any(k.startswith("model.layers.4.") for k in keys[2]) and not any("layers.4." in k for k in keys[1])
    assert isinstance(stages[1].model.embed_tokens, Skipped) and isinstance(stages[1].lm_head, Skipped)
    assert [s.tied for s in splits] == [tie] * 3
    assert stage_split(stages[2]) is splits[2]
    if tie:  # the last stage publishes its half of the pair under the embedding's name, as one process saves it
        assert splits[0].tied_names == ("model.embed_tokens.weight", "lm_head.weight")
        assert published_aliases(stages[2]) == {"model.embed_tokens.weight": "lm_head.weight"}
        assert published_aliases(stages[0]) == {}


def test_models_a_pipeline_cannot_split_are_refused_by_name():
    with pytest.raises(PipelineError, match="GPT2LMHeadModel has no pipeline plan"):
        split_model(tiny_gpt2(), held=(0,), stages=2)
    with pytest.raises(PipelineError, match="has 2 layers, fewer than the 3 pipeline stages"):
        split_model(tiny_llama(layers=2), held=(0,), stages=3)


def test_a_peft_model_is_split_through_its_base_model_under_its_own_names():
    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(tiny_llama(tie=True), LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    split = split_model(lora, held=(1,), stages=2)
    assert stage_split(lora) is split and split.layers == (range(1, 2),)
    assert split.tied_names == ("base_model.model.model.embed_tokens.weight", "base_model.model.lm_head.weight")
    adapters = [k for k, p in lora.named_parameters() if p.requires_grad]
    assert adapters and all(".layers.1." in k for k in adapters)  # the other stage's adapters went with its layers


@pytest.mark.parametrize("settings,pp,batch,words", [
    (PipelineSettings(schedule="1f1b"), 2, None, "is not a schedule; use one of"),
    (PipelineSettings(schedule="Interleaved1F1B", microbatches=3), 2, None, "is not a multiple of pp_size = 2"),
    (PipelineSettings(schedule="DualPipeV", microbatches=2), 2, None, "pp_microbatches = 2 is fewer than the 4 "
                                                                      "DualPipeV needs"),
    (PipelineSettings(schedule="1F1B", microbatches=1), 2, None, "pp_microbatches = 1 is fewer than the 2"),
    (PipelineSettings(schedule="GPipe", microbatches=0), 2, None, "must be an int >= 1"),
    (PipelineSettings(schedule="GPipe", microbatches=3), 2, 4, "per_device_train_batch_size = 4 does not split"),
])
def test_settings_a_pipeline_cannot_run_are_refused_with_the_numbers(settings, pp, batch, words):
    with pytest.raises(PipelineError, match=words):
        check_settings(settings, pp=pp, per_device_batch=batch)


def test_settings_that_work_pass():
    check_settings(PipelineSettings(), pp=2, per_device_batch=4)  # 1F1B, 2 microbatches
    check_settings(PipelineSettings(schedule="GPipe", microbatches=1), pp=4, per_device_batch=3)
    check_settings(PipelineSettings(schedule="Interleaved1F1B"), pp=2, per_device_batch=4)  # 4 microbatches
    check_settings(PipelineSettings(schedule="DualPipeV"), pp=2, per_device_batch=4)  # 4 microbatches
    check_settings(PipelineSettings(schedule="ZBVZeroBubble", microbatches=2), pp=2, per_device_batch=4)


def test_v_schedules_put_the_first_and_the_last_stage_on_rank_0():
    for name in ("ZBVZeroBubble", "DualPipeV"):
        settings = PipelineSettings(schedule=name)
        assert [settings.local_stages(r, 4) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
        assert not settings.ends_apart
    looped = PipelineSettings(schedule="InterleavedZeroBubble")
    assert looped.local_stages(1, 2) == (1, 3) and looped.ends_apart
    # tied embeddings on one rank stay one parameter: nothing to sum over a pair of ranks
    model = tiny_llama(tie=True, layers=4)
    split = split_model(model, held=(0, 3), stages=4, ends_apart=False)
    assert not split.tied and split.is_first and split.is_last
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_ranks_of_multi_stage_schedules_hold_two_stages_and_run_one_at_a_time():
    from shardtrain.parallel.pipeline_split import active_stage

    model = tiny_llama(tie=True, layers=4).eval()
    settings = PipelineSettings(schedule="Interleaved1F1B")
    ranks = [copy.deepcopy(model) for _ in range(2)]
    splits = [split_for_rank(rank, settings, pp_rank=r, pp=2) for r, rank in enumerate(ranks)]
    assert [s.held for s in splits] == [(0, 2), (1, 3)] and {s.stages for s in splits} == {4}
    assert [s.tied for s in splits] == [True, True]  # the ends are on two ranks: a copy each
    ids = torch.tensor([[3, 9, 14, 2, 7, 1]])
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        hidden = ids
        for stage in range(4):  # each stage on the rank that holds it, with only that stage active
            r = stage % 2
            hidden = StageModule(ranks[r], first=stage == 0, split=splits[r], stage=stage)(hidden)
    assert torch.allclose(hidden, expected, atol=1e-6, rtol=0)
    with active_stage(ranks[1], splits[1], 1):  # (the other stage's modules are back afterwards)
        assert isinstance(ranks[1].model.layers[3], Skipped)
    assert not isinstance(ranks[1].model.layers[3], Skipped) and not isinstance(ranks[1].model.norm, Skipped)


def test_pipeline_is_the_outermost_dimension():
    dims = ParallelDims.resolve(world_size=8, pp=2, tp=2)
    assert (dims.pp, dims.dp_shard, dims.tp, dims.data_copies, dims.stage_size) == (2, 2, 2, 4, 4)
    assert dims.rank_coords(5) == {"pp": 1, "dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 1, "batch": 0}
    assert dims.describe().startswith("pp 2 x dp_replicate 1 x dp_shard 2")
    with pytest.raises(ParallelDimsError, match="pp_size x cp_size x tp_size = 3 x 1 x 1 = 3 does not divide"):
        ParallelDims.resolve(world_size=4, pp=3)
    with pytest.raises(ParallelDimsError, match="pp_size = 2 with cp_size = 2"):
        ParallelDims.resolve(world_size=4, pp=2, cp=2)
    with pytest.raises(ParallelDimsError, match="pp_size = 2 with ep_size = 2"):
        ParallelDims.resolve(world_size=4, pp=2, ep=2)


def test_a_pipeline_names_its_stages():
    from shardtrain.parallel.pipeline import Pipeline
    from shardtrain.parallel.pipeline_split import StageSplit

    pipeline = Pipeline.__new__(Pipeline)
    pipeline.split = StageSplit(held=(1, 3), stages=4, layers=(range(2, 4), range(6, 7)), tied=False)
    assert pipeline.describe() == "pipeline stages 1 and 3 of 4 (layers 2-3, 6) on rank 0"
    with pytest.raises(RuntimeError, match=r"^pipeline stages 1 and 3 of 4 .*: ValueError: peer gone"):
        with pipeline._named():
            raise ValueError("peer gone")


def test_a_users_layer_split_is_kept_and_checked():
    from shardtrain.train.arguments import TrainingArguments

    model = tiny_llama(layers=4)
    split = split_model(model, held=(0,), stages=2, layer_counts=(3, 1))
    assert split.layers == (range(0, 3),) and isinstance(model.model.layers[3], Skipped)
    with pytest.raises(PipelineError, match=r"pp_layers = \[2, 1\] adds up to 3 layers, but LlamaForCausalLM has 4"):
        split_model(tiny_llama(layers=4), held=(0,), stages=2, layer_counts=(2, 1))
    with pytest.raises(PipelineError, match=r"pp_layers = \[4\] must give each of the 2 pipeline stages"):
        check_settings(PipelineSettings(layers=(4,)), pp=2)
    with pytest.raises(PipelineError, match=r"each of the 4 pipeline stages \(pp_size 2 x 2 per rank\)"):
        check_settings(PipelineSettings(schedule="Interleaved1F1B", layers=(1, 1)), pp=2)
    args = TrainingArguments(output_dir="unused", pp_layers=[3, 1])
    assert PipelineSettings.of(args) == PipelineSettings(layers=(3, 1))


def test_a_zero_bubble_schedule_with_torch_compile_is_refused_before_torch_sees_it():
    with pytest.raises(PipelineError, match="'ZBVZeroBubble' with torch_compile"):
        check_settings(PipelineSettings(schedule="ZBVZeroBubble", microbatches=2), pp=2, compiled=True)
    check_settings(PipelineSettings(schedule="1F1B"), pp=2, compiled=True)
