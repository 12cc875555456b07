"""Replica groups that come and go: ``TopKDDPStrategy(fault_tolerance="torchft")`` (``docs/elastic.md``).

torchft is the engine. Each Trainer is one replica group (``num_nodes=1``; ``devices`` processes). A torchft
``Manager`` per process (the group's rank 0 serves the group) forms the quorum with the lighthouse at the start of
every step and reconfigures torchft's ``ProcessGroupGloo`` over the replicas in it, one per local rank. The top-k
exchange's flat group is that process group, wrapped in :class:`~lightning_topk.comm.elastic.ElasticGroup`
(world size = the quorum's participants), so each step averages over the replicas present; with several processes
per group, each bucket is first averaged over the group's own ranks (torch's process group), so every rank of a
group holds the same gradient, residuals and result. The step controller's decision and ``Manager.should_commit`` are one
decision (:class:`TorchFTReplica.commit` is the controller's commit gate): a step either side refuses changes
nothing (parameters, optimizer state, residuals: the undo log). A group that (re)starts behind the others heals
from a live peer through torchft's checkpoint transport before its first step: parameters and buffers,
optimizer state, the top-k state without residuals (its residual mass died with it) and the step counters;
nothing is read from disk. Lightning's LR schedulers and step count come along (``max_steps`` stays aligned).

The first quorum runs at the strategy's setup, before the fit loop builds its data loader, so a joining group
also takes the peers' data position (Lightning's loop progress and resumable loaders' state). Under local SGD
(``local_steps`` > 0) there is no quorum per inner step: each outer round forms one at its end
(:mod:`lightning_topk.comm.local.elastic_round`), the heal carries the outer state without the error feedback,
and a round the quorum does not commit is rolled back.

Sharded models (``TopKFSDPStrategy(fault_tolerance="torchft")``, ``_elastic_sharded``): each rank's torchft process
group connects the ranks that hold the same shard, and a heal carries this rank's shards (parameters and sharded
optimizer state as local tensors: :func:`~lightning_topk.comm.sharded.local_module_state`); at step 0 torchft's
source for rank r is the quorum's replica r mod R for every group, so all groups start with the same shards.

Lightning Fabric (:mod:`lightning_topk.lightning.fabric`) has no hook before the user's forward: each step's quorum
runs at the end of the previous optimizer step, the first at ``fabric.setup``; the user's loop takes its data
position from the strategy's ``topk_elastic_position`` (docs/elastic.md, "Lightning Fabric").

Here: :class:`TorchFTReplica` (the Manager, its process group and store, the lighthouse check, telemetry) and
:class:`ElasticMixin` (the strategy's hooks: start, one quorum per step, teardown).
"""
from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from lightning_topk.comm.config import TopKConfig
from lightning_topk.comm.elastic import ElasticGroup
from lightning_topk.comm.local.elastic_round import elastic_round, heal_from, heal_section
from lightning_topk.comm.sharded import (
    load_local_module_state,
    load_local_optimizer_state,
    local_module_state,
    local_optimizer_state,
    local_tensor,
)
from lightning_topk.lightning import support_cell
from lightning_topk.lightning.elastic_end import Farewell, owed_batches
from lightning_topk.lightning.elastic_lighthouse import MIN_REPLICAS_ENV, check_lighthouse, lighthouse_address
from lightning_topk.lightning.elastic_position import data_position, loop_position, set_global_step
from lightning_topk.optional import require
from lightning_topk.support import message

log = logging.getLogger(__name__)

#: the replica group's name (torchft appends a unique suffix to each start); default: host and process id
REPLICA_ID_ENV = "REPLICA_GROUP_ID"


