import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("SHARDTRAIN_CPU", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

# SHARDTRAIN_TEST_TIMES=FILE: each test's seconds (setup, which runs module fixtures, + call + teardown) are
# appended to FILE as they finish, so a long run can be read while it goes (pytest's --durations waits for the end)
TIMES = os.environ.get("SHARDTRAIN_TEST_TIMES")


def pytest_runtest_logreport(report):
    if TIMES:
        with open(TIMES, "a") as out:
            out.write(f"{report.when}\t{report.duration:.2f}\t{report.outcome}\t{report.nodeid}\n")


def pytest_sessionfinish(session, exitstatus):
    import rank_pool

    rank_pool.stop_all()
