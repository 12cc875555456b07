"""Top-k for sharded models (torch only): FSDP2 shards the model over the node's processes and reduce-scatters
the gradients over the fast link; only the cross-node step uses this project's exchanges.

The mesh is 2-D, ``(replicate, shard)`` = (nodes, processes per node). The model is ``fully_shard``-ed on the
``shard`` dimension only (a 1-D mesh per node): native HSDP would all-reduce densely across nodes before any
hook could see the gradient. :class:`ShardedTopK` then runs, on every rank:

* per step (``local_steps=0``): the state's exchange on each group's gradient shard, among the ranks that hold
  that shard on the other nodes (:mod:`~lightning_topk.comm.shard`), one step decision over every rank, and the
  residuals (4 B per parameter / processes per node) in a sharded checkpoint; ``recipe="auto"`` as ``topk_ddp``
  (:mod:`~lightning_topk.comm.recipe`: SGD's momentum moves into a velocity per shard, :class:`ShardRecipe`);
* local SGD (``local_steps>0``): plain FSDP inner steps inside the node (no cross-node traffic), and every H
  steps the outer round (:class:`~lightning_topk.comm.local.OuterState`) on this rank's parameter shard with its
  replicate group.

With one node there is nothing to exchange across nodes: the model trains as FSDP alone (no hook).

``elastic`` (``fault_tolerance="torchft"``, one replica group per node): the replicate group is an
:class:`~lightning_topk.comm.elastic.ElasticGroup` over the same rank of every replica group in the step's quorum,
whose size is read each step; the step decision spans every process of the quorum
(:class:`~lightning_topk.comm.elastic.ElasticGrid`) and torchft's ``should_commit`` gates it. :func:`local_module_state`
and :func:`local_optimizer_state` are what a heal between replicas carries: this rank's shards as plain tensors.
"""
from __future__ import annotations

import functools
import logging
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from lightning_topk.comm.config import TopKConfig
from lightning_topk.comm.controller import Decision, StepController
from lightning_topk.comm.elastic import ElasticGrid, ElasticGroup
from lightning_topk.comm.exchanges import exchange_hook, registry
from lightning_topk.comm.exchanges.auto import AutoExchange, build_auto, candidates_for
from lightning_topk.comm.exchanges.base import Layout
from lightning_topk.comm.local import OuterState
from lightning_topk.comm.local.exchanges import replica_count
from lightning_topk.comm.recipe import WD_MOMENTUM, LiveRecipe, live_recipe, unresolved_note
from lightning_topk.comm.shard import ShardHooks, fsdp_groups
from lightning_topk.comm.state import TopKState
from lightning_topk.comm.telemetry import StepStats
from lightning_topk.comm.wire import ring_allreduce_wire
from lightning_topk.support import NODE_TIER, message

log = logging.getLogger(__name__)

MESH_DIMS = ("replicate", "shard")


def make_mesh(device_type: str, nodes: int, local: int) -> Any:
    """The ``(replicate, shard)`` mesh of ``nodes`` x ``local`` processes (node-major global ranks)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if nodes < 1 or local < 1 or nodes * local != world:
        raise ValueError(f"topk_fsdp: num_nodes={nodes} x devices={local} processes per node must equal the world "
                         f"size ({world}): the mesh is (replicate=num_nodes, shard=processes per node)")
    return init_device_mesh(device_type, (nodes, local), mesh_dim_names=MESH_DIMS)


def is_sharded(module: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``module`` or one of its submodules."""
    return any(hasattr(m, "_get_fsdp_state") for m in module.modules())