class TorchFTReplica:
    """This process's replica group under torchft: the Manager, the process group the exchange runs on, and what
    a heal sends and receives (``state_dict``/``load_state_dict`` callables of the strategy).

    Telemetry (:meth:`metrics`): quorum size of the last step, quorum changes, steps not committed, heals and
    the last heal's time, failed collectives, and the residual mass this replica holds unsent (what its death
    would lose; one host read, on logging steps only).
    """

    def __init__(self, config: TopKConfig, state_dict: Callable[[], Dict[str, Any]],
                 load_state_dict: Callable[[Dict[str, Any]], None],
                 residual_mass: Optional[Callable[[], float]] = None, name: str = "topk_ddp",
                 fingerprint: Optional[Callable[[], float]] = None) -> None:
        self.config = config
        self.name = name  # the strategy's, in messages
        self._residual_mass = residual_mass
        self._fingerprint = fingerprint
        self._state_dict = state_dict
        self._load_state_dict = load_state_dict
        self.manager: Any = None
        self.group: Optional[ElasticGroup] = None
        self._store: Any = None
        self.quorum_size = 0
        self.quorum_sizes: List[int] = []  # per step, this run (telemetry; small: one int per step)
        self.quorum_changes = 0
        self.uncommitted = 0
        self.committed = 0
        self.heals = 0
        self.heal_time_s = 0.0
        self._healing_t0: Optional[float] = None
        self._quorum_id: Optional[int] = None
        self.replica_id = ""
        self.lighthouse = ""
        # the members of the last quorum (torchft's replica ids, one per start of a replica group), and what
        # leaving ones took with them: see _note_members
        self.members: List[str] = []
        self._new_members: Optional[List[str]] = None
        self.replicas_lost = 0
        self.replicas_joined = 0
        self.residual_mass_at_loss = 0.0
        self.data_position: Dict[str, int] = {}  # where a join's heal put the fit loop (epoch, batch, steps)
        self._final_step = 0
        self.farewell = Farewell(self)  # how the run ends (elastic_end)

    # ---- life ------------------------------------------------------------------------------------
    def check(self) -> None:
        """Before any process group: torchft installed, and a lighthouse answering (errors name what to do)."""
        require("torchft", "ft", "fault_tolerance='torchft'")  # the install hint before anything else
        addr = self.lighthouse = lighthouse_address(self.config)
        check_lighthouse(addr, self.config.ft_connect_timeout)

    def join(self, group_rank: int = 0, group_size: int = 1) -> None:
        """This process's Manager (``group_rank`` of ``group_size`` processes of the replica group; with several,
        torch's default process group is the group's own and must exist), its torchft process group and the
        :class:`ElasticGroup` the exchange runs on."""
        cfg = self.config
        from torch.distributed import TCPStore
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo

        host = os.environ.get("LIGHTNING_TOPK_FT_HOST") or socket.gethostname()
        replica_id = os.environ.get(REPLICA_ID_ENV) or f"{host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        if group_rank == 0:
            # The replica group's own store: its manager's address, and the quorum's gloo rendezvous when this group
            # is the quorum's first replica (the others connect to it: it must be reachable from them).
            self._store = TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=cfg.ft_timeout))
            store_host, store_port = host, self._store.port
        if group_size > 1:  # the group's other ranks learn the store and the replica id from rank 0
            shared = [f"{store_host}|{store_port}|{replica_id}" if group_rank == 0 else None]
            dist.broadcast_object_list(shared, src=0)
            store_host, port, replica_id = str(shared[0]).split("|", 2)
            store_port = int(port)
        self.replica_id = replica_id
        pg = ProcessGroupGloo(timeout=timedelta(seconds=cfg.ft_timeout))
        self.manager = manager = Manager(
            pg=pg, load_state_dict=self._load, state_dict=self._save, min_replica_size=cfg.min_replicas,
            use_async_quorum=False,  # the quorum (and a heal) completes before the forward pass
            timeout=timedelta(seconds=cfg.ft_timeout), quorum_timeout=timedelta(seconds=cfg.ft_quorum_timeout),
            connect_timeout=timedelta(seconds=cfg.ft_connect_timeout), rank=group_rank, world_size=group_size,
            store_addr=store_host, store_port=store_port, lighthouse_addr=self.lighthouse, replica_id=replica_id,
            hostname=host,
        )
        manager._client = _QuorumTap(manager._client, self._tap)  # the quorum's members (telemetry)
        m = self.manager
        intra = None
        if group_size > 1:
            intra = dist.group.WORLD
        self.group = ElasticGroup(pg, size=m.num_participants, rank=m.participating_rank, on_error=m.report_error,
                                  errored=m.errored, intra=intra)
        log.info("%s: replica group %s (rank %d of %d) joined torchft (lighthouse %s, min_replicas %d)",
                 self.name, replica_id, group_rank, group_size, self.lighthouse, cfg.min_replicas)

    def shutdown(self) -> None:
        m, self.manager = self.manager, None
        if m is not None:
            self._final_step = int(m.current_step())  # ft/step after the fit (telemetry)
            m.shutdown(wait=False)
        self._store = None

    # ---- one step --------------------------------------------------------------------------------
    def begin_step(self) -> bool:
        """Before the forward pass: the quorum of this step (a heal from a peer, when this group is behind).
        Returns whether this process healed."""
        m = self.manager
        t0 = time.monotonic()
        try:
            m.start_quorum()
        except HealError:
            raise
        except Exception as e:
            theirs = os.environ.get(MIN_REPLICAS_ENV)
            lh = (f"the lighthouse's --min_replicas={theirs}" if theirs else "the lighthouse's own --min_replicas "
                  "(python -m lightning_topk.app.elastic_launch --min_replicas N; its log says 'need min_replicas N')")
            raise RuntimeError(
                f"{self.name}: torchft quorum failed for replica group {self.replica_id!r} at step {m.current_step()} "
                f"({e}): fewer replica groups joined the lighthouse {self.lighthouse} within ft_quorum_timeout="
                f"{self.config.ft_quorum_timeout:g} s than a quorum needs, the larger of the strategy's min_replicas="
                f"{self.config.min_replicas} and {lh} (the last quorum had {self.quorum_size}), or the lighthouse is "
                "gone (docs/elastic.md)") from e
        healed = self._healing_t0 is not None  # set by _load during this quorum
        if healed:
            self.heal_time_s = time.monotonic() - t0
            self.heals += 1
            self._healing_t0 = None
            log.warning("%s: replica group healed from a live peer at step %d in %.2f s", self.name, m.current_step(),
                        self.heal_time_s)
        n = m.num_participants()
        qid = getattr(m, "_quorum_id", None)
        changed = self._quorum_id is None or qid != self._quorum_id
        if self._quorum_id is not None and changed:
            self.quorum_changes += 1
            log.warning("%s: quorum changed at step %d: %d replica group(s) now", self.name, m.current_step(), n)
        self._quorum_id = qid
        self._note_members()
        self.quorum_size = n
        self.quorum_sizes.append(n)
        if changed and n > 1:
            self._check_agreement(n)
        return healed

    def _check_agreement(self, n: int) -> None:
        """After a quorum with new members: its replicas hold the same weights (a float64 fingerprint gathered).
        torchft heals only a replica that is behind, so groups that committed the same steps in separate quorums
        (staggered starts, ``min_replicas`` at most half of the groups) would train apart for good, silently."""
        if self._fingerprint is None or self.group is None:
            return
        mine = torch.tensor([self._fingerprint()], dtype=torch.float64)
        every = torch.empty(n, dtype=torch.float64)
        self.group.all_gather(every, mine).wait()
        if self.manager.errored() is None and bool((every != every[0]).any()):
            raise RuntimeError(
                f"{self.name}: the {n} replica groups of the quorum at step {self.manager.current_step()} hold "
                f"different weights (fingerprints {every.tolist()}): they committed the same steps in separate quorums "
                "before meeting, which torchft does not heal (it heals only a replica that is behind). Set "
                "min_replicas to more than half of the replica groups you start (then no two quorums can form at "
                f"once; min_replicas={self.config.min_replicas} now), and start them together (docs/elastic.md, "
                "\"Split quorums\")")

    def commit(self, ok: bool) -> bool:
        """The controller's commit gate: ``ok`` is its verdict; torchft's ``should_commit`` has the last word."""
        m = self.manager
        if not ok:
            m.report_error(RuntimeError("the step controller skipped this step"))
        committed = bool(m.should_commit())
        if committed:
            self.committed += 1
        elif ok:
            self.uncommitted += 1
        return committed

    @property
    def step(self) -> int:
        """Committed steps of the replicas (torchft's step counter; a healed group takes its peer's)."""
        return self._final_step if self.manager is None else int(self.manager.current_step())

    def metrics(self) -> Dict[str, float]:
        return {"ft/quorum_size": float(self.quorum_size), "ft/quorum_changes": float(self.quorum_changes),
                "ft/uncommitted_steps": float(self.uncommitted), "ft/heals": float(self.heals),
                "ft/heal_time_s": float(self.heal_time_s), "ft/step": float(self.step),
                "ft/failed_collectives": float(self.group.failures if self.group is not None else 0),
                # what this replica's error feedback holds unsent (L1): the mass lost if it dies now
                "ft/residual_mass": float(self._residual_mass()) if self._residual_mass is not None else 0.0,
                "ft/replicas_lost": float(self.replicas_lost), "ft/replicas_joined": float(self.replicas_joined),
                # this survivor's own unsent mass when the last replicas left (a proxy of what each of them held:
                # the lost ones' own mass is not measured by anyone)
                "ft/residual_mass_at_loss": float(self.residual_mass_at_loss)}

    def _tap(self, members: List[str], behind: bool) -> None:
        self._new_members = members  # torchft's quorum thread; read in begin_step once the quorum is done
        self.farewell.heals = behind  # a member of this quorum heals in it (elastic_end.Farewell.barrier)

    def _note_members(self) -> None:
        """Count the replica groups that left the quorum since the last one (their error feedback died with
        them) and those that joined; at a loss, note this replica's own unsent mass (one host read)."""
        new, self._new_members = self._new_members, None
        if new is None:
            return
        if self.members:
            lost = [r for r in self.members if r not in new]
            self.replicas_lost += len(lost)
            self.replicas_joined += len([r for r in new if r not in self.members])
            if lost:
                self.residual_mass_at_loss = float(self._residual_mass()) if self._residual_mass is not None else 0.0
                log.warning("%s: replica group(s) %s left the quorum; their unsent error feedback is lost "
                            "(this replica's own: L1 %.4g)", self.name, ", ".join(lost), self.residual_mass_at_loss)
        self.members = list(new)

    # ---- heal ------------------------------------------------------------------------------------
    def _save(self) -> Dict[str, Any]:
        return self._state_dict()

    def _load(self, sd: Dict[str, Any]) -> None:
        self._healing_t0 = time.monotonic()
        try:
            self._load_state_dict(sd)
        except Exception as e:  # the peer's state does not fit this group: not a quorum failure
            raise HealError(
                f"{self.name}: replica group {self.replica_id!r} received a peer's state in its heal at step "
                f"{self.manager.current_step()} but could not apply it: {e}. Every replica group must train the same "
                "model with the same optimizer and options (was this one started with another model width or "
                "configuration?)") from e


