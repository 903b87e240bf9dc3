import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("SHARDTRAIN_CPU", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

# SHARDTRAIN_TEST_TIMES=FILE: each phase of each test (setup, which runs module fixtures; call; teardown) is
# appended to FILE as it finishes, with its seconds and the machine's busy CPU seconds meanwhile, so a long run can be
# read while it goes (pytest's --durations waits for the end) and a test that mostly waits stands out
TIMES = os.environ.get("SHARDTRAIN_TEST_TIMES")
_last_busy: list[float] = []


def _busy_cpu_seconds() -> float:
    with open("/proc/stat") as stat:
        user, nice, system, idle, iowait, irq, softirq, *_ = map(int, stat.readline().split()[1:])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def pytest_runtest_logreport(report):
    if TIMES and getattr(report, "node", None) is None:  # xdist's controller sees each report again: skip those
        busy = _busy_cpu_seconds()
        used = busy - _last_busy[-1] if _last_busy else 0.0
        _last_busy[:] = [busy]
        with open(TIMES, "a") as out:
            out.write(f"{report.when}\t{report.duration:.2f}\t{used:.2f}\t{report.outcome}\t{report.nodeid}\t"
                      f"{os.environ.get('PYTEST_XDIST_WORKER', '-')}\t{time.time():.0f}\n")


def pytest_sessionfinish(session, exitstatus):
    import rank_pool

    rank_pool.stop_all()


# The test command runs the files on two workers (pytest-xdist, `--dist loadfile`: a file's module fixtures run
# once), each taking the next file in this order when it is free. The slowest files go first so that neither
# worker is left with a long one at the end (seconds: one worker, this 2-core machine, fresh clone).
SLOWEST_FIRST = (
    "cli/test_restart_resume.py",  # 420 (15 launches that restart)
    "distributed/test_replica_chaos.py",  # ~210: the seeded chaos run, 17 group starts
    "xla/test_xla_path.py",  # 234, one process at a time
    "cli/test_verify.py",  # 149
    "distributed/test_replica_groups.py",  # ~150: five runs of two replica groups and their lighthouse
    "distributed/test_replica_lifecycle.py",  # ~65: a late restart, a record without checkpoint, a killed launcher
    "cli/test_readme.py",  # 119
    "cli/test_signals_and_timeouts.py",  # 108, mostly waiting
    "distributed/test_expert_parallel.py",  # 100
    "distributed/test_sentence_transformers.py",  # ~100: five trainer runs, sentence-transformers' and ours on 2 ranks
    "distributed/test_clean_exit.py",  # 90
    "distributed/test_bad_inputs.py",  # 82
    "cli/test_launch_parallelism.py",  # 81
    "plan/test_validation.py",  # 69
    "cli/test_hf_examples.py",  # 68
    "distributed/test_disk_full.py",  # 67
)


def pytest_collection_modifyitems(session, config, items):
    def rank(item) -> int:
        path = item.nodeid.split("::", 1)[0].removeprefix("tests/")
        return SLOWEST_FIRST.index(path) if path in SLOWEST_FIRST else len(SLOWEST_FIRST)

    items.sort(key=rank)  # stable: the other files, and the tests within a file, keep their order
