"""The concerns of :class:`~lightning_topk.lightning.strategy.TopKStrategyMixin`, one mixin each, Lightning style
(each overrides the strategy hooks of its concern and calls ``super()``): DDP's buckets, ``recipe="auto"``, local
SGD's reducer bypass, checkpoints, and the start and end of a run. They read the strategy's top-k attributes
(``topk_config``, ``topk_state``, ...), set by ``TopKStrategyMixin.__init__``."""
from __future__ import annotations

import inspect
import logging
from typing import Any, Dict, List, Optional

import pytorch_lightning as pl
from torch import Tensor
from typing_extensions import override

from lightning_topk.comm.cost import choose_bucket_cap, constant_model
from lightning_topk.comm.exchanges import registry
from lightning_topk.comm.exchanges.hierarchical import destroy_groups
from lightning_topk.comm.recipe import AdamLiveRecipe, live_recipe
from lightning_topk.comm.wire import packed_nbytes
from lightning_topk.lightning import faults
from lightning_topk.lightning.checkpoint import META_KEY, remove_rank_state, restore_rank_state, save_rank_state
from lightning_topk.lightning.precision import TopKPrecisionMixin

log = logging.getLogger("lightning_topk.lightning.strategy")  # the strategy's log, as before the split


class BucketsMixin:
    """DDP's buckets for the exchange: gradients as views of the buckets, and the bucket cap chosen for overlap with
    the backward pass (:func:`lightning_topk.comm.cost.choose_bucket_cap`)."""

    @override
    def _setup_model(self, model: Any) -> Any:
        if self._mode_refinable():  # mode="auto": the choice again with the optimizers known, before the buckets
            opts = self._topk_optimizers()
            if opts is not None:
                self._refine_mode(opts, adam_recipe=self.topk_config.fault_tolerance != "torchft")
        self._configure_buckets(model)
        return super()._setup_model(model)

    def _keep_bucket_layout(self, kw: Optional[Dict[str, Any]]) -> None:
        """An exchange whose state sits at bucket positions (``scatter``, ``hierarchical``...) needs one layout at every
        step. DDP rebuilds its buckets after a process's first iteration (in gradient-ready order), so a run resumed at
        step k took step k with the initial layout while the straight run took it with the rebuilt one (2.5e-3 to
        7.6e-3 off after 6 steps). With ``find_unused_parameters`` DDP never rebuilds (as under torchft)."""
        ex = self._exchange()
        if kw is not None and ex not in ("auto", "local") and getattr(registry.get(ex), "bucket_layout", False):
            kw["find_unused_parameters"] = True

    def _configure_buckets(self, model: Any) -> None:
        """DDP's buckets for the exchange: the gradients are views of the buckets (no copy per step), and unless the user set ``bucket_cap_mb`` (or ``bucket_cap_mb_list``) or there is one process, let the
        bucket rule (:func:`lightning_topk.comm.cost.choose_bucket_cap`) pick DDP's bucket cap so the exchange
        overlaps the backward pass; the choice is kept in ``topk_bucket_plan`` and logged on rank 0."""
        kw = getattr(self, "_ddp_kwargs", None)
        self._keep_bucket_layout(kw)
        if (kw is not None and self._exchange() == "local" and kw.get("broadcast_buffers") is None
                and kw.get("forward_sync_buffers") is None):
            # DDP would broadcast buffers (BatchNorm statistics) from rank 0 at every forward: a collective
            # across all nodes every inner step. Under local SGD each process keeps its own after the start
            # (torch >= 2.13: forward_sync_buffers=False keeps the initial sync; broadcast_buffers is deprecated).
            kw["forward_sync_buffers" if _ddp_has_forward_sync() else "broadcast_buffers"] = False
        if kw is not None:
            # The gradients are views of DDP's buckets: DDP copies no gradient into its buckets and back every
            # step (local SGD's inner steps on the 11.3M-parameter cluster model cost ~35% more than without
            # DDP with the copies; BENCHMARKS.md). The hooks see the same bucket either way. The user's
            # setting wins.
            if kw.get("gradient_as_bucket_view") is None:
                kw["gradient_as_bucket_view"] = True
        if self._topk_user_cap or kw is None or self.world_size < 2:  # one process: nothing to overlap
            return
        cfg = self.topk_config
        numels = [p.numel() for p in model.parameters() if p.requires_grad][::-1]  # backward order
        if not numels:
            return
        cm = constant_model(self.num_nodes, self.num_processes, self.root_device.type, cfg.auto_link_gbps)
        ex = self._exchange()
        ex = "allgather" if ex == "auto" or (ex in ("hierarchical", "hierarchical_scatter") and cm.intra is None) else ex
        plan = choose_bucket_cap(numels, cfg.density, cm, ex, min_sparse_numel=cfg.min_sparse_numel,
                                 value_bytes=packed_nbytes(1, cfg.wire_dtype) - 4)
        if plan.cap_mb is not None:
            kw["bucket_cap_mb"] = plan.cap_mb
        else:  # DDP's default (a cap the rule set for an earlier model must not stay)
            kw.pop("bucket_cap_mb", None)
        self.topk_bucket_plan = plan
        if self.global_rank == 0:
            log.info("topk_ddp: bucket_cap_mb=%s chosen for overlap with the backward pass (%d buckets, last "
                     "%d entries; set bucket_cap_mb to override)",
                     "DDP's default" if plan.cap_mb is None else plan.cap_mb, len(plan.buckets), plan.last_bucket)


