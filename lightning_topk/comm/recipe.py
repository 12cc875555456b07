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
* ``torch.optim.AdamW``, or ``Adam`` without L2 weight decay (no amsgrad, no maximize, one (betas, eps) for all
  groups), under ``topk_ddp`` (:func:`live_recipe` with ``adam=True``; not under ``fault_tolerance="torchft"``): 1-bit
  Adam's frozen variance with a local floor and the momentum in the hook with lookahead ``beta1``
  (:class:`AdamLiveRecipe`; MNIST-5k at density 0.01: 0.95x dense AdamW's steps to 90%, 1.00x under warm-up +
  cosine; the frontier LM 0.89x to loss 3.0 at a constant lr). ``dense_steps`` 0 becomes :data:`ADAM_DENSE_STEPS`
  (20), extended while the lr rises step to step: those steps are the user's AdamW, bit for bit DDP, and its
  ``exp_avg_sq`` of the averaged gradient is the variance frozen when the recipe engages (the step after the first
  sparse one). ``warmup_steps`` 0 becomes :data:`ADAM_WARMUP_STEPS` (100): DGC's density warm-up after them.
  ``topk_fsdp``: plain error feedback, the optimizer untouched.
* With ``local_steps`` > 0 (sparse local SGD) there is no per-step top-k: nothing, the optimizer untouched.
* Anything else (the repo's LARS, whose trust ratio is taken on the raw gradient, Nesterov, dampening, several
  optimizers, Adam under ``topk_fsdp``): plain error feedback, the optimizer untouched.

Layer 1: torch only; the optimizer is duck-typed by its class and ``param_groups``.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor

from lightning_topk.comm.config import RECIPE_CHOICES, TopKConfig
from lightning_topk.comm.exchanges import registry
from lightning_topk.comm.state import TopKState

__all__ = ["RECIPE_CHOICES", "AdamLiveRecipe", "LiveRecipe", "adam_recipe_for", "apply_recipe", "live_recipe", "recipe_for", "unresolved_note", "WD_MOMENTUM"]

WD_MOMENTUM = "topk_wd_momentum"  # the optimizer-state key of weight decay's share of SGD's momentum
ADAM_DENSE_STEPS = 20  # recipe="auto" with Adam(W): dense_steps where it is 0 (the frozen variance's warm-up T)
# recipe="auto" with Adam(W): warmup_steps where it is 0, DGC's density warm-up (25% down to the density, geometric)
# after the dense steps. Measured (docs/convergence.md, "The variance decays as AdamW's, and the density warm-up"): on the frontier LM at a constant lr
# the sparse steps right after the dense ones fell behind for good (seeds 0 and 3: 1.50x dense's steps to loss 3.0),
# and 100 warm-up steps took them to 1.21x and 0.86x.
ADAM_WARMUP_STEPS = 100
FROZEN_STEP = "topk_frozen_step"  # the optimizer-state key of Adam's step count when its exp_avg_sq froze

# recipe="auto" sets momentum_lookahead to the optimizer's momentum m: the residual then accumulates
# u = v + m (v - v_prev) = g + m v, PyTorch's Nesterov update, and every entry sent each step would be exactly
# SGD(nesterov=True). Measured (docs/convergence.md, BENCHMARKS.md; MNIST-5k, seeds 0-4, steps to 80%/90% as a
# multiple of dense SGD with momentum's): c = 0.9 1.10x/1.09x at density 0.01 and 1.76x/1.66x at 0.001, and it
# trained at 8x the preset learning rate; c = 3 was faster (1.04x/0.96x, 1.59x/1.59x) but diverged there, where
# heavy-ball dense and the lookahead-free recipe still train.


