"""Lightning glue: ``TopKDDPStrategy`` = Lightning's DDPStrategy + the top-k comm hook on every device.

The logic lives in :class:`TopKStrategyMixin` so the same code serves ``pytorch_lightning`` and
``lightning.pytorch`` (two packages with separate base classes and registries). Gradient faults are
decided once per step by the comm layer's :class:`~lightning_topk.comm.controller.StepController`; this
module only tells it the loss scale and applies its decision to the optimizer step.
"""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Callable, Dict, Optional, Set

import pytorch_lightning as pl
import torch
from torch import Tensor
from typing_extensions import override

from lightning_topk.comm.config import TopKConfig
from lightning_topk.comm.controller import Decision, StepController
from lightning_topk.comm.exchanges import Layout, elastic_exchange_hook, exchange_hook, registry
from lightning_topk.comm.exchanges.auto import build_auto
from lightning_topk.comm.exchanges.hierarchical import build_groups, make_groups
from lightning_topk.comm.recipe import unresolved_note
from lightning_topk.comm.state import TopKState
from lightning_topk.lightning.elastic import ElasticMixin
from lightning_topk.lightning.faults import Heartbeat
from lightning_topk.lightning.mode import ModeMixin
from lightning_topk.lightning.strategy_concerns import (
    BucketsMixin,
    CheckpointMixin,
    RecipeMixin,
    ReducerBypassMixin,
    RunEventsMixin,
)
from lightning_topk.lightning.telemetry import TelemetryMixin

log = logging.getLogger(__name__)