class RecipeMixin:
    """``recipe="auto"``: the user's optimizers made before the hook is built, and the convergence recipe resolved
    for them (:mod:`lightning_topk.comm.recipe`)."""

    def _topk_optimizers(self) -> Optional[List[Any]]:
        """The user's optimizers, for ``recipe="auto"``, before the hook is built: the Trainer's are made
        here, ahead of Lightning's own ``setup_optimizers`` call (which then keeps them)."""
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is None:
            return None
        self.setup_optimizers(trainer)
        self._topk_optimizers_ready = True
        return list(self.optimizers)

    @override
    def setup_optimizers(self, trainer: "pl.Trainer") -> None:
        if getattr(self, "_topk_optimizers_ready", False):  # made (and adjusted) by _resolve_recipe
            self._topk_optimizers_ready = False
            return
        super().setup_optimizers(trainer)

    def _resolve_recipe(self) -> None:
        """``recipe="auto"``: momentum correction for SGD with momentum, as a dormant
        :class:`~lightning_topk.comm.recipe.LiveRecipe` (the exchange is built for it; the optimizer is
        untouched until a step sends sparse); velocities of a checkpoint are dropped when the resolved
        recipe has none."""
        # each fit resolves from the options as given (an earlier fit's resolution is not an option)
        if self.topk_config is getattr(self, "_topk_resolved", None):
            self.topk_config = self._topk_base_config
        self.topk_live_recipe = None
        if self.topk_config.recipe == "auto" and not self.topk_config.momentum_correction:
            opts = self._topk_optimizers()
            if opts is not None:
                dormant = self.topk_config
                self.topk_live_recipe, self.topk_config, self.topk_recipe = live_recipe(
                    dormant, opts, adam=dormant.fault_tolerance != "torchft")  # Adam: not under torchft
                trainer = getattr(self.lightning_module, "_trainer", None)
                if isinstance(self.topk_live_recipe, AdamLiveRecipe) and finetuners(trainer):
                    # a new recipe does not refuse what plain error feedback ran: Adam's stays off there
                    self.topk_live_recipe, self.topk_config = None, dormant
                    self.topk_recipe = (f"recipe=auto -> error_feedback ({', '.join(finetuners(trainer))} unfreezes "
                                        "parameters outside DDP's buckets; Adam's moments stay in the optimizer)")
                elif isinstance(self.topk_live_recipe, AdamLiveRecipe) and isinstance(self.precision_plugin,
                                                                                       TopKPrecisionMixin):
                    # TopKPrecision unscales, checks and steps the optimizer itself (loss scaling, master weights):
                    # the Adam recipe's per-parameter preconditioning and replaced step are not wired into it; it
                    # trained to chance there (tests/lightning/test_precision_ddp.py). Plain error feedback, as before.
                    self.topk_live_recipe, self.topk_config = None, dormant
                    self.topk_recipe = ("recipe=auto -> error_feedback (TopKPrecision steps the optimizer itself; "
                                        "the Adam recipe is not wired into it)")
                if self.topk_live_recipe is not None:
                    self._topk_base_config, self._topk_resolved = dormant, self.topk_config
                    refuse_finetuning(trainer)
                if self.global_rank == 0:
                    log.info("topk_ddp %s", self.topk_recipe)
        pending = self._pending_topk_state
        if pending is not None and pending.get("velocity") and not self.topk_config.momentum_correction:
            pending["velocity"] = {}
            if self.global_rank == 0:
                log.warning("topk_ddp: momentum_correction is off (%s): saved velocities were discarded",
                            self.topk_recipe)


def finetuners(trainer: Any) -> List[str]:
    """The names of the trainer's fine-tuning callbacks (``BaseFinetuning``'s subclasses)."""
    return [type(c).__name__ for c in getattr(trainer, "callbacks", None) or []
            if any(k.__name__ == "BaseFinetuning" for k in type(c).__mro__)]


def refuse_finetuning(trainer: Any) -> None:
    """``recipe="auto"`` with SGD's momentum in the hook and a Lightning fine-tuning callback (``BaseFinetuning``:
    ``BackboneFinetuning``...) that unfreezes parameters after DDP built its buckets: refused at setup, on every rank
    alike (the hook would never see those parameters, which would step without momentum; see
    :meth:`~lightning_topk.comm.recipe.LiveRecipe.check_hooked`)."""
    tuners = finetuners(trainer)
    if tuners:
        raise ValueError(
            f"topk_ddp: recipe='auto' runs SGD's momentum in the comm hook, which gets only the gradients of the "
            f"parameters that required gradients when DDP was set up; {', '.join(tuners)} unfreezes parameters later, "
            "outside DDP's buckets, so they would step without momentum (and, as under Lightning's 'ddp', with "
            "gradients never averaged across ranks). Set recipe='none' to keep SGD's momentum in the optimizer for "
            "every parameter (as under 'ddp'), or unfreeze before fit")


