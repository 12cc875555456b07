"""Multi-tensor LARS/LAMB, AdamW with a frozen second moment, parameter-group exclusions and a fused/foreach
optimizer factory."""
from lightning_topk.optim.factory import IMPLS, OPTIMIZERS, build_optimizer
from lightning_topk.optim.frozen_adamw import FrozenVarianceAdamW
from lightning_topk.optim.lamb import LAMB
from lightning_topk.optim.lars import LARS
from lightning_topk.optim.param_groups import is_excluded, param_groups

__all__ = ["LARS", "LAMB", "FrozenVarianceAdamW", "param_groups", "is_excluded", "build_optimizer", "OPTIMIZERS",
           "IMPLS"]
