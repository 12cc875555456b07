"""Build an optimizer by name, choosing torch's fused, multi-tensor (foreach) or per-parameter form."""
from __future__ import annotations

from typing import Any

import torch

from lightning_topk.optim.frozen_adamw import FrozenVarianceAdamW
from lightning_topk.optim.lamb import LAMB
from lightning_topk.optim.lars import LARS

OPTIMIZERS = ("sgd", "adam", "adamw", "lars", "lamb")
IMPLS = ("fused", "foreach", "loop")
_TORCH = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


def build_optimizer(name: str, params: Any, lr: float, impl: str = "fused", **kwargs: Any) -> torch.optim.Optimizer:
    """``name`` in :data:`OPTIMIZERS`; ``impl`` in :data:`IMPLS` (torch optimizers only: LARS and LAMB are
    always multi-tensor). ``params`` may come from :func:`lightning_topk.optim.param_groups`; other keyword
    arguments go to the optimizer. ``freeze_variance_after=W`` (adamw only; default 0: off) builds
    :class:`~lightning_topk.optim.FrozenVarianceAdamW`, AdamW whose second moment is frozen after step W, and
    ``beta1_after_freeze`` (None: off) its ``beta1`` after step W."""
    if name not in OPTIMIZERS:
        raise ValueError(f"build_optimizer: option 'name' must be one of {OPTIMIZERS}, got {name!r}")
    if impl not in IMPLS:
        raise ValueError(f"build_optimizer: option 'impl' must be one of {IMPLS}, got {impl!r}")
    if name == "lars":
        return LARS(params, lr=lr, **kwargs)
    if name == "lamb":
        return LAMB(params, lr=lr, **kwargs)
    if name == "sgd" and kwargs.get("momentum", 0) == 0 and kwargs.get("nesterov"):
        raise ValueError("build_optimizer: option 'nesterov' needs 'momentum' > 0")
    freeze = kwargs.pop("freeze_variance_after", 0)
    beta1_after = kwargs.pop("beta1_after_freeze", None)
    if freeze and name != "adamw":
        raise ValueError(f"build_optimizer: option 'freeze_variance_after' is for adamw, not {name!r}")
    if beta1_after is not None and not freeze:
        raise ValueError("build_optimizer: option 'beta1_after_freeze' needs 'freeze_variance_after' > 0 (adamw)")
    params = list(params)
    if impl == "fused" and name == "sgd" and _has_dtensor(params):
        impl = "foreach"  # torch's fused SGD has no DTensor (FSDP2) rule; the multi-tensor form computes the same
    flags = {"fused": {"fused": True, "foreach": False},
             "foreach": {"fused": False, "foreach": True},
             "loop": {"fused": False, "foreach": False}}[impl]
    if freeze:
        return FrozenVarianceAdamW(params, lr=lr, freeze_variance_after=freeze, beta1_after_freeze=beta1_after,
                                   **flags, **kwargs)
    return _TORCH[name](params, lr=lr, **flags, **kwargs)


def _has_dtensor(params: list) -> bool:
    """Whether any parameter (in a list of tensors or of param-group dicts) is a DTensor (sharded by FSDP2)."""
    from torch.distributed.tensor import DTensor

    tensors = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
    return any(isinstance(p, DTensor) for p in tensors)
