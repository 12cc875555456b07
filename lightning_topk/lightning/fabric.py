"""``Fabric(strategy="topk_ddp")``: the top-k exchange for Lightning Fabric (``lightning.fabric`` and the
standalone ``lightning_fabric``, which keep separate registries and DDPStrategy classes).

The Trainer strategy's logic is reused, not copied: the class mixes in
:class:`~lightning_topk.lightning.strategy.TopKStrategyMixin` (options, hook registration, hierarchical
layout, non-finite handling, telemetry properties) and adapts the few places where Fabric differs:

* Fabric wraps the model in ``setup_module``; the comm hook is registered right after, on every device
  (Lightning registers DDP comm hooks only on CUDA).
* ``optimizer.step()`` reaches :meth:`optimizer_step`: a non-finite exchanged gradient raises or skips the
  step on every rank (``nonfinite``), as with the Trainer.
* ``fabric.save(path, state)`` writes only on rank 0; every rank also writes its residual shard next to it
  (:mod:`lightning_topk.lightning.checkpoint`), and ``fabric.load`` restores each rank's own shard.
* ``strategy.topk_metrics()`` returns the ``topk/*`` metrics reduced over the ranks for ``fabric.log_dict``.
* ``fault_tolerance="torchft"`` (:mod:`lightning_topk.lightning.elastic`): no hook runs before the user's forward,
  so each step's quorum (and a heal) runs at the end of the previous ``optimizer_step``, the first one at the end
  of ``setup_module_and_optimizers`` (local SGD: a quorum per round, the join round at that setup); the loop
  takes its data position from :attr:`topk_elastic_position`.

``from lightning_topk.lightning.fabric import FabricTopKDDPStrategy`` gives the class for ``lightning.fabric``
(or, without the ``lightning`` package, for ``lightning_fabric``); :func:`fabric_strategy_class` picks one.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from lightning_topk.comm.controller import Decision
from lightning_topk.lightning.checkpoint import META_KEY, restore_rank_state, save_rank_state
from lightning_topk.lightning.strategy import TopKStrategyMixin, _drop_grads, _poison_for_scaler, _scaler_of, ddp_super
from lightning_topk.lightning.telemetry import reduced_metrics

FABRIC_PACKAGES = ("lightning.fabric", "lightning_fabric")


class FabricElasticMixin:
    """Fabric's side of ``fault_tolerance="torchft"``, shared by ``topk_ddp`` and ``topk_fsdp``: what a heal carries
    (the one optimizer and the scheduler Fabric set up), the first quorum once they are set up, the next step's quorum
    at the end of each ``optimizer.step()``, and the loop's position."""

    topk_elastic: Any = None
    # torchft: the optimizers and scheduler of fabric.setup (what a heal carries, with the module)
    _topk_fabric_setup: Tuple[List[Any], List[Any]] = ([], [])

    @property
    def optimizers(self) -> List[Any]:
        return self._topk_fabric_setup[0]

    def _elastic_schedulers(self) -> List[Any]:
        return self._topk_fabric_setup[1]

    @property
    def topk_elastic_position(self) -> int:
        """Under torchft, the optimizer step the loop's next batch belongs to, the same on every replica group of
        the quorum (a heal makes it the peers'): torchft's committed steps, or under local SGD the inner-step
        attempts (a rolled-back round's count too: its batches are dropped, as the Trainer drops them)."""
        ft = self.topk_elastic
        if ft is None:
            raise ValueError(f"{self.strategy_name}: topk_elastic_position needs fault_tolerance='torchft' and "  # type: ignore[attr-defined]
                             "fabric.setup first")
        outer = self._elastic_outer()  # type: ignore[attr-defined]
        return ft.step if outer is None else int(outer.steps)

    def _elastic_check_optimizers(self, n: int) -> None:
        if self.topk_elastic is not None and n != 1:  # each optimizer.step() is one torchft step
            raise ValueError(f"{self.strategy_name}: fault_tolerance='torchft' with Fabric takes one optimizer (each "  # type: ignore[attr-defined]
                             f"optimizer.step() commits one torchft step), got {n} (docs/elastic.md)")

    def _elastic_fabric_setup(self, optimizers: List[Any], scheduler: Any) -> None:
        """The model and its optimizer are set up: the first quorum, before the loop's first forward (a replica
        group that is behind heals here; local SGD: and takes part in the peers' round, the join round)."""
        if self.topk_elastic is None:
            return
        self._topk_fabric_setup = (list(optimizers), [] if scheduler is None else [scheduler])
        self._elastic_join()  # type: ignore[attr-defined]
        if self._elastic_outer() is None:  # type: ignore[attr-defined]
            self._elastic_step_quorum()  # type: ignore[attr-defined]

    def _elastic_after_step(self) -> None:
        """The end of ``optimizer.step()``: the next step's quorum (Fabric has no hook before the user's forward); a
        heal lands here, between this step and the loop's next forward, and :attr:`topk_elastic_position` is then
        the peers'. Local SGD: none (a quorum per round, inside the round)."""
        if self.topk_elastic is not None and self._elastic_outer() is None:  # type: ignore[attr-defined]
            self._elastic_step_quorum()  # type: ignore[attr-defined]


