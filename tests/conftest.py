import os
import sys
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
    if TIMES:
        busy = _busy_cpu_seconds()
        used = busy - _last_busy[-1] if _last_busy else 0.0
        _last_busy[:] = [busy]
        with open(TIMES, "a") as out:
            out.write(f"{report.when}\t{report.duration:.2f}\t{used:.2f}\t{report.outcome}\t{report.nodeid}\n")


def pytest_sessionfinish(session, exitstatus):
    import rank_pool

    rank_pool.stop_all()
