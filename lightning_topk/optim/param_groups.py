"""Split a model's parameters into a decayed/adapted group and an excluded group (biases, 1-D, norm layers)."""
from __future__ import annotations

from typing import Any, Dict, List

import torch
from torch import nn

# Normalisation layers whose affine parameters are never decayed or LARS/LAMB-adapted.
NORM_LAYERS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm,
               nn.RMSNorm) if hasattr(nn, "RMSNorm") else (nn.modules.batchnorm._NormBase, nn.LayerNorm,
                                                           nn.GroupNorm, nn.LocalResponseNorm)


def is_excluded(module: nn.Module, name: str, param: torch.Tensor) -> bool:
    """True for biases, every parameter with fewer than 2 dimensions, and normalisation layers' parameters."""
    return name == "bias" or name.endswith(".bias") or param.ndim <= 1 or isinstance(module, NORM_LAYERS)


def param_groups(model: nn.Module, weight_decay: float = 0.0, **group_options: Any) -> List[Dict[str, Any]]:
    """Parameter groups for LARS/LAMB (and any torch optimizer).

    Returns ``[{"params": decayed, "weight_decay": weight_decay, **group_options},
    {"params": excluded, "weight_decay": 0.0, "lars_adapt": False, **group_options}]``; empty groups are
    dropped. Frozen parameters (``requires_grad=False``) are left out and shared parameters appear once.
    Torch's own optimizers keep the unknown ``lars_adapt`` key and ignore it.
    """
    if isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float)) or weight_decay < 0:
        raise ValueError(f"param_groups: option 'weight_decay' must be a number >= 0, got {weight_decay!r}")
    for key in ("params", "weight_decay", "lars_adapt"):
        if key in group_options:
            raise ValueError(f"param_groups: option '{key}' is set by the helper; pass other group options only")
    decay: List[torch.Tensor] = []
    excluded: List[torch.Tensor] = []
    seen = set()
    for _mod_name, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            (excluded if is_excluded(module, name, p) else decay).append(p)
    groups = [
        dict(params=decay, weight_decay=float(weight_decay), **group_options),
        dict(params=excluded, weight_decay=0.0, lars_adapt=False, **group_options),
    ]
    return [g for g in groups if g["params"]]
