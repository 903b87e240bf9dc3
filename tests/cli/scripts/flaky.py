"""Launched by tests/cli with --max_restarts 1: rank 1 dies on attempt 0, all ranks finish on the restart.

    shardtrain launch --max_restarts 1 --num_processes 2 tests/cli/scripts/flaky.py OUT_DIR

torchrun sets TORCHELASTIC_RESTART_COUNT (0 on the first attempt). Rank 1 exits 1 at once on attempt 0
(rank 0 goes on into the process group and is stopped by the agent); on attempt 1 every rank
all_reduces and writes OUT_DIR/rank{RANK}.json.
"""

import json
import os
import sys
from pathlib import Path

OUT = Path(sys.argv[1])
ATTEMPT, RANK = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
if ATTEMPT == 0 and RANK == 1:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "died-once").touch()
    sys.exit(1)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from shardtrain import destroy_distributed, init_distributed  # noqa: E402

if __name__ == "__main__":
    init_distributed()
    total = torch.ones(1)
    dist.all_reduce(total)
    (OUT / f"rank{RANK}.json").write_text(json.dumps({"attempt": ATTEMPT, "world_size": int(total.item())}))
    destroy_distributed()
