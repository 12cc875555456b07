"""LARS (layer-wise adaptive rate scaling) written on torch's multi-tensor (``torch._foreach_*``) ops."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_topk.optim._common import LOW_PRECISION, bucket_params, check_bool, check_number, fp32_views


class LARS(Optimizer):
    r"""SGD with momentum and a per-tensor LARS trust ratio, one multi-tensor pass per (device, dtype).

    For each parameter ``p`` with gradient ``g`` in a group with ``lars_adapt=True``::

        trust = trust_coeff * ||p|| / (||g|| + weight_decay * ||p|| + eps)   (1 if ||p|| == 0 or ||g|| == 0)
        d     = trust * (g + weight_decay * p)

    and ``d = g`` in groups with ``lars_adapt=False`` (biases and normalisation parameters, see
    :func:`lightning_topk.optim.param_groups`). Then ``buf = d`` on the first step, ``buf = momentum*buf + d``
    afterwards, ``update = d + momentum*buf`` if ``nesterov`` else ``buf``, and ``p -= lr*update``.
    fp16/bf16 parameters are updated through fp32 copies; momentum buffers are fp32.

    Args:
        params: parameters or parameter groups.
        lr: learning rate (required, >= 0).
        momentum: momentum factor in [0, 1).
        weight_decay: L2 factor (>= 0), applied inside the trust ratio; must be 0 where ``lars_adapt=False``.
        trust_coeff: LARS coefficient (> 0).
        eps: added to the trust-ratio denominator (>= 0).
        nesterov: Nesterov momentum (needs ``momentum > 0``).
        lars_adapt: apply the trust ratio (group option; ``False`` for excluded parameters).
        kernel: use :func:`lightning_topk.cuda_ops.fused_lars_step` (one norm and one update launch per
            group on CUDA with CuPy). ``None`` (default): when every parameter of the group is on CUDA and
            CuPy sees a device; ``True``: always (off CUDA it runs that function's torch reference);
            ``False``: never.
    """

    def __init__(self, params: Any, lr: float, momentum: float = 0.9, weight_decay: float = 0.0,
                 trust_coeff: float = 0.001, eps: float = 1e-8, nesterov: bool = False,
                 lars_adapt: bool = True, kernel: Optional[bool] = None) -> None:
        if kernel not in (None, True, False):
            raise ValueError(f"LARS: option 'kernel' must be None, True or False, got {kernel!r}")
        self.kernel = kernel
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, trust_coeff=trust_coeff,
                        eps=eps, nesterov=nesterov, lars_adapt=lars_adapt)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        super().add_param_group(param_group)
        g = self.param_groups[-1]
        check_number("LARS", "lr", g["lr"], lo=0.0)
        check_number("LARS", "momentum", g["momentum"], lo=0.0, hi=1.0, hi_open=True)
        check_number("LARS", "weight_decay", g["weight_decay"], lo=0.0)
        check_number("LARS", "trust_coeff", g["trust_coeff"], lo=0.0, lo_open=True)
        check_number("LARS", "eps", g["eps"], lo=0.0)
        check_bool("LARS", "nesterov", g["nesterov"])
        check_bool("LARS", "lars_adapt", g["lars_adapt"])
        if g["nesterov"] and g["momentum"] == 0:
            raise ValueError("LARS: option 'nesterov' needs 'momentum' > 0")
        if not g["lars_adapt"] and g["weight_decay"] != 0:
            raise ValueError("LARS: option 'weight_decay' must be 0 in a group with lars_adapt=False "
                             "(LARS applies weight decay inside the trust ratio)")

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            buckets = bucket_params(group["params"], "LARS")
            if buckets and self._use_kernel(buckets):
                self._kernel_step(group, [p for ps in buckets.values() for p in ps])
                continue
            for (_, dtype), params in buckets.items():
                self._update(group, params, dtype)
        return loss

    def _use_kernel(self, buckets: Dict[Any, List[Tensor]]) -> bool:
        if self.kernel is not None:
            return self.kernel
        if not all(dev.type == "cuda" for dev, _ in buckets):
            return False
        from lightning_topk.cuda_ops import cupy_available

        return cupy_available()

    def _kernel_step(self, group: Dict[str, Any], params: List[Tensor]) -> None:
        from lightning_topk.cuda_ops import fused_lars_step

        first = ["momentum_buffer" not in self.state[p] for p in params]
        for p, f in zip(params, first):
            if f:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32,
                                                                    memory_format=torch.contiguous_format)
        fused_lars_step(params, [p.grad for p in params], [self.state[p]["momentum_buffer"] for p in params],
                        lrs=group["lr"], weight_decays=group["weight_decay"], adapt=group["lars_adapt"],
                        momentum=group["momentum"], trust_coeff=group["trust_coeff"], eps=group["eps"],
                        nesterov=group["nesterov"], first_step=first)

    def _update(self, group: Dict[str, Any], params: List[Tensor], dtype: torch.dtype) -> None:
        lr, m, wd = group["lr"], group["momentum"], group["weight_decay"]
        low = dtype in LOW_PRECISION
        p32, g32 = fp32_views(params, dtype)

        # d = trust*g + (wd*trust)*p, expressed with per-tensor 0-d factors so no d-sized temporary is needed
        if group["lars_adapt"]:
            w = torch.stack(torch._foreach_norm(p32))
            gn = torch.stack(torch._foreach_norm(g32))
            trust = group["trust_coeff"] * w / (gn + w * wd + group["eps"])
            trust = torch.where((w > 0) & (gn > 0), trust, torch.ones_like(trust))
            trust_l = list(trust.unbind(0))
            wdt_l = list((trust * wd).unbind(0)) if wd != 0 else None
        else:
            trust_l = wdt_l = None

        if group["nesterov"]:
            self._nesterov(params, p32, g32, trust_l, wd, m, lr)
        elif m != 0:
            torch._foreach_add_(p32, self._momentum(params, p32, g32, trust_l, wdt_l, m), alpha=-lr)
        else:
            # p -= lr*d with d = trust*g + (wd*trust)*p folded into a per-tensor multiply of p
            if wdt_l is not None:
                torch._foreach_mul_(p32, [1.0 - lr * x for x in wdt_l])
            if trust_l is not None:
                torch._foreach_addcmul_(p32, g32, trust_l, value=-lr)
            else:
                torch._foreach_add_(p32, g32, alpha=-lr)
        if low:
            torch._foreach_copy_(params, p32)

    def _nesterov(self, params: List[Tensor], p32: List[Tensor], g32: List[Tensor],
                  trust_l: Optional[List[Tensor]], wd: float, m: float, lr: float) -> None:
        """Nesterov needs d itself next to the buffer, so it is materialised here (one temporary per tensor)."""
        if trust_l is not None:
            d = torch._foreach_add(g32, p32, alpha=wd) if wd != 0 else torch._foreach_mul(g32, trust_l)
            if wd != 0:
                torch._foreach_mul_(d, trust_l)
        else:
            d = torch._foreach_add(g32, 0.0)  # a copy: the update below is built in place
        new = [i for i, p in enumerate(params) if "momentum_buffer" not in self.state[p]]
        for i in new:
            self.state[params[i]]["momentum_buffer"] = d[i].clone()
        old = [i for i, p in enumerate(params) if i not in set(new)]
        if old:
            b = [self.state[params[i]]["momentum_buffer"] for i in old]
            torch._foreach_mul_(b, m)
            torch._foreach_add_(b, [d[i] for i in old])
        torch._foreach_add_(d, [self.state[p]["momentum_buffer"] for p in params], alpha=m)
        torch._foreach_add_(p32, d, alpha=-lr)

    def _momentum(self, params: List[Tensor], p32: List[Tensor], g32: List[Tensor],
                  trust_l: Optional[List[Tensor]], wdt_l: Optional[List[Tensor]], m: float) -> List[Tensor]:
        """buf = d on the first step, else momentum*buf + d; returns the buffers in ``params`` order."""
        old = [i for i, p in enumerate(params) if "momentum_buffer" in self.state[p]]
        new = [i for i, p in enumerate(params) if "momentum_buffer" not in self.state[p]]
        for idx, first in ((old, False), (new, True)):
            if not idx:
                continue
            g = [g32[i] for i in idx]
            t = [trust_l[i] for i in idx] if trust_l is not None else None
            if first:
                b = torch._foreach_mul(g, t) if t is not None else [x.detach().clone() for x in g]
                for i, x in zip(idx, b):
                    self.state[params[i]]["momentum_buffer"] = x
            else:
                b = [self.state[params[i]]["momentum_buffer"] for i in idx]
                torch._foreach_mul_(b, m)
                if t is not None:
                    torch._foreach_addcmul_(b, g, t)
                else:
                    torch._foreach_add_(b, g)
            if wdt_l is not None:
                torch._foreach_addcmul_(b, [p32[i] for i in idx], [wdt_l[i] for i in idx])
        return [self.state[p]["momentum_buffer"] for p in params]