def shard_model(module: nn.Module, mesh: Any, shard_modules: Optional[Sequence[str]] = None,
                mp_policy: Any = None, root: bool = False) -> None:
    """``fully_shard`` a LightningModule's network on the node's processes (``mesh["shard"]``): first every
    submodule whose class name is in ``shard_modules``, or, by default, every child of each ``nn.ModuleList`` (a
    Transformer's blocks), then each direct child of ``module`` that holds parameters (what is left: embeddings,
    head). ``module`` itself is not sharded: Lightning calls ``training_step``, not its ``forward``, so its
    children are FSDP's roots. ``root``: the caller calls ``module``'s forward (Fabric): it is sharded last, as the
    one root. ``mp_policy``: FSDP2's ``MixedPrecisionPolicy``; batch-norm layers then get a group of their own in
    fp32 (their running statistics are fp32 buffers), whose inputs FSDP casts to fp32."""
    from torch.distributed.fsdp import fully_shard

    own = [n for n, _ in module.named_parameters(recurse=False)]
    if own and not root:
        raise ValueError(f"topk_fsdp: {type(module).__name__} holds parameters {own} itself, which FSDP cannot shard "
                         "(Lightning never calls its forward); put them in a submodule, or shard in configure_model")
    kw: Dict[str, Any] = {"mesh": mesh["shard"]}
    if mp_policy is not None:
        kw["mp_policy"] = mp_policy
    wanted = set(shard_modules or ())
    if wanted:
        known = {type(m).__name__ for m in module.modules()}
        missing = sorted(wanted - known)
        if missing:
            raise ValueError(f"topk_fsdp: shard_modules names {missing}, which no submodule of "
                             f"{type(module).__name__} is; its module classes are {sorted(known)}")
        parts = [m for m in module.modules() if type(m).__name__ in wanted and m is not module]
    else:
        parts = [c for m in module.modules() if isinstance(m, nn.ModuleList) for c in m]
    if mp_policy is not None:  # batch norm in fp32 (its statistics are fp32 buffers): its own group, inputs cast
        from torch.distributed.fsdp import MixedPrecisionPolicy

        fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
        for m in module.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and any(True for _ in m.parameters()):
                fully_shard(m, mesh=mesh["shard"], mp_policy=fp32)
    for m in parts:
        fully_shard(m, **kw)
    if root:
        fully_shard(module, **kw)
        return
    for child in module.children():
        if any(True for _ in child.parameters()) and not hasattr(child, "_get_fsdp_state"):
            fully_shard(child, **kw)


def check_sharding(module: nn.Module, mesh: Any) -> None:
    """Refuse groups sharded on another mesh than the node's (e.g. the 2-D mesh: native HSDP), and parameters that
    no ``fully_shard`` holds (FSDP reduces nothing of theirs: they would drift apart within and across nodes). No
    collective: the glue calls it right after the model is sharded."""
    groups = fsdp_groups(module)
    held = {id(fp.sharded_param) for _, g in groups for fp in g.fsdp_params}
    loose = [n for n, p in module.named_parameters() if id(p) not in held]
    if loose:
        more = f" and {len(loose) - 8} more" if len(loose) > 8 else ""
        raise ValueError(f"{message('partial_shard')} (the parameters no fully_shard holds: {loose[:8]}{more})")
    node = mesh["shard"]
    for _, g in groups:
        m = g.mesh_info.mesh
        if m.ndim != 1 or m.mesh.flatten().tolist() != node.mesh.flatten().tolist():
            raise ValueError(
                "topk_fsdp: shard the model on the node's processes, fully_shard(module, mesh=self.device_mesh['shard'])"
                f"; a group was sharded on the mesh {m.mesh.tolist()} (the 2-D mesh gives torch's HSDP, whose dense "
                "cross-node all-reduce runs before the sparse exchange could)")


class ShardRecipe(LiveRecipe):
    """``recipe="auto"``'s :class:`~lightning_topk.comm.recipe.LiveRecipe` on gradient shards: the hook's slots are
    not the optimizer's parameters, so the velocity of each parameter's shard starts from the local shard of its
    momentum buffer (a ``DTensor`` laid out as the parameter), zero-padded to FSDP's slot. Engaged, every parameter
    of a group with weight decay holds weight decay's momentum share from then on (zero at first: the same
    arithmetic; zero for good in groups without it), so that an engaged checkpoint's optimizer state has a key for every
    parameter (:meth:`ShardedTopK.restoring`)."""

    def __init__(self, optimizer: Any, dormant: TopKConfig, module: nn.Module, numels: Dict[str, int]) -> None:
        super().__init__(optimizer, dormant)
        # the sharded parameters (the optimizer's), named now: between a forward and its backward FSDP2 registers the
        # unsharded ones in their place (the root's stay so), which is when manual optimization engages
        self.sharded = list(module.named_parameters())
        self.numels = numels

    def engage(self, state: TopKState, seed: bool = True) -> None:
        super().engage(state, seed)
        wd_momentum_keys(self.optimizer)

    def seeds(self, state: TopKState, bufs: Dict[int, torch.Tensor]) -> Dict[str, torch.Tensor]:
        out = {}
        for name, p in self.sharded:
            b = bufs.get(id(p))
            if b is not None and name in self.numels:
                t = local_tensor(b.detach()).float().reshape(-1)
                out[name] = nn.functional.pad(t, (0, self.numels[name] - t.numel()))
        return out


