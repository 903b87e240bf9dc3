"""A training script that exits 3 at once (tests/cli use it as an existing script path for failure cases).

    shardtrain launch --num_processes 1 tests/cli/scripts/fail.py
"""

import sys

sys.exit(3)
