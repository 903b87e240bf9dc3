"""shardtrain: FSDP2 training inside a Trainer."""

from shardtrain.checkpoint import CheckpointError, CheckpointManager
from shardtrain.config.fsdp_config import FSDPConfig, FSDPConfigError
from shardtrain.parallel.distributed import destroy_distributed, init_distributed
from shardtrain.parallel.fsdp import apply_fsdp
from shardtrain.parallel.loading import load_pretrained
from shardtrain.train import (
    EvalPrediction,
    Trainer,
    TrainerCallback,
    TrainerState,
    TrainingArguments,
    TrainingArgumentsError,
)

__version__ = "0.1.0"

__all__ = ["CheckpointError", "CheckpointManager", "EvalPrediction", "FSDPConfig", "FSDPConfigError", "Trainer",
           "TrainerCallback", "TrainerState", "TrainingArguments", "TrainingArgumentsError", "apply_fsdp",
           "destroy_distributed", "init_distributed", "load_pretrained"]
