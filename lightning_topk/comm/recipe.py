"""``recipe="auto"``: the convergence recipe for the user's optimizer, resolved once at setup.

Measured (``benchmarks/convergence.py``, ``docs/convergence.md``): with SGD with momentum, DGC momentum
correction (the hook keeps the velocity and selects from it) reaches the targets in fewer steps than plain
error feedback, and a momentum lookahead on the sparse steps (``momentum_lookahead``: the residual
accumulates ``v + c*(v - v_prev)``, so a sent entry carries its next c steps of momentum at once) removes most
of the remaining delay: on MNIST-5k at density 0.01 it reaches 80% and 90% within 1.1x of dense SGD
with momentum's steps. With the lookahead, momentum-factor masking no longer pays at any density measured
(0.01 and 0.001), so it is off. With AdamW no recipe a hook can apply beats plain error feedback by default (a
density warm-up helps at 0.001, but its length depends on the run). So ``recipe="auto"`` does:

* ``torch.optim.SGD`` with momentum > 0, dampening 0 and no Nesterov in every parameter group, one momentum
  value for all groups: turns ``momentum_correction`` on with that momentum, without masking and with
  ``momentum_lookahead`` = that momentum (Nesterov's update through error feedback), and sets the
  optimizer's momentum to 0 (the velocity lives in the hook's state: checkpointed per rank, rolled back by
  a skipped step). Only while sparse steps can happen (``density < 1``) and the exchange supports momentum
  correction (the flat ones: ``auto`` then chooses among them alone, ``allgather``, ``dense``).
* With ``local_steps`` > 0 (sparse local SGD) there is no per-step top-k: nothing, the optimizer untouched.
* Anything else (Adam, AdamW, the repo's LARS, whose trust ratio is taken on the raw gradient, Nesterov,
  dampening, several optimizers): plain error feedback, the optimizer untouched.

Layer 1: torch only; the optimizer is duck-typed by its class and ``param_groups``.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence, Tuple

import torch

from lightning_topk.comm.state import RECIPE_CHOICES, TopKConfig

__all__ = ["RECIPE_CHOICES", "apply_recipe", "recipe_for"]

# recipe="auto" sets momentum_lookahead to the optimizer's momentum m: the residual then accumulates
# u = v + m (v - v_prev) = g + m v, PyTorch's Nesterov update, and every entry sent each step would be exactly
# SGD(nesterov=True). Measured (docs/convergence.md, BENCHMARKS.md; MNIST-5k, seeds 0-4, steps to 80%/90% as a
# multiple of dense SGD with momentum's): c = 0.9 1.10x/1.09x at density 0.01 and 1.76x/1.66x at 0.001, and it
# trained at 8x the preset learning rate; c = 3 was faster (1.04x/0.96x, 1.59x/1.59x) but diverged there, where
# heavy-ball dense and the lookahead-free recipe still train.


def recipe_for(config: TopKConfig, optimizers: Sequence[Any]) -> Tuple[bool, str]:
    """(whether ``recipe="auto"`` turns momentum correction on for these optimizers, why)."""
    if config.recipe != "auto":
        return False, "recipe='none'"
    if config.momentum_correction:
        return False, "momentum_correction is already on"
    if getattr(config, "local_steps", 0) > 0:
        return False, "local_steps > 0 (sparse local SGD): the inner optimizer keeps its momentum"
    if config.density >= 1.0:
        return False, "density 1 sends dense: the optimizer keeps its momentum"
    from lightning_topk.comm.exchanges import registry

    if config.exchange != "auto" and not getattr(registry.get(config.exchange), "momentum_correction", False):
        return False, f"exchange={config.exchange!r} does not support momentum correction"
    if config.hierarchical is True:
        return False, "the hierarchical exchange does not support momentum correction"
    if len(optimizers) != 1:
        return False, f"{len(optimizers)} optimizers (momentum correction needs one)"
    opt = optimizers[0]
    if type(opt) is not torch.optim.SGD:
        return False, f"{type(opt).__name__} is not torch.optim.SGD (plain error feedback measured best)"
    moms = {float(g.get("momentum", 0.0)) for g in opt.param_groups}
    if len(moms) != 1 or not 0.0 < next(iter(moms)) < 1.0:
        return False, f"SGD momentum {sorted(moms)} (needs one value in (0, 1))"
    if any(g.get("nesterov", False) or g.get("dampening", 0.0) != 0.0 for g in opt.param_groups):
        return False, "SGD with Nesterov or dampening"
    return True, f"SGD momentum {next(iter(moms))} moved into the hook"


def apply_recipe(config: TopKConfig, optimizers: Sequence[Any]) -> Tuple[TopKConfig, str]:
    """The config to run with (``momentum_correction`` on where :func:`recipe_for` says so, with the
    optimizer's momentum, whose groups then get momentum 0 in place) and a note saying what was done."""
    use, why = recipe_for(config, optimizers)
    if not use:
        return config, f"recipe=auto -> error_feedback ({why})"
    opt = optimizers[0]
    m = float(opt.param_groups[0]["momentum"])
    for g in opt.param_groups:
        g["momentum"] = 0.0
    return (replace(config, momentum_correction=True, momentum=m, momentum_masking=False, momentum_lookahead=m),
            f"recipe=auto -> momentum_correction without masking, momentum_lookahead {m:g} (Nesterov) ({why}; "
            f"density {config.density:g})")