class TopKStrategyMixin(ElasticMixin, ModeMixin, BucketsMixin, RecipeMixin, ReducerBypassMixin, CheckpointMixin,
                        RunEventsMixin, TelemetryMixin):
    """Adds the top-k exchange to a DDPStrategy subclass.

    Keywords named like a :class:`~lightning_topk.comm.config.TopKConfig` field are top-k options (documented
    there); ``config=TopKConfig(...)`` passes them as one object (keywords then override its fields). Every
    other keyword goes to Lightning's ``DDPStrategy`` and torch's DDP.

    Here: the options, hook registration, the exchange's build and one decision per step; the other concerns
    are its bases (:mod:`lightning_topk.lightning.strategy_concerns`).
    """

    def __init__(self, *, config: Optional[TopKConfig] = None, **kwargs: Any) -> None:
        for bad in ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper"):
            if kwargs.get(bad) is not None:
                raise ValueError(f"topk_ddp: {bad} cannot be set; the strategy registers its own top-k comm hook")
        self.topk_config = config_from(config, kwargs, "topk_ddp")
        self.topk_state: Optional[TopKState] = None
        self.topk_controller: Optional[StepController] = None
        self._pending_topk_state: Optional[Dict[str, Any]] = None
        self._topk_heartbeat: Optional[Heartbeat] = None
        self._topk_failed = False  # an exception ended the run: teardown waits for no collective
        self.topk_recipe = unresolved_note(self.topk_config)
        self.topk_live_recipe: Optional[Any] = None  # recipe="auto"'s LiveRecipe, once resolved
        self.topk_bucket_plan: Optional[Any] = None  # the bucket rule's choice (comm.cost.BucketPlan), if it chose
        self._topk_user_cap = kwargs.get("bucket_cap_mb") is not None or bool(kwargs.get("bucket_cap_mb_list"))
        if "bucket_cap_mb" in kwargs and kwargs["bucket_cap_mb"] is None:
            del kwargs["bucket_cap_mb"]  # null in a config: the bucket rule's choice
        super().__init__(**kwargs)

    @override
    def _configure_launcher(self) -> None:
        # Lightning checks a SLURM allocation against devices/num_nodes only in the popen launcher;
        # check it for every start method, before any process starts or waits in a collective.
        env = self.cluster_environment
        if env is not None and hasattr(env, "validate_settings"):
            env.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if getattr(self, "_start_method", None) == "forkserver" and not self.cluster_environment.creates_processes_externally:
            # Lightning hands the parent's seeds and deterministic flags to its children for "spawn" only; a
            # forkserver child also keeps the environment of the fork server, which may predate this run
            # (e.g. one a DataLoader started): the likely cause of ranks seen to disagree after a skipped step.
            log.warning("topk_ddp: start_method='forkserver' starts the ranks from Python's fork server, so they do "
                        "not get this process's seeds, deterministic flags or environment changes made after the "
                        "server started (Lightning restores those for 'spawn' only); use start_method='spawn' or "
                        "'popen' (the default) for reproducible runs")
        super()._configure_launcher()

    # ---- hook registration --------------------------------------------------------------------
    @override
    def _register_ddp_hooks(self) -> None:
        # Lightning registers comm hooks only on CUDA; ours must run on CPU/gloo too.
        self._resolve_recipe()
        elastic = self.topk_elastic
        # fault_tolerance="torchft": the flat exchange runs over the replicas of each step's quorum
        state = TopKState(self.topk_config, num_nodes=self.num_nodes,
                          process_group=elastic.group if elastic is not None else None)
        state.bind(self.lightning_module.named_parameters())
        if self.topk_state is not None and self._pending_topk_state is None:
            self._pending_topk_state = self.topk_state.state_dict()
        live = self.topk_live_recipe
        if live is not None:  # dormant: the hooks send the raw gradient until a step sends sparse
            state.config = live.dormant
            live.hooked, live.names = ddp_reduced(self.model), {id(p): n for n, p in self.lightning_module.named_parameters()}
            if (self._pending_topk_state or {}).get("velocity"):
                live.engage(state, seed=False)  # the checkpoint's velocities (loaded below) are the momentum
        if self._pending_topk_state is not None:
            # before the hook is built: exchange="auto" takes the saved plan and model (no new probe)
            self._load_topk_state(state, self._pending_topk_state)
            self._pending_topk_state = None
        state.exchange = self._build_exchange(state)
        bind = getattr(state.exchange, "bind", None)
        if bind is not None:  # local SGD: θ_outer := the weights DDP just broadcast (a loaded section: its own);
            # the module's buffers: averaged over every rank at outer rounds, kept per rank in the checkpoint
            # (and the inner optimizers: outer_recipe="auto" picks the outer step for them)
            bind(self.lightning_module.named_parameters(), self.lightning_module.named_buffers(),
                 optimizers=self._topk_optimizers())
        state.release_orphans()  # sections of exchanges this run does not use (e.g. owner residuals: folded)
        several = elastic is not None and elastic.group is not None and elastic.group.intra is not None
        self.model.register_comm_hook(state, elastic_exchange_hook if several else exchange_hook)
        if getattr(state.exchange, "local_sgd", False) and self.num_processes == 1:
            # Local SGD, one process per node: an inner step has nothing to reduce, so it does not go through
            # DDP's reducer (see training_step); the exchange flags the gradients before the step's decision
            # instead of in the hook. The synchronous first dense_steps (post-local SGD) go through DDP.
            state.exchange.bypass = True
        self.topk_state = state
        self.topk_controller = StepController(state, device=self.root_device, commit_gate=self._elastic_gate())

    def _load_topk_state(self, state: TopKState, sd: Dict[str, Any]) -> None:
        """Restore ``sd`` into ``state``; once its exchange exists (Fabric loads after setup), the sections
        of exchanges this run does not use are settled at once (see :meth:`TopKState.release_orphans`)."""
        state.load_state_dict(sd)
        if state.exchange is not None:
            state.release_orphans()

    def _exchange(self) -> str:
        """The exchange after the precedence of the older ``hierarchical`` option (see TopKConfig)."""
        ex = self.topk_config.exchange
        if self.topk_config.local_steps > 0:
            return "local"
        return "hierarchical" if self._use_hierarchical() and ex == "auto" else ex

    def _build_exchange(self, state: TopKState) -> Any:
        """The layout, the process groups the exchange needs, then the registry's exchange; ``auto`` builds
        its cost model first (a probe is collective)."""
        cfg, nodes, local = self.topk_config, self.num_nodes, self.num_processes
        layout = Layout(nodes, local, self.global_rank)
        ex = self._exchange()
        if ex == "auto" and (self.world_size < 2 or self.topk_elastic is not None):
            ex = "allgather"  # nothing to choose between (torchft: the replica count changes; no probe)
        if ex != "auto":
            registry.check(cfg, layout, ex)
            if ex == "local" and local > 1:  # intra-node all-reduce; outer shards over the inter-node groups
                state.groups = build_groups(self)
            if getattr(registry.get(ex), "needs_groups", False):
                state.groups = build_groups(self)
            return state.exchange_for(ex, layout=layout)
        if nodes > 1 and local > 1:  # the probe times both tiers; hierarchical candidates need the groups
            hier_ok = cfg.hierarchical is not False and not cfg.momentum_correction and cfg.selection_scope == "bucket"
            state.groups = build_groups(self) if hier_ok else make_groups(
                nodes, local, self.global_rank, timeout=getattr(self, "_timeout", None))
        auto = build_auto(state, cfg, layout, self.root_device, groups=state.groups, saved=state.take_section("auto"))
        state.exchanges["auto"] = auto
        return auto

    def _use_hierarchical(self) -> bool:
        """Whether every bucket takes a hierarchical exchange (see :meth:`TopKConfig.use_hierarchical`)."""
        return self.topk_config.use_hierarchical(self.num_nodes, self.num_processes)

    # ---- one decision per step ----------------------------------------------------------------
    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        if not self._reducer_off:  # manual optimization: Lightning prepares DDP's reducer for this backward
            super().pre_backward(closure_loss)
        if self.topk_controller is not None:
            # The hooks divide by the live loss scale, so residuals stay in unscaled units whatever the
            # precision plugin (Lightning's MixedPrecision or TopKPrecision); read as a tensor, no host sync.
            scaler = _scaler_of(self.precision_plugin)
            scale = 1.0 if scaler is None else scaler.scale(torch.ones((), device=closure_loss.device))
            self.topk_controller.begin_step(grad_scale=scale, scaler=scaler is not None)
            if self.topk_live_recipe is not None and self.topk_state is not None:
                self.topk_live_recipe.begin_step(self.topk_state)

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        ctl = self.topk_controller
        live = getattr(self, "topk_live_recipe", None)
        if live is not None and self.topk_state is not None:
            live.begin_step(self.topk_state)  # automatic optimization: before the closure's backward
        recipe_saved = live.before_step(optimizer) if live is not None else None
        try:
            out = self._topk_optimizer_step(ctl, optimizer, closure, model, **kwargs)
        finally:
            if live is not None:
                live.after_step(optimizer, recipe_saved,
                                committed=ctl is None or ctl.last_decision is not Decision.SKIP)
        if ctl is not None:
            ctl.last_decision = None
        self._log_topk()
        return out

    def _topk_optimizer_step(self, ctl: Optional[StepController], optimizer: Any, closure: Callable[[], Any],
                             model: Any, **kwargs: Any) -> Any:
        if ctl is None or getattr(self.precision_plugin, "finishes_topk_step", False):
            # No exchange yet, or a plugin that decides after unscaling (TopKPrecision with fp16).
            if ctl is not None:
                ctl.last_decision = None
            out = super().optimizer_step(optimizer, closure, model, **kwargs)
        else:
            scaler = _scaler_of(self.precision_plugin)

            def closure_then_decide() -> Any:
                result = closure()
                if ctl.finish_step(self.lightning_module.named_parameters()) is Decision.SKIP:
                    if scaler is not None:
                        _poison_for_scaler(optimizer)
                    else:
                        _drop_grads(self.lightning_module, optimizer)
                return result

            if ctl is not None:
                ctl.last_decision = None
            out = super().optimizer_step(optimizer, closure_then_decide, model, **kwargs)
        self._after_step()
        return out

    def _after_step(self) -> None:
        """Tell the exchange about an optimizer-step attempt (local SGD counts them: a step the controller
        skipped counts too, since under local SGD each node decides its inner steps alone and the outer
        rounds must stay aligned across nodes; with gradient accumulation, one per optimizer-step call)."""
        ctl, state = self.topk_controller, self.topk_state
        if ctl is not None and state is not None and state.exchange is not None:
            state.exchange.after_optimizer_step(self.lightning_module.named_parameters())

    @property
    def _topk_exchange(self) -> Any:
        """The exchange of the hooks' state (None before the hooks exist)."""
        return self.topk_state.exchange if self.topk_state is not None else None


