"""The checkpoint layout: one source of truth for every module that writes or reads a checkpoint.

    output_dir/checkpoint-<step>/   (written as .tmp-checkpoint-<step>/, renamed when complete)
        sharded/                    DCP model (+ optimizer) shards   (SHARDED_STATE_DICT)
        model.safetensors           full model                       (FULL_STATE_DICT)
        optimizer/                  DCP optimizer state              (FULL_STATE_DICT)
        trainer_state.json, scheduler.json, tied_weights.json, rng_state_<rank>.pt, manifest.json, config.json
        base_model.json             adapter (LoRA) checkpoints: class and hash of the frozen base (not saved)
"""

import re

PREFIX = "checkpoint-"
TMP_PREFIX = ".tmp-checkpoint-"
SHARDED_DIR = "sharded"
OPTIMIZER_DIR = "optimizer"
MODEL_FILE = "model.safetensors"
MODEL_INDEX_FILE = "model.safetensors.index.json"
STATE_FILE = "trainer_state.json"
SCHEDULER_FILE = "scheduler.json"
TIED_FILE = "tied_weights.json"
RNG_PREFIX = "rng_state_"
BASE_FILE = "base_model.json"  # adapter checkpoints: the frozen base they were trained on
NAME = re.compile(rf"^{PREFIX}(\d+)$")