class _FabricTopKMixin(FabricElasticMixin, TopKStrategyMixin):
    """Fabric adapter over :class:`TopKStrategyMixin` (see the module docstring)."""

    _topk_module = None
    _topk_ddp = None

    # TopKStrategyMixin reads the module and the DDP wrapper under the Trainer strategy's names.
    @property
    def lightning_module(self):
        return self._topk_module

    @property
    def model(self):
        return self._topk_ddp

    def _setup_distributed(self) -> None:
        # fault_tolerance="torchft": the replica is made (and the lighthouse checked) before the process group, and
        # joins torchft right after it, as the Trainer strategy's setup_distributed does
        self._elastic_prepare()
        super()._setup_distributed()
        self._elastic_start()

    # optimizer_step / save_checkpoint / load_checkpoint: TopKStrategyMixin's versions have the Trainer's
    # signatures, so these call Fabric's DDPStrategy (the class after the mixin) directly.
    def setup_module_and_optimizers(self, module, optimizers, scheduler=None):
        self._elastic_check_optimizers(len(optimizers))
        # recipe="auto" reads the optimizers when setup_module builds the hook
        self._topk_fabric_optimizers = list(optimizers)
        try:
            out = super().setup_module_and_optimizers(module, optimizers, scheduler)
        finally:
            self._topk_fabric_optimizers = None
        self._elastic_fabric_setup(out[1], out[2])
        return out

    def _topk_optimizers(self):
        return getattr(self, "_topk_fabric_optimizers", None)

    def setup_module(self, module):
        if self.topk_elastic is not None and self._topk_optimizers() is None:
            raise ValueError("topk_ddp: fault_tolerance='torchft' with Fabric needs the model and its optimizers set "
                             "up together, fabric.setup(model, optimizer[, scheduler=...]) (a heal carries the "
                             "optimizer state), not fabric.setup_module(model) (docs/elastic.md)")
        self._configure_buckets(module)
        ddp = super().setup_module(module)
        self._topk_module, self._topk_ddp = module, ddp
        self._register_ddp_hooks()
        self._sync_reducer()
        return ddp

    def _sync_reducer(self) -> None:
        """Local SGD, one process per node: DDP's reducer off for the inner steps (Fabric's no_sync restores this
        value), on during the synchronous first ``dense_steps``. The user's loop calls DDP's forward, so unlike the
        Trainer's strategy (which leaves DDP out of an inner step) this does not cover ``static_graph=True``."""
        ex = self._topk_exchange
        if getattr(ex, "bypass", False) and self._topk_ddp is not None:
            self._topk_ddp.require_backward_grad_sync = not ex.reducer_off

    def backward(self, tensor, module, *args: Any, **kwargs: Any) -> None:
        ctl = self.topk_controller
        if ctl is not None:  # the live loss scale, as a device tensor (no host sync); see the mixin's pre_backward
            scaler = _scaler_of(self.precision)
            scale = 1.0 if scaler is None else scaler.scale(torch.ones((), device=tensor.device))
            ctl.begin_step(grad_scale=scale, scaler=scaler is not None)
            if self.topk_live_recipe is not None and self.topk_state is not None:
                self.topk_live_recipe.begin_step(self.topk_state)
        super().backward(tensor, module, *args, **kwargs)

    def optimizer_step(self, optimizer, **kwargs: Any) -> Any:
        ctl = self.topk_controller
        fabric_step = ddp_super(self).optimizer_step
        skip = ctl is not None and ctl.finish_step(self._topk_module.named_parameters()) is Decision.SKIP
        if skip:
            if _scaler_of(self.precision) is not None:
                _poison_for_scaler(optimizer)  # the scaler skips and backs off on every rank alike
            else:
                _drop_grads(self._topk_module, optimizer)
        live = self.topk_live_recipe
        saved = live.before_step(optimizer) if live is not None else None
        try:
            out = fabric_step(optimizer, **kwargs)
        finally:
            if live is not None:
                live.after_step(optimizer, saved, committed=not skip)
        if ctl is not None and self.topk_state is not None:  # local SGD counts attempts (skipped ones too)
            self.topk_state.exchange.after_optimizer_step(self._topk_module.named_parameters())
            self._sync_reducer()
        self._elastic_after_step()
        return out

    def topk_metrics(self) -> Dict[str, float]:
        """``topk/*`` of the last exchange, reduced over all ranks (a collective: call on every rank)."""
        return reduced_metrics(self.topk_stats, self)

    def reduce(self, tensor, group=None, reduce_op="mean"):
        return self.all_reduce(tensor, group=group, reduce_op=reduce_op)

    def save_checkpoint(self, path, state: Dict[str, Any], storage_options: Optional[Any] = None,
                        filter: Optional[Dict[str, Callable[[str, Any], bool]]] = None) -> None:
        # A fabric.save is a resume point; step/epoch keys, when the user keeps them, go into the save key.
        info = {"optimizer_states": True, "epoch": _int(state.get("epoch")),
                "global_step": _int(state.get("global_step", state.get("step")))}
        save_rank_state(self, info, path)
        if META_KEY in info:
            state = {**state, META_KEY: info[META_KEY]}
        ddp_super(self).save_checkpoint(path, state, storage_options=storage_options, filter=filter)

    def load_checkpoint(self, path, state=None, strict: bool = True, weights_only: Optional[bool] = None):
        out = ddp_super(self).load_checkpoint(path, state=state, strict=strict, weights_only=weights_only)
        if self._topk_module is None or not isinstance(out, dict):
            return out  # nothing set up yet to restore into (fabric.load before fabric.setup)
        meta = out.pop(META_KEY, None) if state else out.get(META_KEY)
        pending = restore_rank_state(self, path, {META_KEY: meta} if meta is not None else {})
        if pending is not None:
            if self.topk_state is not None:
                self._load_topk_state(self.topk_state, pending)
            else:
                self._pending_topk_state = pending
        return out


def _int(v: Any) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return -1


@functools.lru_cache(maxsize=None)
def fabric_strategy_class(package: str) -> type:
    """``TopKDDPStrategy`` for the Fabric package ``package`` (``lightning.fabric`` or ``lightning_fabric``)."""
    if package not in FABRIC_PACKAGES:
        raise ValueError(f"fabric_strategy_class: package must be one of {FABRIC_PACKAGES}, got {package!r}")
    import importlib

    base = importlib.import_module(f"{package}.strategies").DDPStrategy
    cls = type("TopKDDPStrategy", (_FabricTopKMixin, base), {
        "__doc__": f"DDP strategy for ``{package}.Fabric`` whose gradient exchange is a top-k sparse allgather "
                   "with error feedback; options as :class:`lightning_topk.TopKDDPStrategy`.",
        "__module__": __name__,
        "strategy_name": "topk_ddp",
    })
    return cls


def __getattr__(name: str):
    if name == "FabricTopKDDPStrategy":  # lightning.fabric's class, else the standalone lightning_fabric's
        import importlib.util

        return fabric_strategy_class(FABRIC_PACKAGES[0] if importlib.util.find_spec("lightning") else FABRIC_PACKAGES[1])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