def wd_momentum_keys(optimizer: Any) -> None:
    """Weight decay's momentum share (zero where absent) for every parameter, also in groups without weight decay
    (where it stays zero): an engaged SGD keeps no other state, and torch's distributed checkpoint refuses to load a
    parameter that has no optimizer state (e.g. the biases of ``exclude_from_decay``'s group)."""
    for g in optimizer.param_groups:
        for p in g["params"]:
            st = optimizer.state[p]
            if WD_MOMENTUM not in st:
                st[WD_MOMENTUM] = torch.zeros_like(p.detach(), dtype=torch.float32)


class ShardedTopK:
    """The top-k exchange (or local SGD) of one ``fully_shard``-ed model on a ``(replicate, shard)`` mesh (see
    the module docstring). ``optimizers``: the inner optimizers (local SGD's ``outer_recipe="auto"``)."""

    def __init__(self, config: TopKConfig, module: nn.Module, mesh: Any,
                 optimizers: Optional[Sequence[Any]] = None, elastic: Optional[ElasticGroup] = None,
                 commit_gate: Optional[Callable[[bool], bool]] = None) -> None:
        check_sharding(module, mesh)
        if config.exchange in NODE_TIER:
            raise ValueError(message("fsdp_node_tier", exchange=config.exchange))
        self.config, self.module, self.mesh = config, module, mesh
        rep = mesh["replicate"]
        self.replicas, self.replica, self.local = rep.size(), rep.get_local_rank(), mesh["shard"].size()
        self.inter: Any = rep.get_group()
        self.elastic = elastic
        self.commit_gate = commit_gate
        if elastic is not None:  # torchft: the replicas are the quorum's, per step (ElasticGroup reads its size)
            if self.replicas != 1:
                raise ValueError("topk_fsdp: fault_tolerance='torchft' runs one replica group per Trainer (num_nodes=1)")
            self.inter, self.replicas, self.replica = elastic, 1, 0
        self.groups = fsdp_groups(module)
        names = {id(p): n for n, p in module.named_parameters()}
        self.specs = [([names[id(fp.sharded_param)] for fp in g.fsdp_params],
                       [fp.padded_sharded_param_size.numel() for fp in g.fsdp_params]) for _, g in self.groups]
        self.device = next(module.parameters()).device
        self.state: Optional[TopKState] = None
        self.hooks: Optional[ShardHooks] = None
        self.controller: Optional[StepController] = None
        self.outer: Optional[OuterState] = None
        self.recipe: Optional[LiveRecipe] = None  # recipe="auto"'s, once the optimizers are known (use_optimizers)
        self.recipe_note = unresolved_note(config)
        self.optimizers: List[Any] = []  # every inner optimizer seen (recipe="auto", checkpoints), in setup order
        # what crosses nodes without the per-step state (local SGD, one node): counted by after_optimizer_step
        self._totals = StepStats()
        self._shard_numel = sum(fp.sharded_size.numel() for _, g in self.groups for fp in g.fsdp_params)
        if config.local_steps > 0:
            self._attach_local(optimizers)
        elif self.replicas > 1 or elastic is not None:
            self._attach_step()
        if optimizers is not None:
            self._use_recipe(optimizers)

    # ---- per step -------------------------------------------------------------------------------------
    def _attach_step(self, exchange: Optional[str] = None) -> None:
        cfg = self.config
        st = TopKState(cfg, process_group=self.inter, num_nodes=self.replicas)
        self.hooks = ShardHooks(st, self.specs, exchange_hook)
        for slots in self.hooks.slots:  # every rank holds every key of the sharded checkpoint
            st.buffers(slots, self.device)  # type: ignore[arg-type]  # slots read as parameters (numel)
        layout = Layout(self.replicas, 1, self.replica)
        ex = exchange or cfg.exchange
        if ex == "auto" and self.elastic is not None:
            ex = "allgather"  # the replica count changes between steps: nothing to probe (as topk_ddp)
        if ex == "auto":
            st.exchange = st.exchanges["auto"] = build_auto(st, cfg, layout, self.device, saved=st.take_section("auto"))
        else:
            registry.check(cfg, layout, ex)
            st.exchange = st.exchange_for(ex, layout=layout)
        for i, (m, _) in enumerate(self.groups):
            m.set_all_reduce_hook(self.hooks.hook(i))
        self.state = st
        # one decision over every rank (the shards differ); torchft: over every process of every replica group
        # in the quorum, and the commit gate (should_commit) has the last word
        group: Any = dist.group.WORLD if self.elastic is None else ElasticGrid(self.elastic, dist.group.WORLD)
        self.controller = StepController(st, device=self.device, group=group, commit_gate=self.commit_gate)

    def carry_residuals(self) -> None:
        """One node, resuming a checkpoint that holds residuals: a dense exchange over the node's shard group of one
        sends them with the next gradient (then they are zero, and each step is FSDP's own)."""
        if self.state is None and self.outer is None:
            self._attach_step("dense")

    def use_optimizers(self, optimizers: Sequence[Any]) -> None:
        """The optimizers, once known (Fabric sets them up after the module): local SGD's outer step, or
        ``recipe="auto"``."""
        if self.outer is not None:
            self.outer.use_optimizers(optimizers)
        self._use_recipe(optimizers)

    # ---- recipe="auto" --------------------------------------------------------------------------------
    def _use_recipe(self, optimizers: Sequence[Any]) -> None:
        """Resolve ``recipe="auto"`` for every optimizer seen so far (:func:`~lightning_topk.comm.recipe.live_recipe`,
        topk_ddp's decision): a dormant :class:`ShardRecipe`, and ``exchange="auto"`` kept to the exchanges that
        support momentum correction (what topk_ddp builds it with)."""
        self.optimizers += [o for o in optimizers if all(o is not x for x in self.optimizers)]
        if self.config.recipe != "auto" or (self.recipe is not None and self.recipe.engaged):
            return
        st = self.state
        if st is None and self.config.local_steps == 0:
            self.recipe_note = "recipe=auto -> none (one node: FSDP alone, no exchange; the optimizer keeps its momentum)"
            return
        numels = {n: k for names, ks in self.specs for n, k in zip(names, ks)}  # FSDP's padded slot of each
        make = functools.partial(ShardRecipe, module=self.module, numels=numels)
        self.recipe, built, self.recipe_note = live_recipe(self.config, self.optimizers, make=make)
        if self.recipe is not None and isinstance(st.exchange, AutoExchange):  # type: ignore[union-attr]
            auto = st.exchange  # type: ignore[union-attr]
            auto.candidates = candidates_for(built, self.replicas, 1, False)
            auto.plan = {k: v for k, v in auto.plan.items() if v in auto.candidates}
        if dist.get_rank() == 0:
            log.info("topk_fsdp %s", self.recipe_note)

    def begin_step(self) -> None:
        """Before a backward: ``recipe="auto"`` engages after a step that sent sparse, then follows the optimizer's
        momentum (a scheduler may change it)."""
        if self.recipe is not None and self.state is not None:
            self.recipe.begin_step(self.state)

    @contextmanager
    def recipe_step(self, optimizer: Any) -> Iterator[None]:
        """Around the optimizer step: an engaged recipe zeroes the optimizer's momentum and weight decay for it, then
        puts the user's values back (and weight decay's momentum share on a committed step)."""
        if self.recipe is None:
            yield
            return
        saved = self.recipe.before_step(optimizer)
        try:
            yield
        finally:
            skipped = self.controller is not None and self.controller.last_decision is Decision.SKIP
            self.recipe.after_step(optimizer, saved, committed=not skipped)

    @contextmanager
    def restoring(self, engaged: bool) -> Iterator[None]:
        """Around loading the optimizer's state from a checkpoint saved with the recipe ``engaged``: that optimizer
        kept no momentum buffers, and torch's distributed state dict lays an empty optimizer's state out by one step
        with zero gradients, which would make buffers the checkpoint lacks; the optimizer's momentum is 0 meanwhile,
        and weight decay's momentum share is laid out in its place (:class:`ShardRecipe`)."""
        live = self.recipe
        opts = [o for o in self.optimizers if not o.state]
        if not engaged or (live is not None and live.engaged) or not opts:
            yield
            return
        saved = [[g["momentum"] for g in o.param_groups] for o in opts]
        for o in opts:
            for g in o.param_groups:
                g["momentum"] = 0.0
        if live is not None:
            wd_momentum_keys(live.optimizer)
        try:
            yield
        finally:
            for o, moms in zip(opts, saved):
                for g, m in zip(o.param_groups, moms):
                    g["momentum"] = m

    def restore_recipe(self, velocity: bool) -> None:
        """Loading a checkpoint saved with (``velocity``) or without velocities: an engaged run's recipe is engaged
        again, its velocity the checkpoint's (loaded next)."""
        if velocity and self.recipe is not None and not self.recipe.engaged and self.state is not None:
            self.recipe.engage(self.state, seed=False)

    def before_optimizer_step(self) -> Decision:
        """After the backward, before the optimizer step: the step's one decision (every rank alike); a skipped
        step has its residuals rolled back and its gradients dropped (the optimizer leaves every parameter)."""
        if self.controller is None or self.hooks is None:
            return Decision.COMMIT
        self.hooks.end_step()
        decision = self.controller.finish_step(self.module.named_parameters())
        if decision is Decision.SKIP:
            for p in self.module.parameters():
                p.grad = None
        return decision

    # ---- local SGD ------------------------------------------------------------------------------------
    def _attach_local(self, optimizers: Optional[Sequence[Any]]) -> None:
        named = [(n, p._local_tensor if hasattr(p, "_local_tensor") else p) for n, p in self.module.named_parameters()]
        flags: Any = dist.group.WORLD if self.elastic is None else ElasticGrid(self.elastic, dist.group.WORLD)
        self.outer = OuterState(self.config, named, inter=self.inter, flag_group=flags,
                                buffers=list(self.module.named_buffers()), optimizers=optimizers)
        if self.config.dense_steps > 0 and self.replicas > 1:  # post-local SGD: the first steps all-reduce
            for m, _ in self.groups:
                m.set_all_reduce_hook(self._synchronous_hook)

    def _synchronous_hook(self, reduce_output: torch.Tensor) -> None:
        if self.outer is not None and self.outer.synchronous:
            dist.all_reduce(reduce_output, group=self.inter)
            reduce_output.div_(self.replicas)

    def after_optimizer_step(self) -> bool:
        """After an optimizer-step attempt: local SGD counts it and runs the outer round at the H-th. Returns
        whether a round ran."""
        synchronous = self.outer is not None and self.outer.synchronous and self.replicas > 1
        ran = self.outer.step() if self.outer is not None else False
        if self.state is None:
            self._count(synchronous, ran)
        return ran

    def _count(self, synchronous: bool, ran: bool) -> None:
        """One step's bytes across nodes without the per-step exchange: the reference is HSDP's, a dense fp32 ring
        all-reduce of this rank's shard over the replicas; sent are the synchronous steps' all-reduce (local SGD's
        ``dense_steps``) and the outer rounds' packets (nothing on one node). FSDP's traffic within the node is
        HSDP's too, and not counted."""
        t, n = self._totals, self._shard_numel
        dense_wire = ring_allreduce_wire(4 * n, replica_count(self.inter)) if self.replicas > 1 or self.elastic is not None else 0
        t.numel += n
        t.bytes_dense += 4 * n
        t.bytes_dense_wire += dense_wire
        sent = wire = 0
        if synchronous:
            sent, wire = 4 * n, dense_wire
            t.numel_sent += n
        if ran and self.outer is not None and dense_wire:  # one node: the round sends nothing
            sent, wire = sent + self.outer.payload_bytes, wire + self.outer.stats.bytes
            t.numel_sent += round(self.outer.stats.density * n)
            t.comm_time_s += self.outer.stats.time_s
        t.bytes_sent += sent
        t.bytes_wire += wire
        t.bytes_inter += wire

    def totals(self) -> StepStats:
        """Telemetry summed over the run on this rank: the per-step exchange's, else what :meth:`_count` counted."""
        return self.state.totals.resolve() if self.state is not None else self._totals

    def start_training(self) -> None:
        """A fit after :meth:`end_training` in this process goes on from the state before it (local SGD streaming)."""
        if self.outer is not None:
            self.outer.resume_in_flight()

    def end_training(self) -> None:
        """Apply a streamed outer exchange still in flight (local SGD), so the final weights hold every round."""
        if self.outer is not None:
            self.outer.apply_in_flight()


