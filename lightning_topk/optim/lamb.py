"""LAMB (layer-wise adaptive moments) written on torch's multi-tensor (``torch._foreach_*``) ops."""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_topk.optim._common import (
    LOW_PRECISION,
    bucket_params,
    check_bool,
    check_number,
    fp32_views,
    run_closure,
)


class LAMB(Optimizer):
    r"""Adam moments with decoupled weight decay and a per-tensor trust ratio, one multi-tensor pass per bucket.

    Per parameter ``p`` with gradient ``g`` at step ``t``::

        m = beta1*m + (1-beta1)*g ;  v = beta2*v + (1-beta2)*g*g
        u = (m / (1-beta1^t)) / (sqrt(v / (1-beta2^t)) + eps) + weight_decay*p
        trust = ||p|| / ||u||   (1 if either norm is zero)
        p -= lr * trust * u

    Groups with ``lars_adapt=False`` (biases, normalisation parameters) use ``trust = 1`` and no weight
    decay. Without ``bias_correction`` the ``1-beta^t`` factors are 1. Moments are fp32 and fp16/bf16
    parameters are updated through fp32 copies.

    Args:
        params: parameters or parameter groups.
        lr: learning rate (required, >= 0).
        betas: ``(beta1, beta2)``, each in [0, 1).
        eps: added to the denominator (>= 0).
        weight_decay: decoupled weight decay (>= 0); must be 0 where ``lars_adapt=False``.
        bias_correction: divide the moments by ``1-beta^t``.
        lars_adapt: apply the trust ratio (group option; the same key as :class:`LARS`).
    """

    def __init__(self, params: Any, lr: float, betas: tuple = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, bias_correction: bool = True, lars_adapt: bool = True) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, lars_adapt=lars_adapt)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        super().add_param_group(param_group)
        g = self.param_groups[-1]
        check_number("LAMB", "lr", g["lr"], lo=0.0)
        betas = g["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"LAMB: option 'betas' must be a pair (beta1, beta2), got {betas!r}")
        check_number("LAMB", "betas[0]", betas[0], lo=0.0, hi=1.0, hi_open=True)
        check_number("LAMB", "betas[1]", betas[1], lo=0.0, hi=1.0, hi_open=True)
        check_number("LAMB", "eps", g["eps"], lo=0.0)
        check_number("LAMB", "weight_decay", g["weight_decay"], lo=0.0)
        check_bool("LAMB", "bias_correction", g["bias_correction"])
        check_bool("LAMB", "lars_adapt", g["lars_adapt"])
        if not g["lars_adapt"] and g["weight_decay"] != 0:
            raise ValueError("LAMB: option 'weight_decay' must be 0 in a group with lars_adapt=False")

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = run_closure(closure)
        for group in self.param_groups:
            for (device, dtype), params in bucket_params(group["params"], "LAMB").items():
                for chunk in _chunks(params, _CHUNK if device.type == "cpu" else None):
                    self._update(group, chunk, dtype)
        return loss

    def _update(self, group: Dict[str, Any], params: List[Tensor], dtype: torch.dtype) -> None:
        b1, b2 = group["betas"]
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        p32, g32 = fp32_views(params, dtype)
        for p, g in zip(params, g32):
            st = self.state[p]
            if "step" not in st:
                st["step"] = torch.tensor(0.0)
                st["exp_avg"] = torch.zeros_like(g, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(g, memory_format=torch.preserve_format)
        states = [self.state[p] for p in params]
        steps = [st["step"] for st in states]
        torch._foreach_add_(steps, 1.0)
        m = [st["exp_avg"] for st in states]
        v = [st["exp_avg_sq"] for st in states]
        torch._foreach_mul_(m, b1)
        torch._foreach_add_(m, g32, alpha=1 - b1)
        torch._foreach_mul_(v, b2)
        torch._foreach_addcmul_(v, g32, g32, value=1 - b2)

        if group["bias_correction"]:
            ts = [int(s.item()) for s in steps]
            bc1 = [1 - b1 ** t for t in ts]
            bc2_sqrt = [math.sqrt(1 - b2 ** t) for t in ts]
        else:
            bc1 = bc2_sqrt = [1.0] * len(params)
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, bc2_sqrt)
        torch._foreach_add_(denom, eps)
        u = torch._foreach_div(m, bc1)
        torch._foreach_div_(u, denom)
        del denom
        if group["lars_adapt"]:
            if wd != 0:
                torch._foreach_add_(u, p32, alpha=wd)
            w = torch.stack(torch._foreach_norm(p32))
            un = torch.stack(torch._foreach_norm(u))
            trust = torch.where((w > 0) & (un > 0), w / un, torch.ones_like(w))
            torch._foreach_mul_(u, list(trust.unbind(0)))
        torch._foreach_add_(p32, u, alpha=-lr)
        if dtype in LOW_PRECISION:
            torch._foreach_copy_(params, p32)


# On CPU, tensors are processed in chunks of about this many values so the temporaries (fp32 copies, u)
# stay small enough for the allocator to reuse instead of faulting in fresh pages every step.
_CHUNK = 1 << 20


def _chunks(params: List[Tensor], size: Optional[int]):
    if size is None:
        yield params
        return
    out, n = [], 0
    for p in params:
        out.append(p)
        n += p.numel()
        if n >= size:
            yield out
            out, n = [], 0
    if out:
        yield out
