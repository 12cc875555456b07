"""AdamW whose second moment is frozen after a warm-up (1-bit Adam's frozen variance)."""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_topk.optim._common import run_closure


class FrozenVarianceAdamW(torch.optim.AdamW):
    r"""``torch.optim.AdamW`` for its first ``freeze_variance_after`` steps; after them ``exp_avg_sq`` stops
    changing and so does its bias correction (``1 - beta2**freeze_variance_after``).

    From step ``W + 1`` on (``W = freeze_variance_after``), per parameter ``p`` with gradient ``g``::

        p -= lr * weight_decay * p
        m = b*m + (1-b)*g                  # b = beta1_after_freeze, else beta1
        p -= lr / (1-b^t) * m / (sqrt(v_W / (1-beta2^W)) + eps)

    The preconditioner ``1 / (sqrt(v_W / (1-beta2^W)) + eps)`` is then a constant, so the update is linear in the
    gradients: a gradient that arrives late and in one piece (error feedback's sparse exchange, top-k of the
    update) moves the parameters as far as the same gradients spread over the steps would, where AdamW's growing
    second moment shrinks such a burst to about one step's movement (docs/convergence.md). This is 1-bit Adam's
    idea (Tang et al., 2021); ``W`` should cover the run's dense (synchronous) warm-up, e.g. the strategy's
    ``dense_steps``.

    The first ``W`` steps are torch's own ``AdamW.step`` (``fused``/``foreach`` as given), so they are AdamW's bit
    for bit. The frozen steps are a per-parameter loop (also for DTensor parameters, FSDP2's shards). The state is
    AdamW's (``step``, ``exp_avg``, ``exp_avg_sq``): a checkpoint loads into either class. ``amsgrad``,
    ``maximize`` and complex parameters are refused; ``freeze_variance_after=0`` is plain AdamW.

    ``beta1_after_freeze`` gives the frozen steps a shorter momentum. Error feedback already holds each entry back
    until it is sent, which acts as a second momentum on top of AdamW's; with the top-k of the update at 1% a
    ``beta1`` of 0.5 after the dense steps ends below dense AdamW's loss on the byte-level LM, where 0.9 ends 5%
    above it (docs/convergence.md, "A third sweep").

    Args:
        params, lr, betas, eps, weight_decay, foreach, fused: as ``torch.optim.AdamW``.
        freeze_variance_after: W, the last step that updates ``exp_avg_sq`` (int >= 0; 0: never frozen).
        beta1_after_freeze: ``beta1`` for the steps after W (a float in [0, 1); None: ``betas[0]``).
    """

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, freeze_variance_after: int = 0,
                 beta1_after_freeze: Optional[float] = None, amsgrad: bool = False,
                 maximize: bool = False, foreach: Optional[bool] = None, fused: Optional[bool] = None,
                 **kwargs: Any) -> None:
        if isinstance(freeze_variance_after, bool) or not isinstance(freeze_variance_after, int) \
                or freeze_variance_after < 0:
            raise ValueError("FrozenVarianceAdamW: option 'freeze_variance_after' must be an int >= 0, "
                             f"got {freeze_variance_after!r}")
        if beta1_after_freeze is not None and (isinstance(beta1_after_freeze, bool)
                                               or not isinstance(beta1_after_freeze, (int, float))
                                               or not 0.0 <= beta1_after_freeze < 1.0):
            raise ValueError("FrozenVarianceAdamW: option 'beta1_after_freeze' must be None or a float in [0, 1), "
                             f"got {beta1_after_freeze!r}")
        if beta1_after_freeze is not None and freeze_variance_after == 0:
            raise ValueError("FrozenVarianceAdamW: option 'beta1_after_freeze' needs 'freeze_variance_after' > 0")
        if amsgrad or maximize:
            raise ValueError("FrozenVarianceAdamW: 'amsgrad' and 'maximize' are not supported")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=False,
                         maximize=False, foreach=foreach, fused=fused, **kwargs)
        for g in self.param_groups:
            g.setdefault("freeze_variance_after", freeze_variance_after)
            g.setdefault("beta1_after_freeze", beta1_after_freeze)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for g in self.param_groups:
            g.setdefault("freeze_variance_after", 0)
            g.setdefault("beta1_after_freeze", None)

    def _frozen(self, group: dict) -> bool:
        """Whether this step of ``group`` comes after its freeze (every parameter with state is past step W)."""
        w = group["freeze_variance_after"]
        if w <= 0:
            return False
        steps = [self.state[p]["step"] for p in group["params"] if p.grad is not None and p in self.state]
        if not steps:
            return False
        return all(float(s) >= w for s in steps)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = run_closure(closure)
        live = [g for g in self.param_groups if not self._frozen(g)]
        if live:  # torch's AdamW on the groups before their freeze (the others hidden for this call)
            frozen_groups = [g for g in self.param_groups if g not in live]
            all_groups = self.param_groups
            self.param_groups = live
            try:
                super().step()
            finally:
                self.param_groups = all_groups
        else:
            frozen_groups = self.param_groups
        for group in frozen_groups:
            self._frozen_step(group)
        return loss

    def _frozen_step(self, group: dict) -> None:
        beta1, beta2 = group["betas"]
        if group.get("beta1_after_freeze") is not None:
            beta1 = group["beta1_after_freeze"]
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        if isinstance(lr, Tensor):
            lr = float(lr)
        sqrt_bc2 = math.sqrt(1.0 - beta2 ** group["freeze_variance_after"])
        for p in group["params"]:
            if p.grad is None:
                continue
            if torch.is_complex(p):
                raise ValueError("FrozenVarianceAdamW: complex parameters are not supported")
            st = self.state[p]
            st["step"] += 1
            t = float(st["step"])
            p.mul_(1.0 - lr * wd)
            st["exp_avg"].lerp_(p.grad, 1.0 - beta1)
            denom = (st["exp_avg_sq"].sqrt() / sqrt_bc2).add_(eps)
            p.addcdiv_(st["exp_avg"], denom, value=-lr / (1.0 - beta1 ** t))
