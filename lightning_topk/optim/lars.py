"""LARS (layer-wise adaptive rate scaling) written on torch's multi-tensor (``torch._foreach_*``) ops."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_topk.optim._common import LOW_PRECISION, bucket_params, check_bool, check_number, run_closure


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
        kernel: use :func:`lightning_topk.ops.cuda.fused_lars_step` (three launches per group on CUDA
            with CuPy). ``None`` (default): when every parameter of the group is on CUDA and
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
        loss = run_closure(closure)
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
        from lightning_topk.ops.cuda import cupy_available

        return cupy_available()

    def _kernel_step(self, group: Dict[str, Any], params: List[Tensor]) -> None:
        from lightning_topk.ops.cuda import fused_lars_step

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
        _lr, m, wd = group["lr"], group["momentum"], group["weight_decay"]
        grads = [p.grad for p in params]
        if group["lars_adapt"]:
            norm_dtype = torch.float64 if dtype == torch.float64 else torch.float32
            w = torch.stack(torch._foreach_norm(params, 2, dtype=norm_dtype))
            gn = torch.stack(torch._foreach_norm(grads, 2, dtype=norm_dtype))
            trust = group["trust_coeff"] * w / (gn + w * wd + group["eps"])
            trust = torch.where((w > 0) & (gn > 0), trust, torch.ones_like(trust))
            trust_l = list(trust.unbind(0))
            wdt_l = list((trust * wd).unbind(0)) if wd != 0 else None
        else:
            trust_l = wdt_l = None
        bufs: List[Optional[Tensor]] = [None] * len(params)
        first = [False] * len(params)
        if m != 0:
            for i, p in enumerate(params):
                st = self.state[p]
                if "momentum_buffer" not in st:
                    st["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float64 if dtype == torch.float64
                                                             else torch.float32,
                                                             memory_format=torch.contiguous_format)
                    first[i] = True
                bufs[i] = st["momentum_buffer"]
        block = _BLOCK if params[0].device.type == "cpu" else None
        for idx, ps, gs, bs in _blocks(params, grads, bufs, block):
            t = [trust_l[i] for i in idx] if trust_l is not None else None
            wdt = [wdt_l[i] for i in idx] if wdt_l is not None else None
            self._block(ps, gs, bs, t, wdt, [first[i] for i in idx], group, dtype in LOW_PRECISION)

    @staticmethod
    def _block(ps, gs, bs, t, wdt, first, group, low) -> None:
        """The update for a set of tensor slices; on CPU a block fits in cache, so the passes below
        touch memory about once (d = t*g + wdt*p is never materialised except for Nesterov)."""
        lr, m = group["lr"], group["momentum"]
        p32 = [x.float() for x in ps] if low else ps
        g32 = [x.float() for x in gs] if low else gs
        if group["nesterov"]:
            d = torch._foreach_mul(g32, t) if t is not None else [x.clone() for x in g32]
            if wdt is not None:
                torch._foreach_addcmul_(d, p32, wdt)
            old = [b for b, f in zip(bs, first) if not f]
            if old:
                torch._foreach_mul_(old, m)
            torch._foreach_add_(bs, d)  # new buffers are zeros: buf = d
            torch._foreach_add_(d, bs, alpha=m)
            torch._foreach_add_(p32, d, alpha=-lr)
        elif m != 0:
            old = [b for b, f in zip(bs, first) if not f]
            if old:
                torch._foreach_mul_(old, m)
            if t is not None:
                torch._foreach_addcmul_(bs, g32, t)
            else:
                torch._foreach_add_(bs, g32)
            if wdt is not None:
                torch._foreach_addcmul_(bs, p32, wdt)
            torch._foreach_add_(p32, bs, alpha=-lr)
        else:
            if wdt is not None:
                torch._foreach_mul_(p32, [1.0 - lr * x for x in wdt])
            if t is not None:
                torch._foreach_addcmul_(p32, g32, t, value=-lr)
            else:
                torch._foreach_add_(p32, g32, alpha=-lr)
        if low:
            torch._foreach_copy_(ps, p32)


# Elements per cache block on CPU: p, g and the fp32 buffer of a block (3 MB) stay in cache between passes.
_BLOCK = 1 << 18


def _blocks(params, grads, bufs, block):
    """Yield (tensor indices, param slices, grad slices, buffer slices) in blocks of about ``block`` values."""
    if block is None:
        yield list(range(len(params))), params, grads, bufs
        return
    idx, ps, gs, bs, size = [], [], [], [], 0
    for i, (p, g, b) in enumerate(zip(params, grads, bufs)):
        n = p.numel()
        flat = p.is_contiguous() and g.is_contiguous() and (b is None or b.is_contiguous())
        starts = range(0, n, block) if flat and n > block else [None]
        for s in starts:
            if s is None:
                idx.append(i); ps.append(p); gs.append(g); bs.append(b)  # noqa: E702
                size += n
            else:
                e = min(s + block, n)
                idx.append(i); ps.append(p.view(-1)[s:e]); gs.append(g.view(-1)[s:e])  # noqa: E702
                bs.append(None if b is None else b.view(-1)[s:e])
                size += e - s
            if size >= block:
                yield idx, ps, gs, bs
                idx, ps, gs, bs, size = [], [], [], [], 0
    if idx:
        yield idx, ps, gs, bs
