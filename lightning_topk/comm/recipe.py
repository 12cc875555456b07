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
  value for all groups: momentum correction with that momentum, without masking and with
  ``momentum_lookahead`` = that momentum (Nesterov's update through error feedback). Only where sparse steps
  can happen (``density < 1``) and the exchange supports momentum correction (the flat ones: ``auto`` then
  chooses among them alone, ``allgather``, ``dense``).

  In a run it is :class:`LiveRecipe`: **dormant until the first step that sent a bucket sparse**, so
  while every bucket goes dense (density 1, an ``auto`` plan that sends all dense, ``dense_steps``) the
  hook sends the raw gradient and the optimizer is DDP's, untouched. (Decided once per optimizer step, before its
  backward, under automatic and manual optimization alike; a checkpoint keeps whether the last step sent sparse,
  :meth:`TopKState.last_sent_sparse`.) From the next step on the velocity
  lives in the hook (seeded with the optimizer's momentum buffers; checkpointed per rank, rolled back by a
  skipped step); the optimizer's ``momentum`` and ``weight_decay`` are set to 0 only *during* its step and
  restored after it, so schedulers (``OneCycleLR(cycle_momentum=True)``), callbacks and checkpoints see the
  user's values, and the hook follows the momentum they write at every step. Weight decay keeps its
  meaning: its share of SGD's momentum (``b = m b + wd p``, linear in the gradient) is kept per parameter
  in the optimizer's state (``topk_wd_momentum``, so it is checkpointed) and applied after the step.
* With ``local_steps`` > 0 (sparse local SGD) there is no per-step top-k: nothing, the optimizer untouched.
* Anything else (Adam, AdamW, the repo's LARS, whose trust ratio is taken on the raw gradient, Nesterov,
  dampening, several optimizers): plain error feedback, the optimizer untouched.

Layer 1: torch only; the optimizer is duck-typed by its class and ``param_groups``.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor

from lightning_topk.comm.config import RECIPE_CHOICES, TopKConfig
from lightning_topk.comm.exchanges import registry
from lightning_topk.comm.state import TopKState

__all__ = ["RECIPE_CHOICES", "LiveRecipe", "apply_recipe", "live_recipe", "recipe_for", "unresolved_note", "WD_MOMENTUM"]

WD_MOMENTUM = "topk_wd_momentum"  # the optimizer-state key of weight decay's share of SGD's momentum

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
    if any(g.get("maximize", False) for g in opt.param_groups):
        return False, "SGD with maximize=True"
    return True, f"SGD momentum {next(iter(moms))} moved into the hook"


def target_config(config: TopKConfig, momentum: float) -> TopKConfig:
    """The options momentum correction runs with under ``recipe="auto"`` at SGD momentum ``momentum``."""
    return replace(config, momentum_correction=True, momentum=momentum, momentum_masking=False,
                   momentum_lookahead=momentum)


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
    return target_config(config, m), _engaged_note(m, "", why, config)


def _engaged_note(m: float, when: str, why: str, config: TopKConfig) -> str:
    """The decision in words where momentum correction takes the optimizer's momentum ``m``."""
    return (f"recipe=auto -> momentum_correction without masking, momentum_lookahead {m:g} (Nesterov){when} ({why}; "
            f"density {config.density:g})")


def unresolved_note(config: TopKConfig) -> str:
    """What ``recipe`` reads as before the optimizers are known (the strategies' ``topk_recipe`` until then)."""
    return "recipe=none" if config.recipe == "none" else "recipe=auto: not resolved yet"


def live_recipe(config: TopKConfig, optimizers: Sequence[Any], make: Optional[Any] = None
                ) -> Tuple[Optional["LiveRecipe"], TopKConfig, str]:
    """``recipe="auto"`` in a run (``topk_ddp`` and ``topk_fsdp`` alike): (the dormant :class:`LiveRecipe`, or None;
    the config to build the exchange for, :func:`target_config` where it applies; the decision in words).
    ``make``: the :class:`LiveRecipe` class to build (a subclass seeds the velocity of sharded parameters)."""
    use, why = recipe_for(config, optimizers)
    if not use:
        return None, config, f"recipe=auto -> error_feedback ({why})"
    live = (make or LiveRecipe)(optimizers[0], config)
    m = live.momentum()
    return live, target_config(config, m), _engaged_note(m, ", from the step after the first one that sends sparse",
                                                         why, config)


