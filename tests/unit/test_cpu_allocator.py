"""The CPU malloc settings `init_distributed` applies, and when the user's own settings win (one fresh process
per case: mallopt changes the process)."""

import json
import subprocess
import sys

import pytest

PROBE = ("import json; from shardtrain.parallel.cpu_allocator import tune_cpu_allocator as t; "
         "print(json.dumps([t(), t()]))")


def _probe(monkeypatch, **environment):
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX", "GLIBC_TUNABLES",
                 "SHARDTRAIN_CPU_ALLOCATOR"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    return subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)


def test_tuned_by_default_once(monkeypatch):
    proc = _probe(monkeypatch)
    assert proc.returncode == 0, proc.stderr
    first, second = json.loads(proc.stdout)
    assert first == second == {"mmap_threshold": 256 << 20, "trim_threshold": 512 << 20, "arena_max": 1}


@pytest.mark.parametrize("name,value", [("MALLOC_ARENA_MAX", "4"), ("MALLOC_MMAP_THRESHOLD_", "131072"),
                                        ("GLIBC_TUNABLES", "glibc.malloc.arena_max=2"),
                                        ("SHARDTRAIN_CPU_ALLOCATOR", "default")])
def test_the_users_settings_win(monkeypatch, name, value):
    proc = _probe(monkeypatch, **{name: value})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [None, None]


def test_a_bad_choice_is_refused(monkeypatch):
    proc = _probe(monkeypatch, SHARDTRAIN_CPU_ALLOCATOR="fast")
    assert proc.returncode != 0
    assert "SHARDTRAIN_CPU_ALLOCATOR='fast' is not one of ['tuned', 'default']" in proc.stderr
