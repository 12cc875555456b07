"""``mode="auto"`` at setup: the inter-node link and a step's compute, measured (or from the constants), agreed on
by every rank, then :func:`lightning_topk.comm.mode.choose_mode`'s choice applied to the strategy's options.

Every rank computes the same choice: the measured figures are all-reduced first (the slowest link, the slowest
compute), and the rest is a pure function of the options, the layout and the parameter count. Under
``auto_model="constants"`` (``"auto"`` under ``Trainer(deterministic=True)``) nothing is timed: the link is
``auto_link_gbps`` and the compute comes from :data:`~lightning_topk.comm.cost.CONSTANTS`, so the choice is the
same in every run.

A run that resumes goes on in the mode its checkpoint was saved in (:meth:`ModeMixin._keep_saved_mode`): a preempted
job restarted on other machines, or a link that measures otherwise at the restart, would otherwise switch between
per-step top-k and local SGD and drop the state of the mode it ran.
"""
from __future__ import annotations

import ipaddress
import logging
import os
import socket
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from lightning_topk.comm import cost
from lightning_topk.comm.config import TopKConfig
from lightning_topk.comm.exchanges.auto import candidates_for
from lightning_topk.comm.mode import (
    ADAM_LOCAL_MAX_GBPS,
    ADAM_MODE_PENALTY,
    LOCAL_CANDIDATES,
    LOCAL_MAX_GBPS,
    ModeChoice,
    buckets_of,
    choose_mode,
    estimate_compute,
    warmup_seconds,
)
from lightning_topk.comm.recipe import adam_recipe_for, adam_schedule
from lightning_topk.comm.wire import packed_nbytes
from lightning_topk.lightning import support_cell

log = logging.getLogger("lightning_topk.lightning.strategy")  # the strategy's log

#: This rank's (inter-node link in Gbit/s, seconds per entry of a dense pass); a collective (every rank calls it).
Measure = Callable[[torch.device], Tuple[float, float]]


def on_loopback() -> bool:
    """Whether the rendezvous address (``MASTER_ADDR``) is a loopback address: every rank on one host."""
    addr = os.environ.get("MASTER_ADDR")
    if not addr:
        return False
    try:
        return ipaddress.ip_address(socket.gethostbyname(addr)).is_loopback
    except (OSError, ValueError):
        return False


def measure(device: torch.device) -> Tuple[float, float]:
    """This rank's timed figures: all-reduces of two sizes over the world (:func:`~lightning_topk.comm.cost.measure_link`)
    and one dense pass (:func:`~lightning_topk.comm.cost.measure_pass`)."""
    link = cost.measure_link(device)
    return link.beta * 8 / 1e9, cost.measure_pass(device)