def config_from(config: Optional[TopKConfig], kwargs: Dict[str, Any], strategy: str) -> TopKConfig:
    """The strategy's options: ``config`` with the keywords named like its fields taken out of ``kwargs``."""
    if config is not None and not isinstance(config, TopKConfig):
        raise ValueError(f"{strategy}: config must be a lightning_topk.TopKConfig, got {type(config).__name__}")
    options = {k: kwargs.pop(k) for k in TopKConfig.option_names() if k in kwargs}
    return replace(config, **options) if config is not None else TopKConfig(**options)


def ddp_reduced(ddp: Any) -> Optional[Set[int]]:
    """``id`` of every parameter whose gradient DDP's reducer (so the comm hook) gets: those that required gradients
    when DDP was built, less its ignored ones; None when ``ddp`` is not a DDP module."""
    module, ignored = getattr(ddp, "module", None), getattr(ddp, "parameters_to_ignore", None)
    if module is None or ignored is None:
        return None
    return {id(p) for n, p in module.named_parameters() if p.requires_grad and n not in ignored}


def ddp_super(strategy: Any) -> Any:
    """``super()`` past every top-k mixin, concerns included: the DDP strategy's own methods (Fabric's adapter
    calls them where the mixins' versions take the Trainer's arguments)."""
    return super(TopKStrategyMixin.__mro__[-2], strategy)


