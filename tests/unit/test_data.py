"""Global batches do not depend on the split; placeholders fill short tails; the collator pads."""

import torch

from shardtrain.train.data.batch_plan import BatchPlan, PaddingCollator, PlaceholderDataset, StepBatchSampler


def _global_steps(n, batch, accum, world, seed=0, epoch=0):
    steps = []
    for rank in range(world):
        plan = BatchPlan(num_samples=n, per_device_batch_size=batch, accumulation_steps=accum, dp_size=world,
                         dp_rank=rank, seed=seed)
        per_rank = list(StepBatchSampler(plan, epoch))
        for step in range(plan.steps_per_epoch):
            if len(steps) <= step:
                steps.append([])
            for micro in per_rank[step * accum:(step + 1) * accum]:
                steps[step].extend(i for i in micro if i >= 0)
    return [sorted(s) for s in steps]


def test_same_samples_per_step_for_every_split():
    ref = _global_steps(37, 8, 1, 1)
    assert _global_steps(37, 4, 1, 2) == ref
    assert _global_steps(37, 2, 2, 2) == ref
    assert _global_steps(37, 2, 1, 4) == ref
    assert _global_steps(37, 1, 2, 4) == ref
    assert sorted(i for s in ref for i in s) == list(range(37))  # nothing dropped, nothing repeated


def test_epochs_reshuffle_and_seed_matters():
    plan = BatchPlan(num_samples=20, per_device_batch_size=4, accumulation_steps=1, dp_size=1, dp_rank=0, seed=1)
    assert plan.permutation(0) != plan.permutation(1)
    other = BatchPlan(num_samples=20, per_device_batch_size=4, accumulation_steps=1, dp_size=1, dp_rank=0, seed=2)
    assert plan.permutation(0) != other.permutation(0)


def test_resume_position_continues_the_same_order():
    plan = BatchPlan(num_samples=50, per_device_batch_size=3, accumulation_steps=2, dp_size=2, dp_rank=1, seed=5)
    full = list(StepBatchSampler(plan, epoch=0))
    assert list(StepBatchSampler(plan, epoch=0, start_step=3)) == full[3 * 2:]


def test_short_tail_gets_placeholders_on_every_rank():
    # 10 samples, global batch 8: step 1 has 2 samples, so ranks 1..3 get a placeholder
    tails = []
    for rank in range(4):
        plan = BatchPlan(num_samples=10, per_device_batch_size=2, accumulation_steps=1, dp_size=4, dp_rank=rank, seed=0)
        batches = list(StepBatchSampler(plan, 0))
        assert len(batches) == 2
        tails.append(batches[1])
    assert len(tails[0]) == 2 and tails[1:] == [[-1], [-1], [-1]]


def test_collator_pads_and_placeholder_is_ignored():
    data = PlaceholderDataset([{"input_ids": [5, 6, 7]}, {"input_ids": [8]}])
    batch = PaddingCollator(pad_token_id=0)([data[0], data[1], data[-1]])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0], [5, 6, 7]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 1]]
    assert batch["labels"].tolist() == [[5, 6, 7], [8, -100, -100], [-100, -100, -100]]
    classes = PaddingCollator()([{"input_ids": [1, 2], "labels": 1}, {"input_ids": [3], "labels": torch.tensor(0)}])
    assert classes["labels"].tolist() == [1, 0]


def test_equal_length_tensors_are_stacked_like_the_padding_path():
    rows = torch.tensor([[3, 4, 5], [6, 7, 8]])
    tensors = PlaceholderDataset([{"input_ids": r.clone(), "extra": float(i)} for i, r in enumerate(rows)])
    lists = PlaceholderDataset([{"input_ids": r.tolist(), "extra": float(i)} for i, r in enumerate(rows)])
    items = [tensors[0], tensors[1], tensors[-1]]
    fast = PaddingCollator()(items)
    slow = PaddingCollator()([lists[0], lists[1], lists[-1]])
    assert fast.keys() == slow.keys() == {"input_ids", "attention_mask", "labels", "extra"}
    for key in fast:
        assert torch.equal(fast[key], slow[key]), key
    fast["labels"][0, 0] = 99  # labels are a copy, not a view of input_ids
    assert items[0]["input_ids"][0] == 3 and fast["input_ids"][0, 0] == 3
    mixed = PaddingCollator()([{"input_ids": torch.tensor([1, 2])}, {"input_ids": torch.tensor([3])}])
    assert mixed["input_ids"].tolist() == [[1, 2], [3, 0]]  # different lengths still pad