class ReducerBypassMixin:
    """DDP's reducer left out of local SGD's inner steps with one process per node (nothing to reduce)."""

    @property
    def _reducer_off(self) -> bool:
        """Whether this step bypasses DDP's reducer (:attr:`LocalExchange.reducer_off`)."""
        return bool(getattr(self._topk_exchange, "reducer_off", False))

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        # An inner step of local SGD with one process per node has nothing to reduce, so the module runs without
        # DDP's wrapper: DDP's forward arms the reducer (and require_backward_grad_sync, the no_sync switch, is
        # reset to True by Lightning after every manual-optimization step, so a flag set here would leave the
        # reducer armed for some backward passes of a step and not others), and with static_graph it reduces the
        # first iteration whatever that switch says (its _DDPSink queues _delay_all_reduce, which asserts that
        # the reducer was prepared). Nor does Lightning's pre_/post_backward prepare it (below).
        if not self._reducer_off:
            return super().training_step(*args, **kwargs)
        with self.precision_plugin.train_step_context():
            return self.lightning_module.training_step(*args, **kwargs)

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        if not self._reducer_off:  # manual optimization + static_graph: DDP's first-iteration reduction
            super().post_backward(closure_loss)


class CheckpointMixin:
    """Each rank's top-k state in checkpoints (logic in :mod:`lightning_topk.lightning.checkpoint`)."""

    @override
    def save_checkpoint(self, checkpoint: Dict[str, Any], filepath, storage_options: Optional[Any] = None) -> None:
        # Called on every rank: each writes its own shard, then rank 0 writes the main file.
        ex = self._topk_exchange
        if ex is not None and hasattr(ex, "inner_optimizer_states"):
            # local SGD: each replica's inner optimizer state is its own (Lightning's file holds rank 0's)
            ex.inner_optimizer_states = checkpoint.get("optimizer_states")
        save_rank_state(self, checkpoint, filepath)
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        # DDP restores before setup/configure_ddp, so _register_ddp_hooks applies this pending state.
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        meta = checkpoint.get(META_KEY)
        self._keep_saved_mode(meta.get("config") if isinstance(meta, dict) else None)  # mode="auto": the saved one
        self._pending_topk_state = restore_rank_state(self, checkpoint_path, checkpoint)
        section = ((self._pending_topk_state or {}).get("exchanges") or {}).get("local") or {}
        if self.topk_config.local_steps > 0 and section.get("inner_optimizer_states") is not None:
            checkpoint["optimizer_states"] = section["inner_optimizer_states"]  # this replica's own
        return checkpoint

    @override
    def remove_checkpoint(self, filepath) -> None:
        super().remove_checkpoint(filepath)
        remove_rank_state(self, filepath)


class RunEventsMixin:
    """Start and end of a run: the heartbeat and fault checks (:mod:`lightning_topk.lightning.faults`), the
    exchange's start/end of training, and closing the exchange's collectives and process groups."""

    @override
    def setup_distributed(self) -> None:
        faults.check_before_setup(self)  # fail before any process group or collective exists
        super().setup_distributed()
        faults.stop(self._topk_heartbeat)
        self._topk_heartbeat = faults.start(self)
        self._decide_mode(self.lightning_module)  # mode="auto" (lightning_topk.lightning.mode)

    def _exchange_event(self, name: str) -> None:
        """Call the exchange's ``name`` hook, if it has one (local SGD's streaming: ``start_training``,
        ``end_training``)."""
        hook = getattr(self._topk_exchange, name, None)
        if hook is not None:
            hook()

    @override
    def on_train_start(self) -> None:
        # local SGD with streaming: a second fit in this process goes on from the state before on_train_end
        self._exchange_event("start_training")
        parent = getattr(super(), "on_train_start", None)
        if parent is not None:
            parent()

    @override
    def on_train_end(self) -> None:
        # local SGD with streaming: the last round's exchange is applied, on every rank, before fit returns
        # (Fabric has no such hook: call fabric.strategy.on_train_end() after the loop)
        self._exchange_event("end_training")
        parent = getattr(super(), "on_train_end", None)
        if parent is not None:
            parent()

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._topk_failed = True
        super().on_exception(exception)
        faults.explain_exception(self._topk_heartbeat, exception)

    @override
    def teardown(self) -> None:
        self._topk_close()
        faults.stop(self._topk_heartbeat)  # joined before the process group goes away
        self._topk_heartbeat = None
        super().teardown()

    def _topk_close(self) -> None:
        """End of a run, on every rank: wait for the collectives the exchanges still have in flight, then destroy
        the intra-/inter-node groups this strategy made (each fit makes its own). After an exception neither
        happens (a peer may be gone or stuck, so a wait could hang): the process is failing anyway."""
        state, failed, self._topk_failed = self.topk_state, self._topk_failed, False
        if state is None or failed:
            return
        state.finish_in_flight()
        destroy_groups(state.groups)


def _ddp_has_forward_sync() -> bool:
    from torch.nn.parallel import DistributedDataParallel

    return "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
