"""docs/getting-started.md's first run, as a reader copies it: its `train.py` on one process and through
`shardtrain launch` on two ranks, what it says lands on disk, and its claim that the two runs are equal once the
global batch is."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from launch import REPO, worker_env

PAGE = REPO / "docs" / "getting-started.md"


def _page_script() -> str:
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)
    return next(block for block in blocks if block.startswith("# train.py"))


def _page_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", PAGE.read_text(), flags=re.S)
    block = next(b for b in blocks if "train.py" in b)
    return [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]


def _run(command: str, where: Path, home: Path) -> None:
    program, *rest = command.split()
    argv = [sys.executable, *rest] if program == "python" else [sys.executable, "-m", "shardtrain.cli.main", *rest]
    proc = subprocess.run(argv, cwd=where, env=worker_env(SHARDTRAIN_HOME=str(home)), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, f"{command}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"


def _losses(where: Path) -> list[float]:
    state = json.loads((where / "out" / "first" / "checkpoint-40" / "trainer_state.json").read_text())
    return [entry["loss"] for entry in state["log_history"] if "loss" in entry]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("getting_started")
    one, two = _page_commands()
    assert one == "python train.py" and two == "shardtrain launch --cpu --num_processes 2 train.py"
    script = _page_script()
    where = {"one": root / "one", "two": root / "two", "one_x16": root / "one_x16"}
    for name, path in where.items():
        path.mkdir()
        text = script.replace("per_device_train_batch_size=8", "per_device_train_batch_size=16") \
            if name == "one_x16" else script
        (path / "train.py").write_text(text)
        _run(two if name == "two" else one, path, root / "home")
    return where


def test_what_the_page_says_is_on_disk(runs):
    from transformers import LlamaForCausalLM

    for where in runs.values():
        out = where / "out" / "first"
        for step in (20, 40):
            checkpoint = out / f"checkpoint-{step}"
            assert (checkpoint / "manifest.json").is_file() and (checkpoint / "trainer_state.json").is_file()
        assert LlamaForCausalLM.from_pretrained(out / "final").config.num_hidden_layers == 2
        entries = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert any("tokens_per_second" in e and "peak_memory_mb_per_rank" in e for e in entries)
        assert (out / "report.png").is_file()


def test_one_process_and_two_ranks_are_equal_on_the_same_global_batch(runs):
    one, two, one_x16 = _losses(runs["one"]), _losses(runs["two"]), _losses(runs["one_x16"])
    assert len(two) == 4 and two[-1] < two[0]  # it learns
    assert two == pytest.approx(one_x16, abs=1e-5)
    assert one != pytest.approx(two, abs=1e-3)  # another global batch, other losses