class LiveRecipe:
    """``recipe="auto"``'s momentum correction on the user's live SGD (see the module docstring).

    ``begin_step`` before each backward, ``before_step``/``after_step`` around each optimizer step; the
    state's ``config`` is the dormant one (no momentum correction) until :meth:`engage`."""

    def __init__(self, optimizer: Any, dormant: TopKConfig) -> None:
        self.optimizer = optimizer
        self.dormant = dormant
        self.engaged = False
        self._stepping: Optional[float] = None  # the user's momentum while before_step has zeroed the groups'
        self._decided = False  # this optimizer step's engage decision is taken (at its first begin_step)
        # ids of the parameters whose gradients go through the hook (topk_ddp: those in DDP's buckets; None: all),
        # and every parameter's name by id (for messages): see check_hooked
        self.hooked: Optional[Set[int]] = None
        self.names: Dict[int, str] = {}

    def momentum(self) -> float:
        """The one momentum of the optimizer's groups now (a scheduler or callback may have written it); inside
        the optimizer step (automatic optimization runs the backward there), the value before it was zeroed."""
        if self._stepping is not None:
            return self._stepping
        moms = sorted({float(g.get("momentum", 0.0)) for g in self.optimizer.param_groups})
        if len(moms) != 1 or not 0.0 <= moms[0] < 1.0:
            raise ValueError(f"topk_ddp/topk_fsdp: recipe='auto' runs SGD's momentum in the hook and needs one momentum in "
                             f"[0, 1) for every parameter group; the groups now hold {moms} (written after setup "
                             "by a scheduler, a callback or add_param_group). Set recipe='none' to keep the "
                             "momentum in the optimizer (plain error feedback)")
        return moms[0]

    def engages(self, state: TopKState) -> bool:
        """Whether the momentum is in the hook from the next step on: engaged, or the last step sent sparse (right
        after a resume: the checkpoint's last step)."""
        return self.engaged or state.last_sent_sparse()

    def begin_step(self, state: TopKState) -> None:
        """Before a backward: engage after a step that sent a bucket sparse; then follow the momentum. The decision
        is taken once per optimizer step, at its first call: before the closure's backward under automatic
        optimization, before ``manual_backward`` under manual optimization (the optimizer step's own call then comes
        after this step's exchange, and must not engage inside it)."""
        if not self.engaged:
            if not self._decided and self.engages(state):
                self.engage(state)
            self._decided = True
            return
        m = self.momentum()
        if m != state.config.momentum:
            state.config = target_config(state.config, m)

    def engage(self, state: TopKState, seed: bool = True) -> None:
        """Move the momentum into the hook: the velocity starts from the optimizer's momentum buffers
        (``seed``; a checkpoint's velocities otherwise), which the optimizer then no longer keeps."""
        bufs: Dict[int, Tensor] = {}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                st = self.optimizer.state.get(p)
                buf = None if st is None else st.pop("momentum_buffer", None)
                if seed and buf is not None:
                    bufs[id(p)] = buf
        state.start_velocity(target_config(self.dormant, self.momentum()), self.seeds(state, bufs))
        self.engaged = True

    def seeds(self, state: TopKState, bufs: Dict[int, Tensor]) -> Dict[str, Tensor]:
        """The velocity's seeds per bound name, from the momentum buffers per ``id`` of their parameter (the
        hook's bound parameters are the optimizer's, as under DDP)."""
        by_id = {i: n for n, i in state.named_bound()}
        return {by_id[i]: b.detach().float() for i, b in bufs.items() if i in by_id}

    def check_hooked(self) -> None:
        """Refuse an engaged step while the optimizer holds a trainable parameter whose gradient does not go through
        the hook (unfrozen or added to the optimizer after DDP built its buckets, e.g. by a fine-tuning callback): it
        would step without momentum (no velocity in the hook, the optimizer's zeroed) while the optimizer shows the
        user's. Checked before the step's backward under automatic optimization, so nothing has stepped yet."""
        if self.hooked is None:
            return
        outside = [self.names.get(id(p), f"a parameter of shape {tuple(p.shape)}")
                   for g in self.optimizer.param_groups for p in g["params"]
                   if p.requires_grad and id(p) not in self.hooked]
        if outside:
            raise ValueError(
                f"topk_ddp: recipe='auto' runs SGD's momentum in the comm hook, which gets only the gradients DDP "
                f"reduces (the parameters that required gradients when DDP was set up); the optimizer also steps "
                f"{len(outside)} parameter(s) outside them, unfrozen or added after setup ({outside[:5]}): they would "
                f"step without momentum while the optimizer shows {self.momentum():g}, and DDP does not average their "
                "gradients either. Unfreeze them before fit, or set recipe='none' to keep the momentum in the "
                "optimizer (as under Lightning's 'ddp')")

    def before_step(self, optimizer: Any) -> Optional[List[Tuple[Dict[str, Any], float, float, List[Any]]]]:
        """Zero the optimizer's momentum and weight decay for its step; weight decay's share of the momentum
        for the parameters, computed from their values before the step. None while dormant."""
        if not self.engaged or optimizer is not self.optimizer:
            return None
        self.check_hooked()
        m = self.momentum()
        saved = []
        for g in optimizer.param_groups:
            wd = float(g.get("weight_decay", 0.0))
            pending = []
            if wd:
                for p in g["params"]:
                    old = optimizer.state[p].get(WD_MOMENTUM)
                    new = p.detach().float().mul(wd)
                    if old is not None:
                        new.add_(old, alpha=m)
                    pending.append((p, new))
            saved.append((g, g["momentum"], g.get("weight_decay", 0.0), pending))
            g["momentum"] = 0.0
            if "weight_decay" in g:
                g["weight_decay"] = 0.0
        self._stepping = m
        return saved

    def after_step(self, optimizer: Any, saved: Optional[List[Any]], committed: bool) -> None:
        """Restore the groups' values; on a committed step, apply and keep weight decay's momentum share
        for the parameters that stepped (those with a gradient, as SGD does)."""
        self._decided = False
        if saved is None:
            return
        self._stepping = None
        for g, mom, wd, pending in saved:
            g["momentum"] = mom
            if "weight_decay" in g:
                g["weight_decay"] = wd
            if not committed:
                continue
            for p, buf in pending:
                if p.grad is None:
                    continue
                with torch.no_grad():
                    p.sub_(buf.to(p.dtype), alpha=float(g["lr"]))
                optimizer.state[p][WD_MOMENTUM] = buf