def _flat_only(config: TopKConfig, optimizers: Sequence[Any]) -> Optional[str]:
    """Why no recipe applies whatever the optimizer (None: one may)."""
    if config.recipe != "auto":
        return "recipe='none'"
    if config.momentum_correction:
        return "momentum_correction is already on"
    if getattr(config, "local_steps", 0) > 0:
        return "local_steps > 0 (sparse local SGD): the inner optimizer keeps its momentum"
    if config.density >= 1.0:
        return "density 1 sends dense: the optimizer keeps its momentum"
    if config.exchange != "auto" and not getattr(registry.get(config.exchange), "momentum_correction", False):
        return f"exchange={config.exchange!r} does not support momentum correction"
    if config.hierarchical is True:
        return "the hierarchical exchange does not support momentum correction"
    if len(optimizers) != 1:
        return f"{len(optimizers)} optimizers (momentum correction needs one)"
    return None


def recipe_for(config: TopKConfig, optimizers: Sequence[Any]) -> Tuple[bool, str]:
    """(whether ``recipe="auto"`` turns momentum correction on for these optimizers, why)."""
    why = _flat_only(config, optimizers)
    if why is not None:
        return False, why
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


def adam_recipe_for(config: TopKConfig, optimizers: Sequence[Any]) -> Tuple[bool, str]:
    """(whether ``recipe="auto"`` runs Adam's moments in the hook (:class:`AdamLiveRecipe`), why)."""
    why = _flat_only(config, optimizers)
    if why is not None:
        return False, why
    opt = optimizers[0]
    if type(opt) not in (torch.optim.AdamW, torch.optim.Adam):
        return False, f"{type(opt).__name__} is not torch.optim.AdamW or Adam"
    groups = opt.param_groups
    if any(g.get("amsgrad") or g.get("maximize") or g.get("differentiable") for g in groups):
        return False, "Adam with amsgrad, maximize or differentiable"
    if type(opt) is torch.optim.Adam and any(g.get("weight_decay", 0.0) and not g.get("decoupled_weight_decay")
                                             for g in groups):
        return False, "Adam with L2 weight decay (it enters the moments; use AdamW)"
    if len({_hyper(g) for g in groups}) != 1:
        return False, "Adam groups with different betas or eps"
    return True, f"{type(opt).__name__} betas {_hyper(groups[0])[:2]} moved into the hook"


def _hyper(group: Dict[str, Any]) -> Tuple[float, float, float]:
    b = group["betas"]
    return float(b[0]), float(b[1]), float(group["eps"])


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


def adam_schedule(config: TopKConfig) -> TopKConfig:
    """``config`` with the AdamW recipe's schedule: ``dense_steps`` 0 becomes :data:`ADAM_DENSE_STEPS`, ``warmup_steps``
    0 :data:`ADAM_WARMUP_STEPS` (values the user set are kept)."""
    return replace(config, dense_steps=config.dense_steps or ADAM_DENSE_STEPS,
                   warmup_steps=config.warmup_steps or ADAM_WARMUP_STEPS)


def live_recipe(config: TopKConfig, optimizers: Sequence[Any], make: Optional[Any] = None, adam: bool = False
                ) -> Tuple[Optional["LiveRecipe"], TopKConfig, str]:
    """``recipe="auto"`` in a run (``topk_ddp`` and ``topk_fsdp`` alike): (the dormant :class:`LiveRecipe`, or None;
    the config to build the exchange for, :func:`target_config` where it applies; the decision in words).
    ``make``: the :class:`LiveRecipe` class to build (a subclass seeds the velocity of sharded parameters).
    ``adam``: Adam/AdamW may take :class:`AdamLiveRecipe` (``topk_ddp``'s flat exchanges only)."""
    use, why = recipe_for(config, optimizers)
    if not use and adam:
        use_adam, why_adam = adam_recipe_for(config, optimizers)
        if use_adam:
            dormant = adam_schedule(config)
            live: LiveRecipe = AdamLiveRecipe(optimizers[0], dormant)
            b1 = live.momentum()
            return live, target_config(dormant, b1), (
                f"recipe=auto -> Adam in the hook, frozen variance after {dormant.dense_steps} dense steps, density "
                f"warm-up over {dormant.warmup_steps} steps, "
                f"momentum_lookahead {b1:g}, from the step after the first one that sends sparse ({why_adam}; "
                f"density {config.density:g})")
        why = why_adam if why.endswith("is not torch.optim.SGD (plain error feedback measured best)") else why
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

    what = "SGD's momentum"  # what moves into the hook (messages)

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
                f"topk_ddp: recipe='auto' runs {self.what} in the comm hook, which gets only the gradients DDP "
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