class HealError(RuntimeError):
    """A heal whose state (a live peer's) does not fit this replica group: another model or configuration."""


class _QuorumTap:
    """torchft's manager client, with each quorum's member ids, and whether any member is behind (heals in it),
    handed to ``sink`` (torchft's ``Manager`` keeps neither); every other attribute is the client's."""

    def __init__(self, client: Any, sink: Callable[[List[str], bool], None]) -> None:
        self._client = client
        self._sink = sink

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        q = self._client._quorum(*args, **kwargs)
        behind = int(getattr(q, "max_world_size", 0)) < int(getattr(q, "replica_world_size", 0))
        self._sink([str(r) for r in getattr(q, "replica_ids", [])], behind)
        return q

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


class ElasticMixin:
    """The strategy's side of ``fault_tolerance="torchft"`` (see the module docstring): starts the replica after
    the (one-process) process group exists, runs a quorum before each training batch, closes it at teardown."""

    topk_elastic: Optional[TorchFTReplica] = None
    #: the model is sharded over the group's processes (topk_fsdp): each rank heals its own shards
    _elastic_sharded = False

    def _elastic_replica(self, name: str) -> None:
        """Before any process group: one Trainer (or Fabric) per replica group, torchft installed, a lighthouse
        answering."""
        if self.num_nodes != 1:  # type: ignore[attr-defined]
            raise ValueError(
                f"{name}: fault_tolerance='torchft' runs one Trainer (or Fabric) per replica group (num_nodes=1, got "
                f"num_nodes={self.num_nodes}; devices may be several): start one per node (docs/elastic.md)")  # type: ignore[attr-defined]
        self.topk_elastic = TorchFTReplica(self.topk_config, self._elastic_state_dict,  # type: ignore[attr-defined]
                                           self._elastic_load_state_dict, self._elastic_residual_mass, name=name,
                                           fingerprint=self._elastic_fingerprint)
        self.topk_elastic.check()  # a missing lighthouse fails before any process group

    def setup_distributed(self) -> None:
        self._elastic_prepare()
        super().setup_distributed()  # type: ignore[misc]
        self._elastic_start()

    def _elastic_prepare(self) -> None:
        """topk_ddp, before the process group: check the options, make the replica, check the lighthouse."""
        cfg = self.topk_config  # type: ignore[attr-defined]
        support_cell.check(self)
        if cfg.elastic:
            if cfg.local_steps > 0 and self.num_processes > 1:  # type: ignore[attr-defined]
                raise ValueError(message("ft_ddp_local_procs", layout=f"1x{self.num_processes}"))  # type: ignore[attr-defined]
            kw = self._ddp_kwargs  # type: ignore[attr-defined]
            if kw.get("static_graph"):
                raise ValueError("topk_ddp: fault_tolerance='torchft' does not support static_graph=True (it rebuilds "
                                 "DDP's buckets after the first iteration; see find_unused_parameters in docs/elastic.md)")
            # Every replica's buckets must lay the parameters out alike: the packets' indices are positions in the
            # bucket. DDP rebuilds its buckets after a process's first iteration (in gradient-ready order), so a
            # replica that joins mid-run would step once with the initial layout while its peers use the rebuilt
            # one (seen: its first step's gradient differed). With find_unused_parameters DDP never rebuilds.
            kw["find_unused_parameters"] = True
            self._elastic_replica("topk_ddp")

    def _elastic_start(self) -> None:
        """After the process group: this process's Manager and torchft process group."""
        if self.topk_elastic is not None:
            self.topk_elastic.join(self.global_rank, self.world_size)  # type: ignore[attr-defined]

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)  # type: ignore[misc]
        if self.topk_elastic is not None and getattr(trainer.state, "fn", None) == "fit":
            self._elastic_join()

    def _elastic_join(self) -> None:
        """This process's first quorum, before the fit loop sets up its data: a replica group that is behind
        heals here from a live peer, its data position included (Lightning's loop progress and the resumable
        loaders' state, which the fit loop then applies as on a resume; :meth:`_elastic_load_state_dict`).
        Per step: this quorum is the first training batch's (that batch runs no other). Local SGD: a join round
        follows at once (:func:`~lightning_topk.comm.local.elastic_round.elastic_round` with ``join``: this
        replica sends nothing and takes the round's outer step), so the peers' round that formed this quorum has
        its collectives; the inner steps then start at the peers' position."""
        ft = self.topk_elastic
        assert ft is not None
        outer = self._elastic_outer()
        self._elastic_joining = True
        try:
            if outer is not None:
                outer.gate = _RoundGate(self)
                elastic_round(outer, join=True)
                self._elastic_first_quorum = None
            else:
                self._elastic_first_quorum = ft.begin_step()  # the first batch's quorum
        finally:
            self._elastic_joining = False

    def _elastic_outer(self) -> Any:
        """Local SGD's outer state (``local_steps`` > 0), or None."""
        state = self.topk_state  # type: ignore[attr-defined]
        return getattr(state.exchange, "outer", None) if state is not None and state.exchange is not None else None

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.topk_elastic is not None and self._elastic_outer() is None:  # per step: a quorum per training batch
            self._elastic_step_quorum()
        parent = getattr(super(), "on_train_batch_start", None)
        if parent is not None:
            parent(batch, batch_idx)

    def _elastic_step_quorum(self) -> None:
        """The quorum of the step about to run (the join's, when it formed one and no step used it yet), then,
        with several processes per group, the group's sync after a heal."""
        ft = self.topk_elastic
        assert ft is not None
        first, self._elastic_first_quorum = getattr(self, "_elastic_first_quorum", None), None
        trainer = getattr(self.lightning_module, "_trainer", None)  # type: ignore[attr-defined]
        try:
            healed = ft.begin_step() if first is None else first
        except RuntimeError as e:
            ft.farewell.quorum_failed(trainer, e)  # on the run's last step: ends the fit (elastic_end)
            raise
        if ft.group is not None and ft.group.intra is not None:
            self._elastic_group_sync(healed, ft.group.intra)
        ft.farewell.after_quorum(trainer, healed)  # the batches owed after a heal; the end after the peers'

    def _elastic_group_sync(self, healed: bool, intra: Any) -> None:
        """Several processes per group: after a heal on any of its ranks, the group's rank 0 state is the group's.
        torchft picks each rank's heal source by its rank in the group, and at step 0 (``init_sync``) the source of
        rank r is the quorum's replica r: a group's ranks could start from different replicas' initial weights
        (seen in the 2 x 2 test). Later heals take any up-to-date replica, all identical. One tiny all-reduce per
        step; the broadcast only after a heal."""
        flag = torch.tensor([1.0 if healed else 0.0], device=self.root_device)  # type: ignore[attr-defined]
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=intra)
        if float(flag.item()) == 0.0:
            return
        module = self.lightning_module  # type: ignore[attr-defined]
        with torch.no_grad():
            # sharded (topk_fsdp): each rank healed its own shards from the same rank of a peer; at step 0 rank r's
            # source is the quorum's replica r mod R, the same for every replica group, so every group ends with
            # the same shards. The buffers are whole on every rank: rank 0's.
            for t in [*([] if self._elastic_sharded else module.parameters()), *module.buffers()]:
                dist.broadcast(t.data, src=0, group=intra)
            if self._elastic_sharded:
                return
        opts = self.optimizers  # type: ignore[attr-defined]
        shared: List[Any] = [[o.state_dict() for o in opts] if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(shared, src=0, group=intra)
        for o, osd in zip(opts, shared[0]):
            o.load_state_dict(osd)

    def on_train_end(self) -> None:
        getattr(super(), "on_train_end", lambda: None)()
        if self.topk_elastic is not None and self._elastic_outer() is None:  # per step: the farewell quorum
            self.topk_elastic.farewell.leave(getattr(self.lightning_module, "_trainer", None))  # type: ignore[attr-defined]

    def teardown(self) -> None:
        try:
            super().teardown()  # type: ignore[misc]
        finally:
            if self.topk_elastic is not None:
                self.topk_elastic.shutdown()

    def _elastic_gate(self) -> Optional[Callable[[bool], bool]]:
        """The step controller's commit gate: torchft's ``should_commit`` per step; none under local SGD (the
        inner steps are this replica's own; the outer round commits through :class:`_RoundGate`)."""
        if self.topk_elastic is None or self.topk_config.local_steps > 0:  # type: ignore[attr-defined]
            return None
        return self.topk_elastic.commit

    def _elastic_residual_mass(self) -> float:
        """The L1 norm of the error feedback this replica holds unsent: the per-step residuals, or local SGD's
        outer error feedback (in pseudo-gradient units)."""
        outer = self._elastic_outer()
        if outer is not None:
            return float(outer.ef.abs().sum())
        state = self.topk_state  # type: ignore[attr-defined]
        if state is None:
            return 0.0
        return float(sum(float(r.abs().sum()) for r in state.residuals().values()))

    def _elastic_fingerprint(self) -> float:
        """What every replica of a quorum holds alike between steps, summed in float64: θ_outer under local SGD (the
        parameters move apart inside a round), else this rank's parameters (its shards under topk_fsdp)."""
        outer = self._elastic_outer()
        if outer is not None:
            return float(outer.theta.double().sum())
        params = self.lightning_module.parameters()  # type: ignore[attr-defined]
        return float(sum(float(local_tensor(p).detach().double().sum()) for p in params))

    # ---- what a heal carries ---------------------------------------------------------------------
    def _elastic_schedulers(self) -> List[Any]:
        """The LR schedulers a heal carries: the Trainer's (Fabric: the one passed to ``fabric.setup``)."""
        trainer = getattr(self.lightning_module, "_trainer", None)  # type: ignore[attr-defined]
        return [c.scheduler for c in trainer.lr_scheduler_configs] if trainer is not None else []

    def _elastic_state_dict(self) -> Dict[str, Any]:
        """Parameters and buffers, optimizer state, the top-k state without this replica's residuals, velocities
        and owner residuals (error feedback is per replica: a copy would count the peer's unsent mass twice) and the
        Trainer's step count. Copies: the transport serves them while this replica goes on stepping."""
        import copy

        module = self.lightning_module  # type: ignore[attr-defined]
        state = self.topk_state  # type: ignore[attr-defined]
        outer = self._elastic_outer()
        topk = state.state_dict() if state is not None else None
        if topk is not None:
            topk["residual"], topk["velocity"] = {}, {}
            topk.get("exchanges", {}).pop("local", None)  # local SGD: the outer state goes as "outer" (below)
            # the scale-free exchange's owner residuals are this replica's unsent mass too
            topk["exchanges"] = {n: {k: v for k, v in sec.items() if k != "owner_residual"}
                                 for n, sec in topk.get("exchanges", {}).items()}
        trainer = getattr(module, "_trainer", None)
        schedulers = [copy.deepcopy(s.state_dict()) for s in self._elastic_schedulers()]
        at_round_end = getattr(self, "_elastic_round_end", False)
        # copies of this rank's tensors (under topk_fsdp its shards, as plain tensors: a peer's same rank holds the same)
        mod, opts = local_module_state(module), [local_optimizer_state(o) for o in self.optimizers]  # type: ignore[attr-defined]
        live = getattr(self, "topk_live_recipe", None)
        return {
            "module": mod,
            "optimizers": opts,
            "schedulers": schedulers,
            "topk": topk,
            # local SGD: θ_outer, outer momentum, the round's buffer anchor, position, step and round counts
            # (not this replica's error feedback: comm.local.elastic_round.heal_section)
            "outer": heal_section(outer) if outer is not None else None,
            # at a round end the quorum runs inside the H-th inner step's optimizer step: it counts as done
            "global_step": (int(trainer.global_step) + int(at_round_end)) if trainer is not None else 0,
            # the data position: Lightning's loop progress and the resumable loaders' state (fit_loop's
            # checkpoint), for a replica that joins (_elastic_join)
            "loop": data_position(trainer, at_round_end) if trainer is not None else None,
            # recipe="auto" runs SGD's momentum and weight decay in the hook from this replica's next step on (its
            # velocities are not sent: a replica decides this from its own last step, which a healed one lacks)
            "recipe_engages": bool(live is not None and state is not None and live.engages(state)),
        }

    def _elastic_load_state_dict(self, sd: Dict[str, Any]) -> None:
        module = self.lightning_module  # type: ignore[attr-defined]
        load_local_module_state(module, sd["module"])  # in place: the optimizers, DDP and FSDP keep their tensors
        for opt, osd in zip(self.optimizers, sd["optimizers"]):  # type: ignore[attr-defined]
            load_local_optimizer_state(opt, osd)
        state = self.topk_state  # type: ignore[attr-defined]
        outer = self._elastic_outer()
        if state is not None and sd.get("topk") is not None:
            if outer is not None:  # the exchange's own section would replace this replica's error feedback
                sd["topk"].get("exchanges", {}).pop("local", None)
            self._load_topk_state(state, sd["topk"])  # type: ignore[attr-defined]
        live = getattr(self, "topk_live_recipe", None)
        if state is not None and live is not None and sd.get("recipe_engages") and not live.engaged:
            # as the peer does from this step on; the velocity starts from the optimizer's momentum buffers just
            # loaded (the peer's, when it engages now; none once it has). Dormant, this replica would step with the
            # optimizer's own momentum and weight decay while its peers run them in the hook.
            live.engage(state)
        if outer is not None and sd.get("outer") is not None:
            heal_from(outer, sd["outer"])
        for sched, ssd in zip(self._elastic_schedulers(), sd.get("schedulers", [])):
            sched.load_state_dict(ssd)
        trainer = getattr(module, "_trainer", None)
        if trainer is not None:
            position = loop_position(sd["loop"]) if sd.get("loop") is not None else {}
            joining = getattr(self, "_elastic_joining", False)
            if joining and any(position.values()):
                # joining: the fit loop has not started; it resumes at the peer's position (as from a checkpoint).
                # A peer at the very start (every group's heal at step 0) has no position to give.
                trainer.fit_loop.load_state_dict(sd["loop"])
                self.topk_elastic.data_position = position  # type: ignore[union-attr]
            elif not joining:  # a heal mid-run: the step count (at its own round end, Lightning counts the step in flight after) and, per step, the batches owed (elastic_end)
                round_end = getattr(self, "_elastic_round_end", False)
                set_global_step(trainer, int(sd.get("global_step", 0)) - int(round_end))
                self.topk_elastic.farewell.owed = 0 if round_end else owed_batches(trainer, sd.get("loop"))  # type: ignore[union-attr]


class _RoundGate:
    """Local SGD's round under torchft (:func:`~lightning_topk.comm.local.elastic_round.elastic_round`): the
    round's quorum (a heal from a peer when this replica is behind) and torchft's ``should_commit``."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    def begin(self) -> bool:
        s = self.strategy
        s._elastic_round_end = not getattr(s, "_elastic_joining", False)  # what a peer healing from us takes
        try:
            return bool(s.topk_elastic.begin_step())
        finally:
            s._elastic_round_end = False

    def commit(self, ok: bool) -> bool:
        return bool(self.strategy.topk_elastic.commit(ok))