# ---- what a heal between replicas of a sharded model carries (fault_tolerance="torchft") ------------------
def local_tensor(t: Any) -> Any:
    """This rank's shard of a DTensor (``to_local()``); any other tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def local_module_state(module: nn.Module) -> Dict[str, torch.Tensor]:
    """Copies of this rank's part of ``module.state_dict()``: each parameter's local shard (a DTensor's
    ``to_local()``; an unsharded module's tensors whole), each buffer whole (FSDP replicates buffers)."""
    return {k: local_tensor(v).detach().clone() for k, v in module.state_dict().items()}


def load_local_module_state(module: nn.Module, sd: Dict[str, torch.Tensor]) -> None:
    """Copy a peer's :func:`local_module_state` (the same rank of another replica: the same shards) into
    ``module`` in place (the optimizers and FSDP keep their tensors)."""
    own = module.state_dict()
    if own.keys() != sd.keys():
        raise RuntimeError(f"the peer's module state has other entries than this model's "
                           f"({sorted(set(own) ^ set(sd))[:8]})")
    bad = [f"{k}: {tuple(sd[k].shape)} there, {tuple(local_tensor(v).shape)} here" for k, v in own.items()
           if tuple(sd[k].shape) != tuple(local_tensor(v).shape)]
    if bad:  # before any copy: the module is left as it was
        raise RuntimeError(f"the peer's module state does not fit this model ({'; '.join(bad[:4])})")
    with torch.no_grad():
        for k, v in own.items():
            local_tensor(v).copy_(sd[k])


def local_optimizer_state(optimizer: Any) -> Dict[str, Any]:
    """``optimizer.state_dict()`` with every DTensor replaced by a copy of its local shard; ``"dtensor"`` lists the
    (parameter index, key) entries that were DTensors (scalars such as Adam's ``step`` stay plain tensors)."""
    import copy

    sd = optimizer.state_dict()
    state: Dict[Any, Dict[str, Any]] = {}
    marked: List[Tuple[Any, str]] = []
    for i, entry in sd["state"].items():
        state[i] = {}
        for k, v in entry.items():
            if hasattr(v, "to_local"):
                marked.append((i, k))
            state[i][k] = local_tensor(v).detach().clone() if torch.is_tensor(v) else copy.deepcopy(v)
    return {"state": state, "param_groups": copy.deepcopy(sd["param_groups"]), "dtensor": marked}


def load_local_optimizer_state(optimizer: Any, sd: Dict[str, Any]) -> None:
    """Load a peer's :func:`local_optimizer_state` into ``optimizer`` (also one without state yet): the marked
    entries become DTensors again, laid out as their parameter is."""
    from torch.distributed.tensor import DTensor

    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = {i: dict(entry) for i, entry in sd["state"].items()}
    for i, k in sd["dtensor"]:
        p = params[i]
        state[i][k] = DTensor.from_local(state[i][k], p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                                         run_check=False)
    optimizer.load_state_dict({"state": state, "param_groups": sd["param_groups"]})
