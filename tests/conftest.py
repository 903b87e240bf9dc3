import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("SHARDTRAIN_CPU", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_sessionfinish(session, exitstatus):
    import rank_pool

    rank_pool.stop_all()
