"""The flat exchange's group when replicas come and go (``fault_tolerance="torchft"``): :class:`ElasticGroup`.

Torch only. It wraps a reconfigurable process group (torchft's ``ProcessGroupGloo``, which a torchft ``Manager``
reconfigures at each quorum change) and the quorum's size and rank, read from callables so that this module
never imports torchft. The exchanges (:mod:`~lightning_topk.comm.exchanges.kit`, the dense hook, the scale-free
exchange) and the :class:`~lightning_topk.comm.controller.StepController` call :func:`group_size`, :func:`group_rank`,
:func:`all_reduce`, :func:`all_gather` and :func:`all_to_all` instead of ``torch.distributed``'s functions, which take it like any
group.

A collective that fails (a replica died mid-step, a timeout) does not raise into DDP's backward: the error goes
to ``on_error`` (the Manager's ``report_error``, so that ``should_commit`` says no), the output is filled with
values that decode (an all-gather: this rank's packet in every slot; an all-reduce: this rank's input), and
every later collective of the step is skipped the same way. The step is then rolled back on this replica, and
torchft heals any replica whose committed step count fell behind at the next quorum.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ReduceOp

try:  # the option objects of a process group's own collectives (not re-exported by torch.distributed)
    from torch._C._distributed_c10d import AllgatherOptions, AllreduceOptions, AllToAllOptions
except ImportError:  # a torch built without distributed support: no elastic group can exist
    AllgatherOptions = AllreduceOptions = AllToAllOptions = None  # type: ignore[assignment,misc]

log = logging.getLogger(__name__)

# torch >= 2.13 renames all_gather_into_tensor (deprecated) to all_gather_single.
_dist_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class ElasticWork:
    """A collective in flight on an :class:`ElasticGroup`: ``wait()`` and ``get_future()`` as a ``dist.Work``,
    but a failure is reported to the group (and the output filled by ``fallback``) instead of raised."""

    def __init__(self, group: "ElasticGroup", work: Any, fallback: Callable[[], None]) -> None:
        self._group = group
        self._work = work
        self._fallback = fallback
        self._settled = work is None
        if work is None:
            fallback()

    def _fail(self, e: BaseException) -> None:
        if not self._settled:
            self._settled = True
            self._group.fail(e)
            self._fallback()

    def wait(self, timeout: Any = None) -> bool:
        if self._settled:
            return True
        try:
            self._work.wait()
        except Exception as e:  # a lost peer, a timeout, an aborted group
            self._fail(e)
        self._settled = True
        return True

    def get_future(self) -> torch.futures.Future:
        if self._settled:
            fut: torch.futures.Future = torch.futures.Future()
            fut.set_result(None)
            return fut

        def settle(done: torch.futures.Future) -> None:
            try:
                done.wait()
            except Exception as e:
                self._fail(e)
            self._settled = True

        try:
            return self._work.get_future().then(settle)
        except Exception as e:
            self._fail(e)
            return self.get_future()


class ElasticGroup:
    """A reconfigurable process group over the replicas of the current quorum (see the module docstring).

    Args:
        pg: the process group (torchft's ``ProcessGroupGloo``: ``allreduce`` and
            ``allgather_into_tensor_coalesced`` with torch's option objects).
        size: the number of replicas that average this step (torchft: ``Manager.num_participants``).
        rank: this replica's rank in the quorum (torchft: ``Manager.participating_rank``).
        on_error: told of a failed collective (torchft: ``Manager.report_error``).
        errored: whether this step already failed (torchft: ``Manager.errored``): later collectives are skipped.
        intra: with several processes per replica group, the group's own (torch) process group: each bucket is
            averaged over it before the exchange between groups (:func:`~lightning_topk.comm.exchanges.elastic_exchange_hook`);
            ``None`` with one process per group.
    """

    def __init__(self, pg: Any, size: Callable[[], int], rank: Callable[[], Optional[int]],
                 on_error: Callable[[BaseException], None], errored: Callable[[], Any], intra: Any = None) -> None:
        self.pg = pg
        self.intra = intra
        self._size = size
        self._rank = rank
        self._on_error = on_error
        self._errored = errored
        self.failures = 0  # collectives that failed (telemetry)

    def size(self) -> int:
        return max(1, int(self._size()))

    def rank(self) -> int:
        r = self._rank()
        return 0 if r is None else int(r)

    def fail(self, e: BaseException) -> None:
        self.failures += 1
        log.warning("topk_ddp: a collective between replicas failed, the step will not commit: %s", e)
        self._on_error(e if isinstance(e, Exception) else RuntimeError(str(e)))

    def all_reduce(self, t: Tensor) -> ElasticWork:
        """Sum ``t`` in place over the quorum (asynchronous)."""
        if self._errored() is not None:
            return ElasticWork(self, None, lambda: None)
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM  # type: ignore[assignment]  # torch's stub types the field as ReduceOp
        try:
            work = self.pg.allreduce([t], opts)
        except Exception as e:
            self.fail(e)
            return ElasticWork(self, None, lambda: None)
        return ElasticWork(self, work, lambda: None)

    def all_gather(self, out: Tensor, inp: Tensor) -> ElasticWork:
        """Gather ``inp`` of every replica into ``out`` (``size() * inp.numel()`` entries; asynchronous)."""

        def own_packet_everywhere() -> None:
            out.view(-1, inp.numel()).copy_(inp.view(1, -1))

        if self._errored() is not None:
            return ElasticWork(self, None, own_packet_everywhere)
        try:
            work = self.pg.allgather_into_tensor_coalesced([out], [inp], AllgatherOptions())
        except Exception as e:
            self.fail(e)
            return ElasticWork(self, None, own_packet_everywhere)
        return ElasticWork(self, work, own_packet_everywhere)


    def all_to_all(self, out: Tensor, inp: Tensor) -> ElasticWork:
        """``dist.all_to_all_single`` with equal splits over the quorum (asynchronous): the scale-free exchange."""

        def own_slots_everywhere() -> None:
            out.copy_(inp)  # decodes (this rank's own slots from every peer); the step does not commit

        if self._errored() is not None:
            return ElasticWork(self, None, own_slots_everywhere)
        try:
            work = self.pg.alltoall_base(out, inp, [], [], AllToAllOptions())
        except Exception as e:
            self.fail(e)
            return ElasticWork(self, None, own_slots_everywhere)
        return ElasticWork(self, work, own_slots_everywhere)


class ElasticGrid(ElasticGroup):
    """Every process of every replica group in the quorum (a sharded model's step decision, whose ranks hold
    different shards): :meth:`all_reduce` sums over the replica group's own processes (``intra``, torch's group)
    first, then over the quorum on this local rank's elastic group, so every process of every replica ends with
    the same sum. Size and rank count processes: (quorum rank) x (processes per group) + local rank."""

    def __init__(self, group: ElasticGroup, intra: Any) -> None:
        super().__init__(group.pg, group._size, group._rank, group._on_error, group._errored, intra=intra)
        self._inner = group

    def size(self) -> int:
        return super().size() * dist.get_world_size(self.intra)

    def rank(self) -> int:
        return super().rank() * dist.get_world_size(self.intra) + dist.get_rank(self.intra)

    def fail(self, e: BaseException) -> None:
        self._inner.fail(e)  # one failure count per replica (telemetry)

    def all_reduce(self, t: Tensor) -> ElasticWork:
        dist.all_reduce(t, group=self.intra)
        return super().all_reduce(t)


def group_size(group: Any) -> int:
    """``dist.get_world_size(group)``, an :class:`ElasticGroup`'s quorum size."""
    if isinstance(group, ElasticGroup):
        return group.size()
    return dist.get_world_size(group)


