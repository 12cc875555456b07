"""Per-parameter reference optimizers, written the way users know them (timm's ``Lars`` loop).

They define the semantics that :class:`~lightning_topk.optim.LARS` and :class:`~lightning_topk.optim.LAMB`
must match, and are the baseline of ``benchmarks/bench_optim.py``. timm itself is not a dependency:
this repeats its ``Lars.step`` loop (one small op per tensor per stage), with the exclusion decided by the
group's ``lars_adapt`` option and fp32 math for fp16/bf16 parameters.
"""
from __future__ import annotations

import torch
from torch.optim import Optimizer

from lightning_topk.optim._common import run_closure


class LoopLars(Optimizer):
    """LARS as a Python loop over parameters (timm ``Lars`` structure, dampening 0, no trust clipping)."""

    def __init__(self, params, lr, momentum=0.9, weight_decay=0.0, trust_coeff=0.001, eps=1e-8,
                 nesterov=False, lars_adapt=True):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                                      trust_coeff=trust_coeff, eps=eps, nesterov=nesterov, lars_adapt=lars_adapt))

    @torch.no_grad()
    def step(self, closure=None):
        loss = run_closure(closure)
        device = self.param_groups[0]["params"][0].device
        one_tensor = torch.tensor(1.0, device=device)
        for group in self.param_groups:
            weight_decay = group["weight_decay"]
            momentum = group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                low = p.dtype in (torch.float16, torch.bfloat16)
                w = p.float() if low else p
                grad = p.grad.float() if low else p.grad  # timm modifies p.grad in place
                if group["lars_adapt"]:
                    w_norm = w.norm(2.0)
                    g_norm = grad.norm(2.0)
                    trust_ratio = group["trust_coeff"] * w_norm / (g_norm + w_norm * weight_decay + group["eps"])
                    trust_ratio = torch.where(w_norm > 0, torch.where(g_norm > 0, trust_ratio, one_tensor),
                                              one_tensor)
                    grad.add_(w, alpha=weight_decay)
                    grad.mul_(trust_ratio)
                if momentum != 0:
                    state = self.state[p]
                    if "momentum_buffer" not in state:
                        buf = state["momentum_buffer"] = torch.clone(grad).detach()
                    else:
                        buf = state["momentum_buffer"]
                        buf.mul_(momentum).add_(grad)
                    grad = grad.add(buf, alpha=momentum) if group["nesterov"] else buf
                if low:
                    p.copy_(w.add_(grad, alpha=-group["lr"]))
                else:
                    p.add_(grad, alpha=-group["lr"])
        return loss


class LoopLamb(Optimizer):
    """LAMB as a Python loop over parameters (same math as :class:`~lightning_topk.optim.LAMB`)."""

    def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, bias_correction=True,
                 lars_adapt=True):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      bias_correction=bias_correction, lars_adapt=lars_adapt))

    @torch.no_grad()
    def step(self, closure=None):
        loss = run_closure(closure)
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                low = p.dtype in (torch.float16, torch.bfloat16)
                w = p.float() if low else p
                g = p.grad.float()
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    st["exp_avg"] = torch.zeros_like(g)
                    st["exp_avg_sq"] = torch.zeros_like(g)
                st["step"] += 1
                t = st["step"]
                m, v = st["exp_avg"], st["exp_avg_sq"]
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                bc1 = 1 - b1 ** t if group["bias_correction"] else 1.0
                bc2 = 1 - b2 ** t if group["bias_correction"] else 1.0
                u = (m / bc1) / ((v / bc2).sqrt() + group["eps"])
                if group["lars_adapt"]:
                    u.add_(w, alpha=group["weight_decay"])
                    wn, un = w.norm(), u.norm()
                    if wn > 0 and un > 0:
                        u.mul_(wn / un)
                w.add_(u, alpha=-group["lr"])
                if low:
                    p.copy_(w)
        return loss
