"""The environment variable prefixes of Accelerate's launcher (`accelerate launch` writes ACCELERATE_* and
FSDP_* for its ranks). shardtrain's engine applies FSDP and mixed precision itself, so the Accelerator it builds
for libraries (`parallel/accelerate_bridge.py`) is built with these hidden: it must not set up a second FSDP
plugin or autocast of its own.
"""

from __future__ import annotations

PREFIXES = ("ACCELERATE_", "FSDP_")