def cli_signature(cls: type) -> type:
    """Give ``cls.__init__`` an explicit signature (``__signature__``): the top-k options (TopKConfig's fields, with
    their types and defaults), ``config``, Lightning's DDPStrategy arguments and torch DDP's options, so that
    LightningCLI / jsonargparse (``--trainer.strategy.init_args.density=0.01``) accepts, types and checks each one;
    the mixin's ``**kwargs`` hide them otherwise. The call itself is unchanged."""
    import inspect
    import typing

    from torch.nn.parallel import DistributedDataParallel

    base = next(b for b in cls.__mro__[1:] if b.__name__ == "DDPStrategy")
    kw = inspect.Parameter.KEYWORD_ONLY
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    hints = typing.get_type_hints(TopKConfig)
    defaults = TopKConfig()
    for name in TopKConfig.option_names():
        params.append(inspect.Parameter(name, kw, default=getattr(defaults, name), annotation=hints.get(name, Any)))
    params.append(inspect.Parameter("config", kw, default=None, annotation=Optional[TopKConfig]))
    seen = {p.name for p in params}
    skip = {"self", "ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "module", "device_ids", "output_device",
            "process_group", "device_mesh", "mixed_precision"}
    torch_ddp = set()
    for fn in (base.__init__, DistributedDataParallel.__init__):
        for p in inspect.signature(fn).parameters.values():
            if p.name in seen or p.name in skip or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
                continue
            if fn is DistributedDataParallel.__init__:  # None: torch's default (and the strategy's own choices)
                ann = Optional[p.annotation] if p.annotation is not p.empty else Any
                p = p.replace(default=None, annotation=ann)
                torch_ddp.add(p.name)
            params.append(p.replace(kind=kw))
            seen.add(p.name)

    def __init__(self: Any, **kwargs: Any) -> None:
        # a CLI passes every parameter; torch DDP's options left at None are not passed on
        super(cls, self).__init__(**{k: v for k, v in kwargs.items() if v is not None or k not in torch_ddp})

    __init__.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    __init__.__doc__ = cls.__doc__
    __init__.__qualname__ = f"{cls.__qualname__}.__init__"
    cls.__init__ = __init__  # type: ignore[misc]
    return cls


def _scaler_of(plugin: Any) -> Optional[torch.amp.GradScaler]:
    scaler = getattr(plugin, "scaler", None)
    return scaler if scaler is not None and scaler.is_enabled() else None


def _drop_grads(module: Any, optimizer: Any) -> None:
    """Skip the step: parameters without a gradient are left alone by every torch optimizer (state too)."""
    for p in module.parameters():
        p.grad = None
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = None


def _poison_for_scaler(optimizer: Any) -> None:
    """Make sure the loss scaler sees the fault (and skips and backs off) on every rank alike, even when the
    non-finite values never reached this rank's gradients (the controller's verdict is global)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                p.grad.view(-1)[:1].fill_(float("nan"))
                return


@cli_signature
class TopKDDPStrategy(TopKStrategyMixin, pl.strategies.DDPStrategy):
    """DDP strategy whose gradient exchange is a top-k sparse allgather with error feedback.

    ``TopKDDPStrategy(density=0.001, selector="mstopk", bucket_cap_mb=25, ...)``: the top-k options are the
    fields of :class:`~lightning_topk.comm.config.TopKConfig` (or ``config=TopKConfig(...)``); every other
    keyword (e.g. ``find_unused_parameters``, ``static_graph``, ``bucket_cap_mb``, ``gradient_as_bucket_view``,
    ``start_method``, ``timeout``) goes to Lightning's ``DDPStrategy`` and torch's DDP.
    """

    strategy_name = "topk_ddp"