def agree(link_gbps: float, pass_per_elem: float, device: torch.device) -> Tuple[float, float]:
    """The slowest link and the slowest pass over every rank (one all-reduce): the same figures everywhere."""
    t = torch.tensor([-link_gbps, pass_per_elem], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return -float(t[0]), float(t[1])


def _explicit(config: TopKConfig, why: str) -> ModeChoice:
    if config.local_steps > 0:
        opts = dict(local_steps=config.local_steps, outer_density=config.outer_density,
                    outer_value_bits=config.outer_value_bits)
        return ModeChoice("local", None, opts, reason=why)
    return ModeChoice("per_step", reason=why)


@dataclass(frozen=True)
class Figures:
    """What a link-based choice is made from, the same on every rank: the link (Gbit/s), a dense pass (seconds per
    entry), a step's compute (seconds) and where they came from (words)."""

    link_gbps: float
    pass_per_elem: float
    compute_s: float
    source: str


def decide(config: TopKConfig, nodes: int, local: int, numel: int, device: torch.device, *,
           measure_fn: Measure = measure, loopback: Optional[bool] = None) -> ModeChoice:
    """The mode for these options on ``nodes`` x ``local`` processes and ``numel`` trainable parameters (see the
    module docstring; ``loopback`` None: :func:`on_loopback`). Collective only where it measures."""
    return decide_with_figures(config, nodes, local, numel, device, measure_fn=measure_fn, loopback=loopback)[0]


def decide_with_figures(config: TopKConfig, nodes: int, local: int, numel: int, device: torch.device, *,
                        measure_fn: Measure = measure, loopback: Optional[bool] = None
                        ) -> Tuple[ModeChoice, Optional[Figures]]:
    """:func:`decide`, and the figures where the link decided (None where nothing was chosen from it)."""
    given = config.mode_options_set()
    if config.mode == "per_step":
        return _explicit(config, "set by mode='per_step'"), None
    if config.mode == "auto" and given:
        return _explicit(config, f"mode options set ({', '.join(given)}): they run as given"), None
    if config.local_steps > 0:  # mode="local" with local_steps
        return _explicit(config, f"set by mode='local', local_steps={config.local_steps}"), None
    only_local = config.mode == "local"
    if nodes < 2 and not only_local:
        return ModeChoice("per_step", reason="one node: nothing to choose (no inter-node link)"), None
    if numel < 1:
        return ModeChoice("per_step", reason="no trainable parameters at setup: nothing to choose"), None
    if not only_local and (on_loopback() if loopback is None else loopback):
        return ModeChoice("per_step", reason=f"every rank on one host (MASTER_ADDR {os.environ.get('MASTER_ADDR')} "
                                             "is loopback): no slow link between nodes"), None
    if nodes < 2:  # mode="local" on one node: the outer round is the identity (docs/local_sgd.md)
        name = "topk_local"
        return ModeChoice("local", name, dict(LOCAL_CANDIDATES[name]), reason="mode='local' on one node"), None
    if cost.timed_model(config):
        link_gbps, pass_per_elem = agree(*measure_fn(device), device)
        source = "measured at setup"
    else:
        link_gbps = config.auto_link_gbps
        pass_per_elem = cost.CONSTANTS.get(device.type, cost.CONSTANTS["cpu"])["pass_per_elem"]
        source = "auto_link_gbps and the constants (no timing)"
    if config.auto_step_ms is not None:
        compute, source = config.auto_step_ms / 1e3, f"link {source}, compute per step auto_step_ms={config.auto_step_ms:g}"
    else:
        compute, source = estimate_compute(numel, pass_per_elem), f"link and compute {source}"
    figures = Figures(link_gbps, pass_per_elem, compute, source)
    return choose(config, nodes, local, numel, device.type, figures), figures


def is_adam(optimizers: Sequence[Any]) -> bool:
    """Whether the (first) optimizer is torch's Adam or AdamW."""
    return bool(optimizers) and type(optimizers[0]) in (torch.optim.Adam, torch.optim.AdamW)


def choose(config: TopKConfig, nodes: int, local: int, numel: int, device_type: str, figures: Figures,
           optimizers: Optional[Sequence[Any]] = None, adam_recipe: bool = False,
           horizon: Optional[int] = None) -> ModeChoice:
    """:func:`~lightning_topk.comm.mode.choose_mode` on ``figures`` (a pure function). With the ``optimizers``
    known: Adam/AdamW takes :data:`~lightning_topk.comm.mode.ADAM_MODE_PENALTY`, and where ``adam_recipe`` (the
    strategy's per-step mode would run the AdamW recipe: ``recipe="auto"``, ``topk_ddp``) the per-step mode pays the
    recipe's dense steps and density warm-up once, spread over ``horizon`` steps (the run's ``max_steps``)."""
    model = replace(cost.constant_model(nodes, local, device_type, figures.link_gbps),
                    pass_per_elem=figures.pass_per_elem)
    hier = nodes > 1 and local > 1 and config.hierarchical is not False
    kw: Dict[str, Any] = dict(density=config.density, candidates=candidates_for(config, nodes, local, hier),
                              value_bytes=packed_nbytes(1, config.wire_dtype) - 4,
                              sparse_penalty=config.sparse_penalty, min_sparse_numel=config.min_sparse_numel)
    penalties, fixed, note, bound = None, 0.0, "", LOCAL_MAX_GBPS
    if optimizers is not None and is_adam(optimizers):
        name = type(optimizers[0]).__name__
        penalties, note, bound = ADAM_MODE_PENALTY, f"; {name}'s penalties (measured on the frontier LM)", ADAM_LOCAL_MAX_GBPS
        if adam_recipe and config.recipe == "auto" and adam_recipe_for(config, optimizers)[0]:
            sched = adam_schedule(config)
            fixed = warmup_seconds(model, buckets_of(numel), **kw, dense_steps=sched.dense_steps,
                                   warmup_steps=sched.warmup_steps)
            note += (f"; per step, the {name} recipe's dense steps and density warm-up: {fixed:.1f} s once, "
                     + (f"over {horizon} steps (max_steps)" if horizon else "not counted (no max_steps)"))
    choice = choose_mode(model, numel, figures.compute_s, **kw,
                         allowed=("local",) if config.mode == "local" else ("per_step", "local"),
                         penalties=penalties, per_step_fixed_s=fixed, horizon=horizon, note=note,
                         local_max_gbps=bound)
    return replace(choice, reason=f"{choice.reason}; {figures.source}")


def saved_mode(saved_config: Any) -> Optional[Dict[str, Any]]:
    """The mode options a checkpoint's top-k config (a dict) ran with: ``{"local_steps": 0}`` per step, else local
    SGD's ``local_steps``, ``outer_density`` and ``outer_value_bits``; None where it has none."""
    if not isinstance(saved_config, dict) or "local_steps" not in saved_config:
        return None
    steps = int(saved_config.get("local_steps") or 0)
    if steps <= 0:
        return {"local_steps": 0}
    return {"local_steps": steps, "outer_density": float(saved_config["outer_density"]),
            "outer_value_bits": int(saved_config["outer_value_bits"])}


def kept_choice(choice: ModeChoice, saved: Dict[str, Any]) -> ModeChoice:
    """The checkpoint's mode (:func:`saved_mode`), in place of ``choice``, the one this setup's figures made."""
    now = choice.mode if choice.preset is None else f"{choice.mode} ({choice.preset})"
    why = f"kept from the checkpoint it resumes (this setup would choose {now}: {choice.reason})"
    if saved["local_steps"] <= 0:
        return ModeChoice("per_step", None, {}, choice.scores, why, choice.inputs)
    preset = next((n for n, o in LOCAL_CANDIDATES.items() if all(saved[k] == o[k] for k in o)), None)
    return ModeChoice("local", preset, dict(saved), choice.scores, why, choice.inputs)


def resolve(config: TopKConfig, choice: ModeChoice) -> TopKConfig:
    """``config`` with the chosen local SGD settings (the options the user set keep their values)."""
    if choice.mode != "local" or config.local_steps > 0:
        return config
    given = set(config.mode_options_set())
    updates: Dict[str, Any] = {k: (int(v) if k in ("local_steps", "outer_value_bits") else v)
                               for k, v in choice.options.items() if k not in given}
    return replace(config, **updates)


class ModeMixin:
    """``mode="auto"``: :meth:`_decide_mode` runs at setup, after the process group exists and before anything reads
    the mode (``topk_ddp``: in ``setup_distributed``, before checkpoints, buckets and hooks; ``topk_fsdp``: first in
    ``setup``, after ``configure_model``); the choice is ``topk_mode``, the options ``topk_config``. Once the
    optimizers exist (before the buckets and hooks), :meth:`_refine_mode` chooses again from the same figures with
    the optimizer's penalties; a resumed run keeps its checkpoint's mode (:meth:`_keep_saved_mode`)."""

    topk_mode: Optional[ModeChoice] = None
    topk_config: TopKConfig
    _topk_mode_figures: Optional[Figures] = None

    def _decide_mode(self, module: Any) -> None:
        base = getattr(self, "_topk_mode_base", None)
        derived = (getattr(self, "_topk_mode_resolved", None), getattr(self, "_topk_resolved", None))
        if base is None or not any(self.topk_config is c for c in derived):
            base = self._topk_mode_base = self.topk_config  # each fit decides from the options as given
        params = module.parameters() if module is not None else ()
        numel = sum(p.numel() for p in params if p.requires_grad)
        choice, self._topk_mode_figures = decide_with_figures(base, self.num_nodes, self.num_processes,  # type: ignore[attr-defined]
                                                              numel, self.root_device)  # type: ignore[attr-defined]
        self._topk_mode_numel = numel
        self._apply_mode(base, choice, "info")

    def _apply_mode(self, base: TopKConfig, choice: ModeChoice, level: str) -> None:
        self.topk_mode = choice
        self.topk_config = self._topk_mode_resolved = resolve(base, choice)
        if self.topk_config is not base:
            support_cell.check(self)  # the cell of the mode that runs
        if self.global_rank == 0:  # type: ignore[attr-defined]
            getattr(log, level)("%s: %s", getattr(self, "strategy_name", "topk_ddp"), choice.describe())

    def _mode_refinable(self) -> bool:
        """Whether :meth:`_refine_mode` would choose again: the link chose at this setup, no checkpoint's mode was
        kept, no torchft replica (its checks ran on the first choice)."""
        return self._topk_mode_figures is not None and getattr(self, "topk_elastic", None) is None

    def _refine_mode(self, optimizers: Sequence[Any], adam_recipe: bool) -> None:
        """The choice again, from the figures of this setup, with the ``optimizers`` known (a pure function: the same
        on every rank): Adam/AdamW's penalties and, per step, its recipe's fixed cost (:func:`choose`) over the
        run's ``max_steps``. Before anything reads the mode but the checkpoint load."""
        if not self._mode_refinable():
            return
        figures, self._topk_mode_figures = self._topk_mode_figures, None
        base = self._topk_mode_base
        trainer = getattr(self.lightning_module, "_trainer", None)  # type: ignore[attr-defined]
        steps = getattr(trainer, "max_steps", -1)
        horizon = int(steps) if isinstance(steps, int) and steps > 0 else None
        assert figures is not None
        choice = choose(base, self.num_nodes, self.num_processes, self._topk_mode_numel,  # type: ignore[attr-defined]
                        self.root_device.type, figures, optimizers, adam_recipe, horizon)  # type: ignore[attr-defined]
        if choice != self.topk_mode:
            self._apply_mode(base, choice, "info")

    def _keep_saved_mode(self, saved_config: Any) -> None:
        """Resuming under ``mode="auto"`` with no mode option set: the mode (and local SGD settings) of the checkpoint's
        top-k config (``saved_config``, the same on every rank) replaces the one chosen at this setup where they
        differ. Runs before the checkpoint's top-k state is restored."""
        choice, base = self.topk_mode, getattr(self, "_topk_mode_base", None)
        saved = saved_mode(saved_config)
        if choice is None or base is None or saved is None or base.mode != "auto" or base.mode_options_set():
            return
        self._topk_mode_figures = None  # the saved mode stands: no second choice
        if all(getattr(self.topk_config, k) == v for k, v in saved.items()):
            return
        self._apply_mode(base, kept_choice(choice, saved), "warning")
