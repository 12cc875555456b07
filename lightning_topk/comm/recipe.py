"""``recipe="auto"``: the convergence recipe for the user's optimizer, resolved once at setup.

Measured (``benchmarks/convergence.py``, ``docs/convergence.md``): with SGD with momentum, DGC momentum
correction (the hook keeps the velocity and selects from it) reaches the targets in fewer steps than plain
error feedback; its momentum-factor masking (the velocity zeroed where sent) pays at density 0.001 and costs
at 0.01, where it takes the momentum off the entries sent most. With AdamW no recipe a hook can apply beats
plain error feedback by default (a density warm-up helps at 0.001, but its length depends on the run). So
``recipe="auto"`` does:

* ``torch.optim.SGD`` with momentum > 0, dampening 0 and no Nesterov in every parameter group, one momentum
  value for all groups: turns ``momentum_correction`` on with that momentum, with ``momentum_masking`` below
  density :data:`MASKING_BELOW` and without it from there up, and sets the optimizer's momentum to 0 (the
  velocity lives in the hook's state: checkpointed per rank, rolled back by a skipped step). Only while
  sparse steps can happen (``density < 1``) and the exchange supports momentum correction (the flat ones:
  ``auto`` then chooses among them alone, ``allgather``, ``dense``).
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

__all__ = ["MASKING_BELOW", "RECIPE_CHOICES", "apply_recipe", "masking_for", "recipe_for"]

# Momentum-factor masking pays below this density and costs above it (docs/convergence.md: at 0.01 masking was
# slower on MNIST-5k and digits, at 0.001 faster on both; at 0.005 slower on MNIST-5k, the task, and
# faster on digits; at 0.003 a tie on MNIST-5k and faster on digits).
MASKING_BELOW = 0.005


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
    masking = masking_for(config.density)
    how = "with momentum-factor masking" if masking else "without masking"
    return (replace(config, momentum_correction=True, momentum=m, momentum_masking=masking),
            f"recipe=auto -> momentum_correction {how} ({why}; density {config.density:g})")


def masking_for(density: float) -> bool:
    """Whether ``recipe="auto"``'s momentum correction masks the velocity at this density: below
    :data:`MASKING_BELOW` (a pure function of the configuration: the same on every rank)."""
    return density < MASKING_BELOW
