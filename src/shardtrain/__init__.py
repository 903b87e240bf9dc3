"""shardtrain: FSDP2 training inside a Trainer.

    from shardtrain import Trainer, TrainingArguments, FSDPConfig, apply_fsdp
    shardtrain.plan("config.json", world_size=8, device_memory="80GiB")   # will it fit? (shardtrain plan)

Names are imported on first use, so `shardtrain config` and other light commands do not pay for
importing torch and transformers.
"""

import logging
from importlib import import_module

__version__ = "0.1.0"


class _WrongDDPAdvice(logging.Filter):
    """transformers' own `TrainingArguments` built under torchrun on CPU says "launch your script with `python -m
    torch.distributed.launch`" (Accelerate starts a group but calls the run not distributed). Under shardtrain's
    Trainer the run is data parallel on that group, so the advice is wrong: it is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "In order to use Torch DDP, launch your script with" not in record.getMessage()


logging.getLogger("transformers.training_args").addFilter(_WrongDDPAdvice())


# fsdp_config "layout": "auto" runs the planner, which sits above the Trainer: it is handed in here, at the top,
# through the parallel layer's seam, by name (imported only when a run asks for it)
import_module("shardtrain.parallel.layout_choice").register("shardtrain.plan.auto_layout:AutoLayout.before_start")

_EXPORTS = {
    "CheckpointError": "shardtrain.errors",
    "DataError": "shardtrain.errors",
    "CheckpointManager": "shardtrain.checkpoint.manager",
    "EvalPrediction": "shardtrain.train.eval.loop",
    "FSDPConfig": "shardtrain.config.fsdp_config",
    "FSDPConfigError": "shardtrain.errors",
    "Seq2SeqTrainer": "shardtrain.seq2seq",
    "Seq2SeqTrainingArguments": "shardtrain.seq2seq",
    "Trainer": "shardtrain.train.trainer",
    "TrainerCallback": "shardtrain.train.state",
    "TrainerControl": "shardtrain.train.state",
    "TrainerState": "shardtrain.train.state",
    "TrainingArguments": "shardtrain.train.arguments",
    "TrainingArgumentsError": "shardtrain.errors",
    "UserError": "shardtrain.errors",
    "apply_fsdp": "shardtrain.parallel.fsdp",
    "arguments_on_engine": "shardtrain.train.compose",
    "on_engine": "shardtrain.train.compose",
    "destroy_distributed": "shardtrain.parallel.distributed",
    "init_distributed": "shardtrain.parallel.distributed",
    "load_pretrained": "shardtrain.parallel.loading",
    "plan": "shardtrain.plan",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        module = import_module(_EXPORTS[name])
        # `plan` is a callable subpackage: the module itself, so `shardtrain.plan.plan` works too
        value = module if _EXPORTS[name] == f"shardtrain.{name}" else getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'shardtrain' has no attribute {name!r}")
