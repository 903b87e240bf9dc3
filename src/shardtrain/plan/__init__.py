"""`shardtrain plan`: will a training run fit, and how long will a step take? Predicted from a traced step.

    from shardtrain.plan import plan
    print(plan("config.json", world_size=8, per_device_batch=4, seq_len=2048, bf16=True).table())
"""

from shardtrain.plan.model_source import PlanError
from shardtrain.plan.planner import Plan, plan

__all__ = ["Plan", "PlanError", "plan"]
