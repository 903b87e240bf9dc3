"""Trainer, arguments, data, optimisation."""

from shardtrain.train.arguments import TrainingArguments, TrainingArgumentsError
from shardtrain.train.evaluation import EvalPrediction, PredictionOutput
from shardtrain.train.state import TrainerCallback, TrainerControl, TrainerState
from shardtrain.train.trainer import Trainer

__all__ = ["EvalPrediction", "PredictionOutput", "Trainer", "TrainerCallback", "TrainerControl", "TrainerState",
           "TrainingArguments", "TrainingArgumentsError"]
