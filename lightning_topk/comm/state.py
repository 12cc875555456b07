"""Per-rank state of the top-k exchange (:class:`TopKState`): the options, the residual and velocity
buffers (:class:`~lightning_topk.comm.residuals.ParamBuffers`), the step counter, the exchanges built for it,
per-step fault flags and undo copies (:mod:`~lightning_topk.comm.faults`), telemetry
(:mod:`~lightning_topk.comm.telemetry`) and its checkpoint format.

The options are :class:`~lightning_topk.comm.config.TopKConfig`; the names below that moved to the modules
of their concern are re-exported here for code that imports them from this module.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor

import lightning_topk.comm.elastic as elastic
from lightning_topk.comm.config import (  # noqa: F401  (re-exported)
    AUTO_MODEL_CHOICES,
    HIERARCHICAL_EXCHANGES,
    NONFINITE_CHOICES,
    OUTER_BITS,
    OUTER_EXCHANGES,
    OUTER_RECIPES,
    RECIPE_CHOICES,
    SCOPE_CHOICES,
    TopKConfig,
)
from lightning_topk.comm.exchanges import registry
from lightning_topk.comm.exchanges.base import Layout
from lightning_topk.comm.faults import BucketBuffers, FaultFlags, UndoLog, bounds_nonfinite, nonfinite, owner_undo_key  # noqa: F401
from lightning_topk.comm.residuals import ParamBuffers
from lightning_topk.comm.selection import ThresholdHint
from lightning_topk.comm.telemetry import StepStats, bucket_counters, clock  # noqa: F401  (re-exported)

Scale = Union[float, Tensor]


@dataclass
class DebugRecord:
    """Test/debug aid (``enabled=True``): what this rank sent and the gradient it got, per parameter,
    in unscaled units. Costs copies and host syncs; off by default."""

    enabled: bool = False
    sent: Dict[str, Tensor] = field(default_factory=dict)
    grads_in: Dict[str, Tensor] = field(default_factory=dict)


class TopKState(ParamBuffers):
    """Explicit state object passed to the top-k comm hooks (as torch's PowerSGDState is).

    Args:
        config: the options.
        process_group: group of the flat exchange (default: the world).
        hier: the process groups of a nodes x local layout (:func:`~lightning_topk.comm.exchanges.hierarchical.make_groups`),
            for the exchanges that need them (hierarchical ones).
        num_nodes: nodes of the job (telemetry: which link the flat exchange's bytes cross).

    Exchange-specific state (process groups in use, collectives in flight, owner residuals, ``auto``'s
    plan) lives in the exchange objects (:mod:`lightning_topk.comm.exchanges`): ``exchange`` is the one
    the comm hook drives, ``exchanges`` every one built for this state by name (``auto``'s children too),
    each made on first use by :meth:`exchange_for`. Their checkpoint sections are saved under
    ``state_dict()["exchanges"]``.
    """
    def __init__(self, config: TopKConfig, process_group: Any = None, hier: Any = None,
                 num_nodes: int = 1) -> None:
        super().__init__()
        self.config = config
        self.schedule = config.schedule
        self.process_group = process_group
        self.groups: Any = hier
        self.num_nodes = num_nodes
        self.exchange: Any = None
        self.exchanges: Dict[str, Any] = {}
        self._sections: Dict[str, Dict[str, Any]] = {}  # loaded sections waiting for their exchange
        self.step = 0
        # Loss scale of the current backward: a float, or the scaler's scale as a device tensor (no host read).
        self.grad_scale: Scale = 1.0
        self.flags = FaultFlags()
        self.undo = UndoLog()
        self.debug = DebugRecord()
        self.current = StepStats()
        self.last = StepStats()
        self.loaded_sparse = False  # a loaded checkpoint's last_sent_sparse(), until this state's first step ends
        self.bucket_sizes: List[int] = []  # entries of each bucket of the last complete step, in launch order
        self._step_sizes: List[int] = []
        self.totals = StepStats()
        # Selection thresholds reused between steps (a speed hint; results do not depend on it, so it is
        # never saved or rolled back), by what was selected from: see kit.select.
        self.select_hints: Dict[Tuple[str, ...], ThresholdHint] = {}
        # Whether each parameter of the bucket in the hook has a gradient on some rank that shares this result
        # (set per bucket by exchanges.elastic_exchange_hook; None: this rank's own ``.grad``, kit.unused_spans).
        self.bucket_used: Optional[List[bool]] = None
        # recipe="auto" with Adam(W) (:class:`~lightning_topk.comm.recipe.AdamLiveRecipe`): this rank's second moment of
        # its local gradient per parameter name (the frozen variance's floor); saved per rank as the section "recipe"
        self.recipe_state: Dict[str, Tensor] = {}
        self.recipe_lr: Optional[float] = None  # the lr of the last step it saw (its warm-up follows a rising lr)

    @property
    def flat_group(self) -> Any:
        """The flat exchange's process group: ``process_group``, or the world by default."""
        return self.process_group if self.process_group is not None else dist.group.WORLD
    def threshold_hint(self, key: Tuple[str, ...]) -> ThresholdHint:
        """The selection threshold hint kept under ``key`` (made on first use)."""
        h = self.select_hints.get(key)
        if h is None:
            h = self.select_hints[key] = ThresholdHint()
        return h

    def undo_keys(self) -> List[str]:
        """The undo log's keys of tensors the exchanges still keep (see :meth:`UndoLog.commit`)."""
        return [k for ex in self.exchanges.values() for k in ex.undo_keys()]

    # ---- exchanges ----------------------------------------------------------------------------
    def layout(self) -> Any:
        """The :class:`~lightning_topk.comm.exchanges.base.Layout` of this state's group (the groups' when
        given, else one node of the whole group, or ``num_nodes`` nodes of it)."""
        g = self.groups
        if g is not None:
            return Layout(g.num_nodes, g.local_world, g.node_rank * g.local_world + g.local_rank)
        group = self.flat_group
        if elastic.is_elastic(group):
            world, rank = group.size(), group.rank()
        else:
            world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
            rank = dist.get_rank(group) if world > 1 else 0
        nodes = self.num_nodes if self.num_nodes > 0 and world % self.num_nodes == 0 else 1
        return Layout(nodes, world // nodes, rank)

    def exchange_for(self, name: str, layout: Any = None, **kwargs: Any) -> Any:
        """The exchange ``name`` of this state, built from the registry on first use (``kwargs``: what it
        needs, e.g. ``groups``), with its loaded checkpoint section applied."""
        ex = self.exchanges.get(name)
        if ex is None:
            kwargs.setdefault("groups", self.groups)
            ex = registry.get(name)(self, layout if layout is not None else self.layout(), **kwargs)
            self.exchanges[name] = ex
            ex.load_state_dict(self._sections.pop(name, None))
        return ex

    def take_section(self, name: str) -> Optional[Dict[str, Any]]:
        """The loaded checkpoint section of exchange ``name`` (removed: its exchange now holds it)."""
        return self._sections.pop(name, None)

    def release_orphans(self) -> None:
        """Loaded sections of exchanges this run does not use: each exchange class decides what to keep
        (the scale-free ones fold their owner residuals into the rank residuals). Call once the exchange
        is built and the state loaded."""
        for name in [n for n in self._sections if n not in self.exchanges and n in registry.choices()]:
            registry.get(name).orphan(self, self._sections.pop(name))

    @property
    def in_flight(self) -> bool:
        """Whether any exchange of this state has a collective launched and not waited for yet."""
        return any(ex.in_flight for ex in self.exchanges.values())

    def finish_in_flight(self) -> None:
        """Wait for every collective the exchanges still have in flight (a streamed outer round keeps its result
        as pending, as before a checkpoint; a pipelined bucket completes its future). Call on every rank when
        training ends: a collective left in flight at interpreter exit, with a Python callback on its future,
        aborts the process ("terminate called without an active exception")."""
        for ex in list(self.exchanges.values()):
            ex.flush(self)
    # ---- step bookkeeping -------------------------------------------------------------------
    def density_now(self) -> float:
        return self.schedule.density_at(self.step)

    def note_bucket(self, n: int) -> None:
        """A bucket of ``n`` entries is being exchanged (see :attr:`bucket_sizes`)."""
        self._step_sizes.append(n)

    def end_exchange(self) -> None:
        """Called when the last bucket of a backward pass has been launched."""
        self.bucket_sizes, self._step_sizes = self._step_sizes, []
        self.last = self.current
        self.step += 1
        self.current = StepStats(step=self.step)
        self.totals.resolve(ready_only=True)

    def last_sent_sparse(self) -> bool:
        """Whether the last complete step sent a bucket sparse (``recipe="auto"`` engages after one); before the first
        step after a load, what the checkpoint says (:attr:`loaded_sparse`)."""
        return self.last.numel_sent < self.last.numel if self.last.numel else self.loaded_sparse

    def add_stats(self, stats: StepStats, via: Optional[str] = None, /, **kw: int) -> None:
        """Add the counters ``kw`` to ``stats`` and the totals; ``via``: one bucket moved by that exchange."""
        for k, v in kw.items():
            setattr(stats, k, getattr(stats, k) + v)
            setattr(self.totals, k, getattr(self.totals, k) + v)
        if via is not None:
            for s in (stats, self.totals):
                s.buckets_by[via] = s.buckets_by.get(via, 0) + 1

    def add_time(self, stats: StepStats, name: str, start: Any) -> None:
        """Add the time since ``start`` (from :func:`clock`) to ``stats.<name>`` and the totals."""
        if isinstance(start, float):
            dt = time.perf_counter() - start
            setattr(stats, name, getattr(stats, name) + dt)
            setattr(self.totals, name, getattr(self.totals, name) + dt)
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        stats._events.append((name, start, end))
        self.totals._events.append((name, start, end))

    # ---- checkpointing ----------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """This rank's compression state; residuals keyed by parameter name, on CPU."""
        pending = self._pending_load or {}
        out: Dict[str, Any] = {"version": STATE_VERSION, "step": self.step, "config": asdict(self.config),
                               "last_sparse": self.last_sent_sparse()}
        for kind, live in (("residual", self.residuals()), ("velocity", self.velocities())):
            d = {n: t.clone() for (k, n), t in pending.items() if k == kind}
            d.update({n: t.detach().cpu().clone() for n, t in live.items()})
            out[kind] = d
        sections = {n: dict(sd) for n, sd in self._sections.items()}
        sections.update({n: ex.state_dict() for n, ex in self.exchanges.items()})
        if self.recipe_state or self.recipe_lr is not None:
            sections[RECIPE_SECTION] = {"local_exp_avg_sq": {n: t.detach().cpu().clone() for n, t in self.recipe_state.items()},
                                        "last_lr": self.recipe_lr, "dense_steps": self.schedule.dense_steps}
        out["exchanges"] = {n: sd for n, sd in sections.items() if sd}
        return out

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Restore a state from :meth:`state_dict` (this version's or version 1's); residuals are applied as
        buckets appear, exchange sections as their exchanges exist (see :meth:`exchange_for`)."""
        self.step = int(sd["step"])
        self.loaded_sparse = bool(sd.get("last_sparse", False))
        pending: Dict[Tuple[str, str], Tensor] = {}
        for kind in ("residual", "velocity"):
            for name, t in dict(sd.get(kind, {})).items():
                pending[(kind, name)] = t
        self._buckets.clear()
        self._owner.clear()
        self.undo.clear()
        self.undo.step = self.step  # a skip right after the load goes back to the loaded step
        self._pending_load = pending
        sections = upgrade_sections(sd)
        recipe = sections.pop(RECIPE_SECTION, {})
        self.recipe_state = dict(recipe.get("local_exp_avg_sq", {}))
        self.recipe_lr = recipe.get("last_lr")
        if int(recipe.get("dense_steps", 0)) > self.schedule.dense_steps:  # a warm-up the recipe extended
            self.schedule = replace(self.schedule, dense_steps=int(recipe["dense_steps"]))
        for name, ex in self.exchanges.items():
            ex.load_state_dict(sections.pop(name, None))
        self._sections = sections


STATE_VERSION = 2
RECIPE_SECTION = "recipe"  # a per-rank section that no exchange owns: recipe="auto"'s per-rank tensors (Adam's local v)


def upgrade_sections(sd: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """The per-exchange sections of a state dict. Version 1 kept owner residuals at the top level (keys
    with a ``shard<l>of<L>/`` part are the hierarchical scale-free exchange's) and ``auto``'s plan as
    ``auto`` or (older) a per-rank ``plan`` keyed by bucket and k, which no longer applies."""
    sections = {n: dict(v) for n, v in dict(sd.get("exchanges", {}) or {}).items()}
    owner = dict(sd.get("owner_residual", {}) or {})
    if owner:
        for key, t in owner.items():
            name = "hierarchical_scatter" if "/shard" in key else "scatter"
            sections.setdefault(name, {}).setdefault("owner_residual", {})[key] = t
    if sd.get("auto"):
        sections.setdefault("auto", dict(sd["auto"]))
    return sections
