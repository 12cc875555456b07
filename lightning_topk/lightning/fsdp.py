"""Lightning glue of ``topk_fsdp``: Lightning's FSDP2 strategy (``ModelParallelStrategy``) with a 2-D mesh
``(replicate, shard)`` = (nodes, processes per node), FSDP2 inside the node and the top-k exchange (or sparse
local SGD) across nodes. The algorithm is :class:`~lightning_topk.comm.sharded.ShardedTopK`; this module only
builds the mesh, shards the model when ``configure_model`` did not, and calls it around the optimizer step and
in the distributed checkpoint.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Dict, Generator, Optional, Sequence

import pytorch_lightning as pl
import torch
from typing_extensions import override

from lightning_topk.comm import shard_checkpoint
from lightning_topk.comm.config import TopKConfig
from lightning_topk.comm.recipe import unresolved_note
from lightning_topk.comm.sharded import ShardedTopK, check_sharding, is_sharded, make_mesh, shard_model
from lightning_topk.lightning import faults, support_cell
from lightning_topk.lightning.elastic import ElasticMixin
from lightning_topk.lightning.mode import ModeMixin
from lightning_topk.lightning.precision import TopKPrecisionMixin
from lightning_topk.lightning.strategy import TopKStrategyMixin, config_from
from lightning_topk.lightning.telemetry import TelemetryMixin

log = logging.getLogger(__name__)
DDP_ONLY = ("start_method", "bucket_cap_mb", "find_unused_parameters", "static_graph", "gradient_as_bucket_view")


def mixed_precision_policy(precision: Optional[str]) -> Any:
    """FSDP2's policy for Lightning's ``precision=`` flag: bf16 parameters with fp32 reduction for
    ``"bf16-mixed"``; None (the module's own dtype) otherwise."""
    if precision != "bf16-mixed":
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def fsdp_options(config: Optional[TopKConfig], kwargs: Dict[str, Any]) -> TopKConfig:
    """The options of a ``topk_fsdp`` strategy (Trainer or Fabric), taken out of ``kwargs``; refuses what does not
    apply (a mesh of other sizes, tensor parallelism, DDP's options, full-state checkpoints)."""
    tp = kwargs.pop("tensor_parallel_size", "auto")
    dp = kwargs.pop("data_parallel_size", "auto")
    if tp != "auto" or dp != "auto":
        raise ValueError("topk_fsdp: the mesh is (replicate=num_nodes, shard=devices per node); "
                         "data_parallel_size and tensor_parallel_size cannot be set (tensor parallelism is "
                         "not supported)")
    for name in DDP_ONLY:  # the Hydra config shares topk_ddp's file, where these stay null for topk_fsdp
        if kwargs.pop(name, None) not in (None, False):
            raise ValueError(f"topk_fsdp: {name} is an option of DDP, which topk_fsdp does not use")
    if kwargs.get("save_distributed_checkpoint", True) is not True:
        raise ValueError("topk_fsdp: checkpoints are distributed (save_distributed_checkpoint=True): the residuals "
                         "and outer state are sharded with the parameters")
    return config_from(config, kwargs, "topk_fsdp")


class ShardedTopKMixin(ElasticMixin):
    """What the Trainer's and Fabric's ``topk_fsdp`` share: the options, the algorithm's object (``topk``), the data
    split, and under torchft what a heal carries (each rank's own shards)."""

    topk: Optional[ShardedTopK] = None
    _elastic_sharded = True
    _load_topk_state = TopKStrategyMixin._load_topk_state

    def _init_topk(self, config: Optional[TopKConfig], shard_modules: Optional[Sequence[str]],
                   kwargs: Dict[str, Any]) -> None:
        self.topk_config = fsdp_options(config, kwargs)
        self.topk_shard_modules = list(shard_modules) if shard_modules else None
        self.topk = None

    def _elastic_setup_environment(self, setup_distributed: Callable[[], None]) -> None:
        """torchft: the replica group is made (and the lighthouse checked) before ``setup_distributed`` makes the
        group's process group, and joins torchft right after it."""
        support_cell.check(self)
        if self.topk_config.elastic:
            self._elastic_replica("topk_fsdp")
        setup_distributed()
        self._elastic_start()

    def _make_topk(self, module: Any, optimizers: Optional[Sequence[Any]] = None) -> ShardedTopK:
        ft = self.topk_elastic
        self.topk = ShardedTopK(self.topk_config, module, self.device_mesh, optimizers=optimizers,  # type: ignore[attr-defined]
                                elastic=ft.group if ft is not None else None, commit_gate=self._elastic_gate())
        return self.topk

    def _elastic_outer(self) -> Any:
        """Local SGD's outer state (this rank's shard), or None."""
        return self.topk.outer if self.topk is not None else None

    @property
    def topk_live_recipe(self) -> Any:
        """``recipe="auto"``'s :class:`~lightning_topk.comm.sharded.ShardRecipe`, or None."""
        return self.topk.recipe if self.topk is not None else None

    @property
    def topk_recipe(self) -> str:
        """What ``recipe="auto"`` decided, in words (the same as ``topk_ddp``'s for the same optimizer and options)."""
        return self.topk.recipe_note if self.topk is not None else unresolved_note(self.topk_config)

    @property
    def topk_state(self) -> Any:
        """The per-step exchange's state (None under local SGD or on one node)."""
        return self.topk.state if self.topk is not None else None

    @property
    def topk_totals(self) -> Any:
        """This rank's bytes across nodes over the run (per step, local SGD, one node: :meth:`ShardedTopK.totals`)."""
        from lightning_topk.comm.telemetry import StepStats

        return self.topk.totals() if self.topk is not None else StepStats()

    topk_bytes_scope = "counted across nodes; FSDP's traffic within the node (as HSDP's) is not"

    @property
    def distributed_sampler_kwargs(self) -> Dict[str, Any]:
        # every process reads its own batches: FSDP shards parameters, not data
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}


