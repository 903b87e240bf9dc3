"""`shardtrain plan`: will a training run fit, and how long will a step take? Predicted from a traced step.

    import shardtrain
    print(shardtrain.plan("config.json", world_size=8, per_device_batch=4, seq_len=2048, bf16=True).table())
    # the same: from shardtrain.plan import plan
"""

import sys
import types

from shardtrain.errors import PlanError
from shardtrain.plan.planner import plan
from shardtrain.plan.result import Plan

__all__ = ["Plan", "PlanError", "plan"]


class _CallableModule(types.ModuleType):
    """Importing the subpackage makes `shardtrain.plan` this module; calling it still plans."""

    def __call__(self, *args, **kwargs) -> Plan:
        return plan(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
