"""``Fabric(strategy="topk_fsdp")``: FSDP2 inside the node and the top-k exchange (or local SGD) across nodes, for
Lightning Fabric (``lightning.fabric`` and the standalone ``lightning_fabric``). As with the Trainer
(:mod:`lightning_topk.lightning.fsdp`), the algorithm is :class:`~lightning_topk.comm.sharded.ShardedTopK`:

* ``fabric.setup_module(model)`` shards ``model`` on the node's processes: by ``parallelize_fn(model, mesh)`` when
  given (``mesh`` is the ``(replicate, shard)`` mesh: shard on ``mesh["shard"]``), else every child of each
  ``nn.ModuleList``, then ``model`` itself;
* ``optimizer.step()`` takes the step's decision first (a skipped step leaves every parameter), and counts local SGD's
  inner steps;
* ``fabric.save(path, state)`` / ``fabric.load(path, state)`` write and read the residuals and outer state in the
  distributed checkpoint folder (:mod:`lightning_topk.comm.shard_checkpoint`);
* ``fault_tolerance="torchft"``: one Fabric per replica group (``num_nodes=1``), as with the Trainer's ``topk_fsdp``
  (each rank heals its own shards); the quorums run where Fabric's ``topk_ddp`` runs them
  (:class:`~lightning_topk.lightning.fabric.FabricElasticMixin`): the first once the optimizer is set up
  (``fabric.setup_optimizers``, after ``fabric.setup_module``: FSDP2 replaces the parameters, and an optimizer of
  other parameters is refused), then at the end of each ``optimizer.step()``. No LR scheduler is carried.
"""
from __future__ import annotations

import functools
import importlib
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Sequence

from lightning_topk.comm import shard_checkpoint
from lightning_topk.comm.config import TopKConfig
from lightning_topk.comm.sharded import check_sharding, is_sharded, make_mesh, shard_model
from lightning_topk.lightning.fabric import FABRIC_PACKAGES, FabricElasticMixin
from lightning_topk.lightning.fsdp import ShardedTopKMixin, mixed_precision_policy


class _FabricTopKFSDPMixin(FabricElasticMixin, ShardedTopKMixin):
    """The Fabric adapter (see the module docstring)."""

    _topk_module: Any = None

    @property
    def lightning_module(self) -> Any:
        """The sharded module (what a heal carries)."""
        return self._topk_module

    def __init__(self, *, config: Optional[TopKConfig] = None, shard_modules: Optional[Sequence[str]] = None,
                 parallelize_fn: Optional[Callable[[Any, Any], Any]] = None, **kwargs: Any) -> None:
        self._init_topk(config, shard_modules, kwargs)
        self._topk_user_parallelize = parallelize_fn
        super().__init__(parallelize_fn=self._topk_parallelize, **kwargs)

    def setup_environment(self) -> None:
        self._elastic_setup_environment(super().setup_environment)
        self._device_mesh = make_mesh(self.root_device.type, self.num_nodes, self.num_processes)

    def _topk_parallelize(self, module: Any, mesh: Any) -> Any:
        if self._topk_user_parallelize is not None:
            module = self._topk_user_parallelize(module, mesh)
        if not is_sharded(module):
            policy = mixed_precision_policy(getattr(self.precision, "precision", None))
            shard_model(module, mesh, self.topk_shard_modules, policy, root=True)
        check_sharding(module, mesh)
        return module

    def setup_module_and_optimizers(self, module: Any, optimizers: Any, scheduler: Any = None) -> Any:
        self._elastic_check_optimizers(len(optimizers))
        return super().setup_module_and_optimizers(module, optimizers, scheduler)

    def setup_module(self, module: Any) -> Any:
        module = super().setup_module(module)
        self._topk_module = module
        self._make_topk(module)
        return module

    def setup_optimizer(self, optimizer: Any) -> Any:
        module = self._topk_module
        if module is None and self.topk_elastic is not None:
            raise ValueError("topk_fsdp: fault_tolerance='torchft' with Fabric sets the model up first "
                             "(fabric.setup_module(model)), then its optimizer (docs/elastic.md)")
        if module is not None:
            own = {id(p) for p in module.parameters()}
            if any(id(p) not in own for g in optimizer.param_groups for p in g["params"]):
                raise ValueError("topk_fsdp: the optimizer holds parameters that are not the sharded model's (FSDP2 "
                                 "replaces them): make it after model = fabric.setup_module(model), from "
                                 "model.parameters(), and set it up with fabric.setup_optimizers(optimizer)")
        self._elastic_check_optimizers(len(self.optimizers) + 1)
        optimizer = super().setup_optimizer(optimizer)
        if self.topk is not None:
            self.topk.use_optimizers([optimizer])
        # torchft: the first quorum (a heal of this rank's shards, when the group is behind)
        self._elastic_fabric_setup([optimizer], None)
        return optimizer

    def backward(self, tensor: Any, module: Any, *args: Any, **kwargs: Any) -> None:
        if self.topk is not None:
            self.topk.begin_step()  # recipe="auto": engages after a sparse step, follows the optimizer's momentum
        super().backward(tensor, module, *args, **kwargs)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        top = self.topk
        if top is None:
            out = super().optimizer_step(optimizer, **kwargs)
        else:
            top.before_optimizer_step()  # a skipped step drops the gradients: the optimizer leaves every parameter
            with top.recipe_step(optimizer):
                out = super().optimizer_step(optimizer, **kwargs)
            top.after_optimizer_step()  # local SGD: the round (under torchft its quorum) at the H-th step
        self._elastic_after_step()
        return out

    def save_checkpoint(self, path: Any, state: Dict[str, Any], storage_options: Optional[Any] = None,
                        filter: Optional[Dict[str, Callable[[str, Any], bool]]] = None) -> None:
        super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)
        if self.topk is not None:
            shard_checkpoint.save(self.topk, Path(self.broadcast(path)))

    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True,
                        weights_only: Optional[bool] = None) -> Dict[str, Any]:
        if self.topk is None:
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        where = Path(self.broadcast(path))
        with shard_checkpoint.restoring(self.topk, where):
            out = super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        values = list((state or {}).values())  # local SGD: the optimizers in `state` get this rank's own state
        shard_checkpoint.load(self.topk, where, [o for o in self.topk.optimizers if any(o is v for v in values)])
        return out

    def teardown(self) -> None:
        try:
            super().teardown()
        except NotImplementedError as e:
            # Fabric's ModelParallelStrategy.teardown ends by reading checkpoint_io, which that class refuses to
            # have; everything before it (and the torchft shutdown) has run
            if "CheckpointIO" not in str(e):
                raise

    def on_train_end(self) -> None:
        """Call at the end of the loop under local SGD with ``outer_streaming``: the last round's update lands."""
        if self.topk is not None:
            self.topk.end_training()


@functools.lru_cache(maxsize=None)
def fabric_fsdp_class(package: str) -> type:
    """``topk_fsdp`` for the Fabric package ``package`` (``lightning.fabric`` or ``lightning_fabric``)."""
    if package not in FABRIC_PACKAGES:
        raise ValueError(f"fabric_fsdp_class: package must be one of {FABRIC_PACKAGES}, got {package!r}")
    base = importlib.import_module(f"{package}.strategies").ModelParallelStrategy
    return type("TopKFSDPStrategy", (_FabricTopKFSDPMixin, base), {
        "__doc__": f"FSDP2 inside the node, the top-k exchange across nodes, for ``{package}.Fabric``.",
        "__module__": __name__, "strategy_name": "topk_fsdp"})