_NO_STEP = object()  # the optimizer had no instance attribute ``step`` before the engaged step replaced it


def _count(st: Dict[str, Any]) -> float:
    """Adam's step count in an optimizer state (a tensor or a number; 0 when it never stepped)."""
    t = st.get("step", 0.0)
    return float(t.item() if isinstance(t, Tensor) else t)


class AdamLiveRecipe(LiveRecipe):
    """``recipe="auto"`` on the user's live Adam/AdamW: 1-bit Adam's frozen variance with a local floor, and the
    momentum in the hook with a lookahead (``docs/convergence.md``, "AdamW recipe (issue 42)").

    Dormant, the optimizer is the user's Adam: the ``dense_steps`` warm-up (:data:`ADAM_DENSE_STEPS` where 0) is
    DDP with AdamW bit for bit, and its ``exp_avg_sq`` of the averaged gradient becomes the frozen variance ``vf``.
    From the step after the first sparse one, each rank's gradient is preconditioned before DDP's reducer sees it
    (a hook on each parameter): ``g' = (1 - b1) g / den``, ``den = max(sqrt(b2^(t-T) vf / (1 - b2^t)),
    sqrt(v_i / ((1 - b2^t) W))) + eps``: the first term is AdamW's own bias-corrected variance at step t had no
    gradient entered it after T (frozen at T's value instead, it stayed up to sqrt(t / T) too large while AdamW's
    fell: 2.6x at step 140 on the frontier LM), ``v_i`` this rank's own second moment (kept per rank in
    :attr:`TopKState.recipe_state`, checkpointed, rolled back by a skipped step). Momentum correction with momentum
    and lookahead ``b1`` then keeps ``m_i / den`` as the velocity (seeded with AdamW's ``exp_avg / den``; the residual
    is rescaled to update units), and the optimizer's ``step`` is replaced *during* each step by AdamW's decoupled
    step on the averaged update: ``p *= 1 - lr wd; p -= lr / (1 - b1^t) * grad``. The groups (lr, betas, eps,
    weight decay) stay the user's and are read every step; the state keeps ``step``, the frozen ``exp_avg_sq`` and
    :data:`FROZEN_STEP` (``exp_avg`` moves into the hook)."""

    what = "Adam's momentum and variance"

    def __init__(self, optimizer: Any, dormant: TopKConfig, hooks: bool = True) -> None:
        super().__init__(optimizer, dormant)
        self.hooks = hooks  # precondition through parameter hooks (a simulator calls precondition itself)
        self.world: Optional[int] = None
        self._state: Optional[TopKState] = None
        self._staged: List[Tuple[TopKState, str, Tensor]] = []  # (state, name, v_i) of this step, kept on commit
        self._seeds: Optional[Dict[int, Tensor]] = None
        self._frozen: Dict[int, Tuple[Any, Tensor]] = {}  # id(p) -> (its inputs, sqrt(vf)): fixed while engaged

    def begin_step(self, state: TopKState) -> None:
        """Dormant: extend the dense warm-up by this step while the lr rises (a per-step LR warm-up; measured: the
        variance frozen during it damps the steps after it); then :meth:`LiveRecipe.begin_step`."""
        if not self.engaged:
            lr = max(float(g["lr"]) for g in self.optimizer.param_groups)
            prev, state.recipe_lr = state.recipe_lr, lr
            if (prev is not None and lr > prev and not state.last_sent_sparse()
                    and state.step >= state.schedule.dense_steps):
                state.schedule = replace(state.schedule, dense_steps=state.step + 1)
        super().begin_step(state)

    def hyper(self) -> Tuple[float, float, float]:
        """(b1, b2, eps) of every group now (a scheduler may cycle b1)."""
        vals = sorted({_hyper(g) for g in self.optimizer.param_groups})
        if len(vals) != 1 or not (0.0 <= vals[0][0] < 1.0 and 0.0 <= vals[0][1] < 1.0):
            raise ValueError(f"topk_ddp: recipe='auto' runs Adam's moments in the hook and needs one (beta1, beta2, eps) "
                             f"with betas in [0, 1) for every parameter group; the groups now hold {vals} (written "
                             "after setup by a scheduler, a callback or add_param_group). Set recipe='none' to keep "
                             "Adam's moments in the optimizer (plain error feedback)")
        return vals[0]

    def momentum(self) -> float:
        return self.hyper()[0]

    def _frozen_den(self, st: Dict[str, Any], b2: float) -> Optional[Tensor]:
        vf = st.get("exp_avg_sq")
        if vf is None:
            return None
        t = float(st.get(FROZEN_STEP, _count(st)))
        return (vf.float() / (1.0 - b2 ** max(t, 1.0))).sqrt_()

    def engage(self, state: TopKState, seed: bool = True) -> None:
        """Freeze the variance and move the momentum into the hook: the velocity starts from ``exp_avg / den`` and
        the residual is divided by ``den`` (``seed``; a checkpoint's velocity, residual and ``v_i`` otherwise)."""
        b1, b2, eps = self.hyper()
        by_id = {i: n for n, i in state.named_bound()}
        seeds: Dict[str, Tensor] = {}
        if seed:
            if self._seeds is None:  # once per engagement (a simulator engages each rank's state)
                self._seeds = {}
                for g in self.optimizer.param_groups:
                    for p in g["params"]:
                        st = self.optimizer.state.get(p)
                        if st and "exp_avg" in st:
                            st.setdefault(FROZEN_STEP, _count(st))
                            self._seeds[id(p)] = st.pop("exp_avg")
            residuals = state.residuals()
            for g in self.optimizer.param_groups:
                for p in g["params"]:
                    name, st = by_id.get(id(p)), self.optimizer.state.get(p) or {}
                    den = self._frozen_den(st, b2)
                    if name is None or den is None:
                        continue
                    den = den.add_(eps).reshape(-1)
                    if id(p) in self._seeds:
                        seeds[name] = self._seeds[id(p)].float().reshape(-1) / den
                    state.recipe_state[name] = st["exp_avg_sq"].detach().float().clone()
                    if name in residuals:
                        residuals[name].div_(den.to(residuals[name].device))
        if self.world is None:
            self.world = state.layout().world
        state.start_velocity(target_config(self.dormant, b1), seeds)
        self._frozen.clear()
        self.engaged = True
        self._state = state
        if self.hooks:
            self.attach(state)

    def attach(self, state: TopKState) -> None:
        """A hook on each trainable parameter the state knows: the preconditioned gradient replaces the raw one before
        DDP's reducer reads it (a hook of an earlier recipe on the same parameter is removed)."""
        params = {id(p): p for g in self.optimizer.param_groups for p in g["params"]}
        for name, i in state.named_bound():
            p = params.get(i)
            if p is None or not p.requires_grad:
                continue
            old = getattr(p, "_topk_adam_hook", None)
            if old is not None:
                old.remove()

            def hook(grad: Tensor, p: Tensor = p, name: str = name) -> Optional[Tensor]:
                if not self.engaged or self._state is None:
                    return None
                return self.precondition(self._state, name, p, grad)

            p._topk_adam_hook = p.register_hook(hook)

    def _frozen_for(self, p: Tensor, st: Dict[str, Any], device: torch.device) -> Optional[Tuple[Tensor, float]]:
        """(``sqrt(vf)`` of ``p``, the freeze step T), computed once per engagement (its inputs do not change while
        engaged; a new ``exp_avg_sq`` tensor or freeze step computes it again)."""
        vf = st.get("exp_avg_sq")
        if vf is None:
            return None
        frozen_at = float(st.get(FROZEN_STEP, _count(st)))
        key = (id(vf), frozen_at, device)
        hit = self._frozen.get(id(p))
        if hit is None or hit[0] != key:
            hit = self._frozen[id(p)] = (key, vf.detach().float().sqrt().to(device))
        return hit[1], frozen_at

    def precondition(self, state: TopKState, name: str, p: Tensor, grad: Tensor) -> Tensor:
        """``(1 - b1) grad / den`` for this rank (in the gradient's units and dtype); stages its new ``v_i``."""
        b1, b2, eps = self.hyper()
        st = self.optimizer.state.get(p) or {}
        t = _count(st) + 1.0
        g = grad.detach().float()
        scale = state.grad_scale
        gs = g / scale if isinstance(scale, Tensor) or scale != 1.0 else g
        v = state.recipe_state.get(name)
        if v is None:
            v = st["exp_avg_sq"].float() if "exp_avg_sq" in st else torch.zeros_like(g)
        v = v.to(g.device).mul(b2).addcmul_(gs, gs, value=1.0 - b2)
        self._staged.append((state, name, v))
        den = (v / ((1.0 - b2 ** t) * (self.world or 1))).sqrt_()
        frozen = self._frozen_for(p, st, den.device)
        if frozen is not None:
            # AdamW's bias-corrected variance had no gradient entered it after T: b2^(t-T) vf / (1 - b2^t)
            root_vf, frozen_at = frozen
            decay = math.sqrt(b2 ** max(t - frozen_at, 0.0) / (1.0 - b2 ** t))
            den = torch.maximum(den.div_(decay), root_vf).mul_(decay)  # one new tensor on this per-step path
        return g.mul_((1.0 - b1) / den.add_(eps)).to(grad.dtype)

    def before_step(self, optimizer: Any) -> Optional[List[Any]]:
        """Replace the optimizer's ``step`` by :meth:`_step` for this step (None while dormant)."""
        if not self.engaged or optimizer is not self.optimizer:
            return None
        self.check_hooked()
        self._stepping = self.momentum()
        prev = optimizer.__dict__.get("step", _NO_STEP)  # an LR scheduler's wrapper, kept
        optimizer.step = self._step
        return [prev]

    def _step(self, closure: Any = None) -> Any:
        """AdamW's decoupled step on the averaged update in ``grad`` (see the class docstring)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        opt = self.optimizer
        opt._opt_called = True  # what an LR scheduler's step wrapper records
        b1 = self.momentum()
        decoupled = type(opt) is torch.optim.AdamW
        with torch.no_grad():
            for g in opt.param_groups:
                lr, wd = float(g["lr"]), float(g.get("weight_decay", 0.0))
                for p in g["params"]:
                    if p.grad is None:
                        continue
                    st = opt.state[p]
                    t = _count(st) + 1.0
                    if wd and (decoupled or g.get("decoupled_weight_decay")):
                        p.mul_(1.0 - lr * wd)
                    p.add_(p.grad.to(p.dtype), alpha=-lr / (1.0 - b1 ** t))
                    st["step"] = torch.tensor(t, dtype=torch.float32)
        return loss

    def after_step(self, optimizer: Any, saved: Optional[List[Any]], committed: bool) -> None:
        """Give the optimizer its ``step`` back; keep this step's ``v_i`` if it committed."""
        self._decided = False
        if saved is None:
            return
        self._stepping = None
        if saved[0] is _NO_STEP:
            optimizer.__dict__.pop("step", None)
        else:
            optimizer.step = saved[0]
        self._seeds = None
        staged, self._staged = self._staged, []
        if committed:
            for state, name, v in staged:
                state.recipe_state[name] = v
