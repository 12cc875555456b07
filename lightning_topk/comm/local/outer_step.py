"""The outer step of sparse local SGD (torch only): which one (``outer_recipe``, :func:`outer_step_for`), the
outer optimizer (:func:`outer_sgd_`) and the amplification guard (:class:`AmplifyGuard`).

7. the outer optimizer: SGD on the averaged pseudo-gradient ``g``: ``m = μ m + g``; step ``g + μ m``
   (Nesterov, DiLoCo) or ``m``; ``θ_outer −= outer_lr · step``. ``μ = 0`` with error feedback is SparseLoCo.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from torch import Tensor

from lightning_topk.comm.config import TopKConfig

log = logging.getLogger(__name__)


# ---- which outer step (outer_recipe) -------------------------------------------------------------------
# outer_recipe="auto": (outer_lr, outer_momentum, outer_nesterov) per kind of inner optimizer, measured on
# scikit-learn digits, a small CNN, H 4, 10% at 4 bits, 2 and 4 replicas, 2 seeds (benchmarks/outer_recipe.py,
# docs/local_sgd.md "Which outer step"). DiLoCo's (0.7, Nesterov 0.9) was tuned with AdamW inner steps at large H;
# with heavy-ball SGD inner steps it compounds the inner momentum and diverged (issue 31: 0.14 test accuracy at 2
# replicas); plain averaging (post-local SGD, torch's PeriodicModelAverager) stayed within 0.5 points of DDP with
# SGD (momentum or Nesterov) and LARS, and was the closest to DDP with Adam and AdamW (-1.3 to -1.8 points; DiLoCo
# -8.5 to -20). Plain SGD without momentum is the one that gains from outer momentum (+5.7 / +26 points over DDP at
# 2 / 4 replicas with DiLoCo's step: the outer momentum stands in for the missing inner one).
OUTER_RECIPE_TABLE: Dict[str, Tuple[float, float, bool]] = {
    "sgd": (0.7, 0.9, True),
    "sgd_momentum": (1.0, 0.0, False),
    "sgd_nesterov": (1.0, 0.0, False),
    "lars": (1.0, 0.0, False),
    "adam": (1.0, 0.0, False),
    "adamw": (1.0, 0.0, False),
}
NAMED_RECIPES: Dict[str, Tuple[float, float, bool]] = {"diloco": (0.7, 0.9, True), "average": (1.0, 0.0, False)}
UNKNOWN_RECIPE = (1.0, 0.0, False)  # an optimizer the table does not know: plain averaging cannot amplify


@dataclass(frozen=True)
class OuterStep:
    """The outer step a run takes: ``identity`` (one replica under ``outer_recipe="auto"``: θ_outer := θ_local,
    nothing sent) or SGD with ``lr``, ``momentum``, ``nesterov``; ``why`` says where they came from."""

    lr: float
    momentum: float
    nesterov: bool
    identity: bool = False
    why: str = ""


def inner_kind(optimizers: Optional[Sequence[Any]]) -> Optional[str]:
    """The table's key for the inner optimizer(s) (duck-typed by class and ``param_groups``), or None."""
    if not optimizers or len(optimizers) != 1:
        return None
    opt = optimizers[0]
    name = type(opt).__name__
    groups = getattr(opt, "param_groups", [])
    if name == "SGD":
        if any(g.get("nesterov", False) for g in groups):
            return "sgd_nesterov"
        return "sgd_momentum" if any(float(g.get("momentum", 0.0)) > 0 for g in groups) else "sgd"
    return {"LARS": "lars", "Adam": "adam", "AdamW": "adamw"}.get(name)


def outer_step_for(config: TopKConfig, optimizers: Optional[Sequence[Any]], replicas: int) -> OuterStep:
    """The outer step for ``config`` among ``replicas`` replicas with these inner ``optimizers`` (None: unknown).
    ``outer_lr`` / ``outer_momentum`` / ``outer_nesterov`` set in the config win one by one; the unset ones come
    from ``outer_recipe``: ``"auto"`` reads :data:`OUTER_RECIPE_TABLE` (plain averaging for an optimizer it does
    not know, outer momentum 0 with ``outer_streaming``), and with one replica, none of the three set, the round
    is the identity; ``"diloco"`` / ``"average"`` are :data:`NAMED_RECIPES`."""
    pinned = {k: getattr(config, k, None) for k in ("outer_lr", "outer_momentum", "outer_nesterov")}
    recipe = getattr(config, "outer_recipe", "auto")
    if recipe == "auto":
        kind = inner_kind(optimizers)
        lr, mu, nest = OUTER_RECIPE_TABLE.get(kind, UNKNOWN_RECIPE) if kind else UNKNOWN_RECIPE
        why = f"outer_recipe='auto' for {kind or 'an inner optimizer not in the table'}"
        if config.outer_streaming and mu > 0:
            mu, why = 0.0, why + " (momentum 0: outer_streaming)"
    else:
        (lr, mu, nest), why = NAMED_RECIPES[recipe], f"outer_recipe={recipe!r}"
    if all(v is None for v in pinned.values()) and recipe == "auto" and replicas <= 1:
        return OuterStep(1.0, 0.0, False, identity=True,
                         why="one replica under outer_recipe='auto': the outer round is the identity "
                             "(theta_outer := theta_local; set outer_lr/outer_momentum to take an outer step)")
    lr = pinned["outer_lr"] if pinned["outer_lr"] is not None else lr
    mu = pinned["outer_momentum"] if pinned["outer_momentum"] is not None else mu
    if pinned["outer_nesterov"] is not None:
        nest = pinned["outer_nesterov"]
    elif pinned["outer_momentum"] is not None:
        nest = True  # an outer momentum set without outer_nesterov: DiLoCo's Nesterov, as before outer_recipe
    set_ = [k for k, v in pinned.items() if v is not None]
    if set_:
        why += f"; {', '.join(set_)} as set"
    return OuterStep(float(lr), float(mu), bool(nest) and mu > 0, why=why)