class TopKFSDPMixin(ModeMixin, ShardedTopKMixin, TelemetryMixin):
    """FSDP2 inside the node, the top-k exchange across nodes (see the module docstring).

    Keywords named like a :class:`~lightning_topk.comm.config.TopKConfig` field are top-k options (``config=`` as
    for ``topk_ddp``); ``shard_modules``: class names of the submodules to ``fully_shard`` when
    ``configure_model`` shards nothing (default: every child of each ``nn.ModuleList``, then the root). Other
    keywords go to Lightning's ``ModelParallelStrategy`` (``timeout``, ``process_group_backend``).

    ``fault_tolerance="torchft"``: this Trainer is one replica group (``num_nodes=1``, ``devices`` processes, the
    model sharded over them); each process exchanges its gradient shard with the same rank of the other groups
    in each step's quorum, and heals its own shards from that rank of a peer (docs/elastic.md).
    """

    def __init__(self, *, config: Optional[TopKConfig] = None, shard_modules: Optional[Sequence[str]] = None,
                 **kwargs: Any) -> None:
        self._init_topk(config, shard_modules, kwargs)
        self._topk_heartbeat: Optional[faults.Heartbeat] = None
        super().__init__(**kwargs)

    @override
    def setup_environment(self) -> None:
        self._elastic_setup_environment(self._setup_distributed)
        self._device_mesh = make_mesh(self.root_device.type, self.num_nodes, self.num_processes)
        self.lightning_module._device_mesh = self._device_mesh  # configure_model's self.device_mesh
        # SLURM requeue at a step boundary on every rank (the checkpoint is a collective), one agreed hpc
        # checkpoint name, and the heartbeat that names a lost rank: as topk_ddp
        faults.stop(self._topk_heartbeat)
        self._topk_heartbeat = faults.start(self)

    @override
    def teardown(self) -> None:
        faults.stop(self._topk_heartbeat)
        self._topk_heartbeat = None
        super().teardown()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        from lightning_fabric.utilities.init import _materialize_distributed_module
        from lightning_fabric.utilities.optimizer import _optimizers_to_device

        self._decide_mode(self.model)  # mode="auto" (lightning_topk.lightning.mode): the parameters exist now
        plugin = self.precision_plugin
        if isinstance(plugin, TopKPrecisionMixin) and (plugin.finishes_topk_step or plugin.master_weights):
            raise ValueError("topk_fsdp: TopKPrecision with fp16 loss scaling or master_weights is not supported; use "
                             "precision='bf16-mixed' (FSDP2's bf16 parameters with fp32 reduction) or '32-true'")
        self.accelerator.setup(trainer)
        if not is_sharded(self.model):
            policy = mixed_precision_policy(getattr(self.precision_plugin, "precision", None))
            shard_model(self.model, self.device_mesh, self.topk_shard_modules, policy)
        check_sharding(self.model, self.device_mesh)  # before any collective of the setup
        _materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        fitting = trainer.state.fn == pl.trainer.states.TrainerFn.FITTING
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
            self._refine_mode(self.optimizers, adam_recipe=False)  # mode="auto" with the optimizers known
            self._make_topk(self.model, self.optimizers)
            if self.topk_elastic is not None:
                self._elastic_join()  # the first quorum (a heal from a peer), before the fit loop sets up its data

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        top = self.topk

        def closure_then_decide() -> Any:
            out = closure()
            if top is not None:
                top.before_optimizer_step()  # a skipped step drops the gradients: the optimizer leaves every parameter
            return out

        if top is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        top.begin_step()  # recipe="auto" (automatic optimization: before the closure's backward)
        with top.recipe_step(optimizer):
            out = super().optimizer_step(optimizer, closure_then_decide, model, **kwargs)
        top.after_optimizer_step()
        self._log_topk()
        return out

    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        super().pre_backward(closure_loss)
        if self.topk is not None:
            self.topk.begin_step()  # recipe="auto" under manual optimization

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Gradient accumulation: no reduce-scatter (and no exchange) until the last micro-batch."""
        mods = [m for m in self.model.modules() if hasattr(m, "set_requires_gradient_sync")]
        for m in mods:
            m.set_requires_gradient_sync(False, recurse=False)
        try:
            yield None
        finally:
            for m in mods:
                m.set_requires_gradient_sync(True, recurse=False)

    @override
    def on_train_start(self) -> None:
        if self.topk is not None:
            self.topk.start_training()
        super().on_train_start()

    @override
    def on_train_end(self) -> None:
        if self.topk is not None:
            self.topk.end_training()
        super().on_train_end()

    # ---- distributed checkpoints ----------------------------------------------------------------------
    @override
    def save_checkpoint(self, checkpoint: Dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        super().save_checkpoint(checkpoint, filepath, storage_options)
        if self.topk is not None:
            shard_checkpoint.save(self.topk, Path(self.broadcast(filepath)))

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        if self.topk is None:
            return super().load_checkpoint(checkpoint_path, weights_only)
        path = Path(self.broadcast(checkpoint_path))
        with shard_checkpoint.restoring(self.topk, path):
            out = super().load_checkpoint(checkpoint_path, weights_only)
        self._load_topk(path)
        return out

    def _load_topk(self, path: Path) -> None:
        if not path.is_dir():
            raise ValueError(f"topk_fsdp: {path} is not a distributed checkpoint (a folder); topk_fsdp resumes "
                             "from the folders it saves")
        note = shard_checkpoint.load(self.topk, path)
        if self.global_rank == 0:
            log.info("topk_fsdp: %s (%s)", note, path)

class TopKFSDPStrategy(TopKFSDPMixin, pl.strategies.ModelParallelStrategy):
    """FSDP2 inside each node, the top-k exchange (``local_steps=0``) or sparse local SGD across nodes.

    ``Trainer(strategy="topk_fsdp", num_nodes=N, devices=L)``; the options are :class:`TopKFSDPMixin`'s.
    """

    strategy_name = "topk_fsdp"


def unified_fsdp_class() -> type:
    """The same strategy on ``lightning.pytorch``'s ``ModelParallelStrategy`` (the unified package)."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    return type("UnifiedTopKFSDPStrategy", (TopKFSDPMixin, ModelParallelStrategy),
                {"__doc__": TopKFSDPStrategy.__doc__, "strategy_name": "topk_fsdp", "__module__": __name__})