def group_rank(group: Any) -> int:
    """``dist.get_rank(group)``, an :class:`ElasticGroup`'s rank in the quorum."""
    if isinstance(group, ElasticGroup):
        return group.rank()
    return dist.get_rank(group)


def _collective(group: Any, name: str, args: tuple, torch_fn: Callable[..., Any], async_op: bool) -> Any:
    """Run the collective ``name`` on an :class:`ElasticGroup` (its method) or with ``torch_fn``; returns the work
    when ``async_op`` (else waits)."""
    if isinstance(group, ElasticGroup):
        work: Any = getattr(group, name)(*args)
    else:
        work = torch_fn(*args, group=group, async_op=True)
    if async_op:
        return work
    work.wait()
    return None


def all_reduce(t: Tensor, group: Any, async_op: bool = False) -> Any:
    """``dist.all_reduce`` (sum), or the elastic one; returns the work when ``async_op`` (else waits)."""
    return _collective(group, "all_reduce", (t,), dist.all_reduce, async_op)


def all_gather(out: Tensor, inp: Tensor, group: Any = None, async_op: bool = False) -> Any:
    """``dist.all_gather_into_tensor``, or the elastic one (see :func:`all_reduce`)."""
    return _collective(group, "all_gather", (out, inp), _dist_all_gather, async_op)


def all_to_all(out: Tensor, inp: Tensor, group: Any = None, async_op: bool = False) -> Any:
    """``dist.all_to_all_single`` (equal splits), or the elastic one (see :func:`all_reduce`)."""
    return _collective(group, "all_to_all", (out, inp), dist.all_to_all_single, async_op)


def is_elastic(group: Any) -> bool:
    return isinstance(group, ElasticGroup)


__all__: List[str] = ["ElasticGrid", "ElasticGroup", "ElasticWork", "all_gather", "all_reduce", "all_to_all", "group_rank",
                      "group_size", "is_elastic"]