def test_drop_last_leaves_out_the_short_last_global_batch_on_every_split():
    kept = None
    for batch, accum, world in ((8, 1, 1), (4, 1, 2), (2, 2, 2)):
        steps = []
        for rank in range(world):
            plan = BatchPlan(num_samples=37, per_device_batch_size=batch, accumulation_steps=accum, dp_size=world,
                             dp_rank=rank, seed=0, drop_last=True)
            assert plan.steps_per_epoch == 4  # 37 // 8
            steps += [i for micro in StepBatchSampler(plan, 0) for i in micro]
        assert -1 not in steps and len(steps) == 32
        kept = kept or sorted(steps)
        assert sorted(steps) == kept  # the same 32 samples, whatever the split


def test_a_samplers_order_is_each_epochs_order_on_every_rank():
    from torch.utils.data import RandomSampler

    from shardtrain.train.data.batch_plan import EpochOrder

    def plan(rank: int) -> BatchPlan:  # every rank builds its own sampler from the same seed, as Hugging Face's
        sampler = RandomSampler(range(10), generator=torch.Generator().manual_seed(5))
        return BatchPlan(num_samples=10, per_device_batch_size=5, accumulation_steps=1, dp_size=2, dp_rank=rank,
                         seed=0, order=EpochOrder(sampler))

    first, second = plan(0), plan(1)
    assert first.permutation(1) == second.permutation(1) != first.permutation(0)  # a resume reaches epoch 1 alike
    assert first.permutation(0) == second.permutation(0)  # replayed, not drawn again
    assert sorted(first.permutation(0)) == list(range(10))
    assert list(StepBatchSampler(first, 0))[0] == first.permutation(0)[:5]  # rank 0: the first slice


def test_rank_shares_of_an_evaluation_set():
    from shardtrain.train.eval.loaders import rank_share

    shares = [rank_share(74, dp_rank=r, dp_size=2, batch_size=16) for r in (0, 1)]
    assert shares[0] + shares[1] == list(range(74))
    dropped = [rank_share(74, dp_rank=r, dp_size=2, batch_size=16, drop_last=True) for r in (0, 1)]
    assert dropped[0] + dropped[1] == list(range(64))  # whole global batches of 32 only


def _share_loaders(dataset, dp_size, batch_size=3):
    from shardtrain.train.data.batch_plan import PaddingCollator
    from shardtrain.train.eval.loaders import ShareLoader

    return [ShareLoader(dataset, PaddingCollator(pad_token_id=0), batch_size=batch_size, dp_rank=r, dp_size=dp_size,
                        seed=7) for r in range(dp_size)]


def test_an_evaluation_loader_holds_its_ranks_share_in_as_many_batches_as_every_rank():
    rows = [{"input_ids": [i + 1, i + 2], "labels": [i + 1, i + 2]} for i in range(11)]
    loaders = _share_loaders(rows, 2)  # rank 0: rows 0-5, rank 1: rows 6-10 (its last batch short, as HF's)
    assert [len(loader) for loader in loaders] == [2, 2] and loaders[0].samples == 11
    positions = [[p for p, _ in loader.indexed()] for loader in loaders]
    assert positions == [[[0, 1, 2], [3, 4, 5]], [[6, 7, 8], [9, 10]]]
    last = list(loaders[1])[-1]  # iterated as any loader: the same batches indexed() gives
    assert last["input_ids"].tolist() == [[10, 11], [11, 12]]
    # a rank with fewer batches than another runs one-row placeholder batches, which count for nothing
    short = _share_loaders(rows[:7], 2)  # rank 0: rows 0-3 in 2 batches, rank 1: rows 4-6 in 1
    assert [[p for p, _ in loader.indexed()] for loader in short] == [[[0, 1, 2], [3]], [[4, 5, 6], [-1]]]
    placeholder = list(short[1])[-1]
    assert placeholder["labels"].tolist() == [[-100, -100]]


def test_an_evaluation_stream_is_strided_over_ranks_and_padded_only_when_asked():
    from datasets import Dataset

    stream = Dataset.from_list([{"input_ids": [i + 1], "labels": [i + 1]} for i in range(5)]).to_iterable_dataset()
    loaders = _share_loaders(stream, 2, batch_size=2)
    assert [[p for p, _ in loader.indexed()] for loader in loaders] == [[[0, 2], [4]], [[1, 3]]]
    assert [b["input_ids"].tolist() for b in loaders[1]] == [[[2], [4]]]
    padded = loaders[1].indexed(pad=True)
    assert [next(padded)[0] for _ in range(3)] == [[1, 3], [-1], [-1]]  # until every rank is done