# The amplification guard (said once, naming the options): AMPLIFY_ROUNDS rounds in a row whose outer step moved
# θ_outer more than AMPLIFY_RATIO times as far as this replica's own pseudo-gradient while θ_outer's norm has grown
# beyond AMPLIFY_NORM_GROWTH times its norm at the first round. The ratio alone does not tell a diverging run (SGD
# momentum with DiLoCo's step: ratio 2-4, weights' norm 4.5 -> 45-185) from a healthy one (plain SGD with DiLoCo's
# step: ratio up to 9-23, norm -> 15, +5.7 points over DDP); the growth does (healthy runs measured: at most 5.6x,
# diverging ones: 8.6x and more; benchmarks/outer_recipe.py).
AMPLIFY_RATIO = 2.0
AMPLIFY_NORM_GROWTH = 6.0
AMPLIFY_ROUNDS = 3


# ---- the outer optimizer -------------------------------------------------------------------------
def outer_sgd_(theta: Tensor, mom: Tensor, g: Tensor, lr: float, momentum: float, nesterov: bool) -> None:
    """``θ -= lr · step`` (torch SGD's update, dampening 0): ``m = μ m + g``; step = ``g + μ m`` (Nesterov) or
    ``m``; with ``μ = 0`` the step is ``g``."""
    if momentum == 0.0:
        theta.sub_(g, alpha=lr)
        return
    mom.mul_(momentum).add_(g)
    step = g.add(mom, alpha=momentum) if nesterov else mom
    theta.sub_(step, alpha=lr)



class AmplifyGuard:
    """Say once when the outer step keeps moving θ_outer (this rank's shard) more than ``AMPLIFY_RATIO`` times
    as far as this replica's own pseudo-gradient while θ_outer's norm has grown ``AMPLIFY_NORM_GROWTH``-fold,
    ``AMPLIFY_ROUNDS`` rounds in a row: outer momentum amplifying the inner steps (how DiLoCo's outer step
    diverged with SGD-momentum inner steps)."""

    def __init__(self, rule: OuterStep, speaks: Callable[[], bool]) -> None:
        self.rule = rule
        self.speaks = speaks  # whether this rank logs (the first replica's first rank)
        self.last_ratio = 0.0  # |outer step| / |own pseudo-gradient| of the last round (this rank's shard)
        self.last_growth = 0.0  # |θ_outer| / |θ_outer at the first round| (this rank's shard)
        self._norm0: Optional[float] = None
        self._amplified = 0  # rounds in a row whose outer step amplified the replica's own (AMPLIFY_RATIO)
        self.warned = False

    def __call__(self, moved: float, own: float, norm: float) -> None:
        """One round: how far the outer step moved this rank's shard, its own pseudo-gradient's norm, and
        θ_outer's norm (this rank's shard) after the step."""
        self.last_ratio = moved / own if own > 0 else 0.0
        if self._norm0 is None:
            self._norm0 = norm
        self.last_growth = norm / self._norm0 if self._norm0 > 0 else 0.0
        grown = self.last_growth > AMPLIFY_NORM_GROWTH
        self._amplified = self._amplified + 1 if self.last_ratio > AMPLIFY_RATIO and grown else 0
        if self._amplified >= AMPLIFY_ROUNDS and not self.warned:
            self.warned = True
            if self.speaks():
                r = self.rule
                log.warning("topk_local: the outer step moved theta_outer %.1fx as far as this replica's own inner "
                            "steps did, %d rounds in a row, and the weights' norm grew %.1fx (outer_lr=%g, "
                            "outer_momentum=%g, outer_nesterov=%s: %s): "
                            "the outer momentum is amplifying the inner steps, which diverged with SGD-momentum "
                            "inner steps (docs/local_sgd.md). Set outer_recipe='auto' with outer_lr, outer_momentum "
                            "and outer_nesterov unset (the measured outer step for the inner optimizer), or "
                            "outer_recipe='average' (outer_lr=1, outer_momentum=0: plain averaging), or lower "
                            "outer_momentum", self.last_ratio, self._amplified, self.last_growth, r.lr, r.momentum,
                            r.nesterov, r.why)
