"""Lightning glue: ``TopKDDPStrategy`` = Lightning's DDPStrategy + the top-k comm hook on every device.

The logic lives in :class:`TopKStrategyMixin` so the same code serves ``pytorch_lightning`` and
``lightning.pytorch`` (two packages with separate base classes and registries).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Optional

import pytorch_lightning as pl
import torch

from lightning_topk.comm.state import StepStats, TopKConfig, TopKState

log = logging.getLogger(__name__)


class TopKStrategyMixin:
    """Adds the top-k exchange to a DDPStrategy subclass. See :class:`TopKConfig` for the options."""

    def __init__(
        self,
        density: float = 0.01,
        selector: str = "exact",
        value_dtype: str = "fp32",
        error_feedback: bool = True,
        momentum_correction: bool = False,
        momentum: float = 0.9,
        dense_steps: int = 1,
        warmup_steps: int = 0,
        warmup_start: float = 0.25,
        min_sparse_numel: int = 16384,
        hierarchical: Any = "auto",
        nonfinite: str = "raise",
        selection_scope: str = "bucket",
        exchange: str = "auto",
        log_telemetry: bool = True,
        **kwargs: Any,
    ) -> None:
        for bad in ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper"):
            if kwargs.get(bad) is not None:
                raise ValueError(f"topk_ddp: {bad} cannot be set; the strategy registers its own top-k comm hook")
        self.topk_config = TopKConfig(
            density=density, selector=selector, value_dtype=value_dtype, error_feedback=error_feedback,
            momentum_correction=momentum_correction, momentum=momentum, dense_steps=dense_steps,
            warmup_steps=warmup_steps, warmup_start=warmup_start, min_sparse_numel=min_sparse_numel,
            hierarchical=hierarchical, nonfinite=nonfinite, selection_scope=selection_scope, exchange=exchange,
        )
        if not isinstance(log_telemetry, bool):
            raise ValueError(f"topk_ddp: log_telemetry must be true or false, got {log_telemetry!r}")
        self.log_telemetry = log_telemetry
        self.topk_state: Optional[TopKState] = None
        self._pending_topk_state: Optional[Dict[str, Any]] = None
        super().__init__(**kwargs)

    def _configure_launcher(self) -> None:
        # Lightning checks a SLURM allocation against devices/num_nodes only in the popen launcher;
        # check it for every start method, before any process starts or waits in a collective.
        env = self.cluster_environment
        if env is not None and hasattr(env, "validate_settings"):
            env.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        super()._configure_launcher()

    # ---- hook registration --------------------------------------------------------------------
    def _register_ddp_hooks(self) -> None:
        # Lightning registers comm hooks only on CUDA; ours must run on CPU/gloo too.
        state = TopKState(self.topk_config)
        state.bind(self.lightning_module.named_parameters())
        state.num_nodes = self.num_nodes
        hook = self._exchange_hook(state)
        if self.topk_config.nonfinite == "skip":
            state.snapshot_residuals = True
        if self.topk_state is not None and self._pending_topk_state is None:
            self._pending_topk_state = self.topk_state.state_dict()
        if self._pending_topk_state is not None:
            state.load_state_dict(self._pending_topk_state)
            self._pending_topk_state = None
        from lightning_topk.comm.scatter import fold_pending_owner

        if self._exchange() not in ("auto", "scatter"):
            fold_pending_owner(state)  # owner residuals of a scale-free run resumed with another exchange
        self.model.register_comm_hook(state, hook)
        self.topk_state = state

    def _exchange(self) -> str:
        """The exchange after the precedence of the older ``hierarchical`` option (see TopKConfig)."""
        return "hierarchical" if self._use_hierarchical() else self.topk_config.exchange

    def _exchange_hook(self, state: TopKState) -> Callable:
        """The comm hook for the chosen exchange; ``auto`` probes links and selection first (collective)."""
        from lightning_topk.comm import cost, hierarchical
        from lightning_topk.comm.allgather import topk_allgather_hook
        from lightning_topk.comm.scatter import scatter_topk_hook

        ex = self._exchange()
        if ex == "hierarchical":
            state.hier = hierarchical.build_groups(self)
            return hierarchical.hierarchical_topk_hook
        if ex == "dense":
            return cost.dense_topk_hook
        if ex == "scatter":
            return scatter_topk_hook
        if ex == "allgather" or self.world_size < 2:
            return topk_allgather_hook
        cfg, nodes, local = self.topk_config, self.num_nodes, self.num_processes
        groups = None
        if nodes > 1 and local > 1:
            hier_ok = cfg.hierarchical is not False and not cfg.momentum_correction and cfg.selection_scope == "bucket"
            groups = hierarchical.build_groups(self) if hier_ok else hierarchical.make_groups(
                nodes, local, self.global_rank, timeout=getattr(self, "_timeout", None))
            state.hier = groups
        model = cost.probe(nodes, local, self.global_rank, cfg.density, cfg.selector, self.root_device,
                           None if groups is None else groups.intra, None if groups is None else groups.inter)
        state.auto = cost.AutoExchange(model, cost.candidates_for(cfg, nodes, local, groups is not None),
                                       self.global_rank)
        return cost.auto_topk_hook

    def _use_hierarchical(self) -> bool:
        """Whether every bucket takes the hierarchical exchange (``hierarchical=True`` or
        ``exchange='hierarchical'``); with ``exchange='auto'`` the cost model may still pick it per bucket."""
        cfg = self.topk_config
        pinned = cfg.hierarchical is True or cfg.exchange == "hierarchical"
        if pinned and self.num_processes < 2:
            raise ValueError(
                "topk_ddp: hierarchical=True / exchange='hierarchical' needs more than one process per node "
                f"(devices={self.num_processes}); use exchange='auto' or 'scatter' (and hierarchical='auto')"
            )
        return pinned

    # ---- telemetry ----------------------------------------------------------------------------
    @property
    def topk_stats(self) -> StepStats:
        """Telemetry of the last completed exchange on this rank (bytes, density, times)."""
        return self.topk_state.last if self.topk_state is not None else StepStats()

    @property
    def topk_totals(self) -> StepStats:
        """Telemetry summed over all exchanges since the state was created."""
        return self.topk_state.totals if self.topk_state is not None else StepStats()

    # ---- step: non-finite handling and logging ------------------------------------------------
    def optimizer_step(self, optimizer, closure: Callable[[], Any], model=None, **kwargs: Any) -> Any:
        state = self.topk_state
        if state is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        if _has_grad_scaler(self.precision_plugin):
            # The scaler makes the skip decision (and the precision plugin rolls residuals back).
            out = super().optimizer_step(optimizer, closure, model, **kwargs)
            state.nonfinite_seen = False
            self._log_topk()
            return out

        def checked_closure():
            out = closure()
            # The hooks flag a non-finite exchanged result on every rank alike: no pass over the grads here.
            if state.nonfinite_params or state.nonfinite_seen:
                self._handle_nonfinite(optimizer, state)
            return out

        out = super().optimizer_step(optimizer, checked_closure, model, **kwargs)
        state.commit_step()
        self._log_topk()
        return out

    def _handle_nonfinite(self, optimizer, state: TopKState) -> None:
        names = _nonfinite_param_names(self.lightning_module, optimizer) or list(state.nonfinite_params)
        local = list(state.nonfinite_params)
        state.nonfinite_params.clear()
        state.nonfinite_seen = False
        mode = self.topk_config.nonfinite
        if mode == "raise":
            where = f"; non-finite before the exchange on rank {self.global_rank} in {local}" if local else ""
            raise FloatingPointError(
                f"topk_ddp: non-finite gradient after the exchange in parameter(s) {names[:8]}{where}. "
                "Set strategy nonfinite='skip' to skip such steps on all ranks, or use fp16 loss scaling."
            )
        if mode == "skip":
            trainer = getattr(self.lightning_module, "_trainer", None)
            step = trainer.global_step if trainer is not None else state.step - 1
            log.warning("topk_ddp: skipping optimizer step %d on all ranks: non-finite gradient in %s",
                        step, names[:8])
            state.rollback_step()
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None

    def _log_topk(self) -> None:
        trainer = getattr(self.lightning_module, "_trainer", None) if self.lightning_module is not None else None
        if not self.log_telemetry or trainer is None or not trainer.loggers or self.topk_state is None:
            return
        if trainer.global_step % max(1, trainer.log_every_n_steps) != 0:
            return
        metrics = self.topk_state.last.as_metrics()
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)


    # ---- checkpoints and faults (logic in lightning_topk.lightning.checkpoint / lightning_topk.lightning.faults) ------
    def setup_distributed(self) -> None:
        from lightning_topk.lightning import faults

        faults.check_before_setup(self)  # fail before any process group or collective exists
        super().setup_distributed()
        faults.start(self)

    def save_checkpoint(self, checkpoint: Dict[str, Any], filepath, storage_options: Optional[Any] = None) -> None:
        # Called on every rank: each writes its own shard, then rank 0 writes the main file.
        from lightning_topk.lightning.checkpoint import save_rank_state

        save_rank_state(self, checkpoint, filepath)
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        # DDP restores before setup/configure_ddp, so _register_ddp_hooks applies this pending state.
        from lightning_topk.lightning.checkpoint import restore_rank_state

        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._pending_topk_state = restore_rank_state(self, checkpoint_path, checkpoint)
        return checkpoint

    def remove_checkpoint(self, filepath) -> None:
        from lightning_topk.lightning.checkpoint import remove_rank_state

        super().remove_checkpoint(filepath)
        remove_rank_state(self, filepath)

    def on_exception(self, exception: BaseException) -> None:
        from lightning_topk.lightning import faults

        super().on_exception(exception)
        faults.explain_exception(self, exception)

    def teardown(self) -> None:
        from lightning_topk.lightning import faults

        faults.stop(self)
        super().teardown()


def _has_grad_scaler(plugin) -> bool:
    return getattr(plugin, "scaler", None) is not None


def _nonfinite_param_names(module, optimizer) -> list:
    names = {id(p): n for n, p in module.named_parameters()} if module is not None else {}
    out = []
    for g in optimizer.param_groups:
        for p in g["params"]:
            if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
                out.append(names.get(id(p), "<unnamed>"))
    return out


class TopKDDPStrategy(TopKStrategyMixin, pl.strategies.DDPStrategy):
    """DDP strategy whose gradient exchange is a top-k sparse allgather with error feedback.

    ``TopKDDPStrategy(density=0.001, selector="mstopk", bucket_cap_mb=25, ...)``: the top-k options
    are listed in :class:`~lightning_topk.comm.state.TopKConfig`; every other keyword (e.g.
    ``find_unused_parameters``, ``static_graph``, ``bucket_cap_mb``, ``gradient_as_bucket_view``,
    ``start_method``, ``timeout``) goes to Lightning's ``DDPStrategy`` and torch's DDP.
    """

    strategy_name = "topk_ddp"
