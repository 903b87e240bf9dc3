"""push_to_hub as transformers does it: the repository created at __init__ and every upload made by the job's main
process, when transformers makes it and with the files it sends (`workers/hub_push.py` records the Hub's calls).
shardtrain's Trainer on two FSDP2 ranks is compared with transformers' own on one process in the same test."""

from pathlib import Path

import pytest
from launch import python, read_json, torchrun

WORKER = Path(__file__).parent / "workers" / "hub_push.py"
# what the engine adds to output_dir beside the model: its step log, the loss chart, the arguments as JSON
ENGINE_LOGS = {"metrics.jsonl", "report.png", "training_args.json"}


@pytest.mark.parametrize("strategy", ["checkpoint", "end"])
def test_two_ranks_push_what_transformers_pushes(tmp_path, strategy):
    python(WORKER, "hf", strategy, str(tmp_path / "hf"))
    torchrun(WORKER, 2, "ours", strategy, str(tmp_path / "ours"))
    theirs, ours = read_json(tmp_path / "hf" / "uploads.json"), read_json(tmp_path / "ours" / "uploads.json")
    assert ours["created"] == theirs["created"] == ["tiny"]
    # the same uploads, in the same order: each checkpoint (and under "checkpoint" its folder), then save_model's
    assert [(u["folder"], u["path_in_repo"], u["message"]) for u in ours["uploads"]] == \
        [(u["folder"], u["path_in_repo"], u["message"]) for u in theirs["uploads"]]
    expected = 5 if strategy == "checkpoint" else 1
    assert len(ours["uploads"]) == expected and ours["uploads"][-1]["message"] == "Model save"
    for mine, reference in zip(ours["uploads"], theirs["uploads"], strict=True):
        assert all(u["repo_id"] == "user/tiny" for u in (mine, reference))
        if mine["folder"] == ".":  # output_dir: transformers' files (model, config, arguments), and our logs
            # (save_model writes the arguments as training_args.json, not transformers' pickled training_args.bin)
            assert set(reference["files"]) - {"training_args.bin"} <= set(mine["files"])
            assert {"training_args.bin", "training_args.json"} & set(mine["files"])
            assert set(mine["files"]) - set(reference["files"]) <= ENGINE_LOGS
            assert "model.safetensors" in mine["files"] and not any(f.startswith("checkpoint-")
                                                                    for f in mine["files"])
        else:  # the checkpoint as shardtrain resumes it (from any layout), its model loadable on its own
            assert {"model.safetensors", "config.json", "trainer_state.json", "manifest.json"} <= set(mine["files"])
    # rank 1 neither creates the repository nor uploads
    assert read_json(tmp_path / "ours" / "calls-1.json") == {"created": 0, "uploads": 0}
    assert read_json(tmp_path / "ours" / "calls-0.json")["uploads"] == expected
