"""The per-step exchanges on gradient shards (torch only): FSDP2 reduce-scatters each group's gradients
inside the node, then calls its all-reduce hook with this rank's flat shard of the node's average
(``set_all_reduce_hook``, 1-D mesh of the node's processes). :class:`ShardHooks` hands that shard to the
state's exchange as a bucket (:class:`ShardBucket`, the part of ``dist.GradBucket`` the exchanges read), over
the group of the ranks that hold the same shard on the other nodes. So error feedback, top-k, the flat and
scale-free exchanges, ``exchange="auto"``, the step controller and the checkpointed residuals all run on the
shard, and each node's processes send disjoint parts of the gradient: the cross-node bytes of the
hierarchical exchange.

The hook's flat tensor is FSDP's layout: each parameter's local shard padded to the group's equal-size
chunk (``padded_sharded_param_size``), in the group's parameter order. Residual buffers are keyed by the
parameters' names, one slot of that padded size each (:class:`ShardSlot`).
"""
# No `from __future__ import annotations`: the exchanges' hooks are called with these objects at run time.
from typing import Any, Callable, List, Sequence, Tuple

import torch
from torch import Tensor

from lightning_topk.support import message


class ShardSlot:
    """Stands for one parameter's padded gradient shard in a :class:`ShardBucket`: the exchanges read its
    ``numel()`` and whether it has a ``grad`` (FSDP reduces only parameters that got one)."""

    __slots__ = ("_n", "grad")

    def __init__(self, n: int) -> None:
        self._n = n
        self.grad = True

    def numel(self) -> int:
        return self._n


class ShardBucket:
    """One FSDP group's reduce-scattered gradient shard, read as a DDP bucket."""

    # A dense exchange sums the replicas' shards, then divides (torch's HSDP on gloo: ReduceOp.AVG), where a
    # DDP bucket is divided before the sum (torch's reducer); see dense.dense_hook.
    average_after = True

    def __init__(self, buffer: Tensor, slots: Sequence[ShardSlot], index: int, last: bool) -> None:
        self._buffer, self._slots, self._index, self._last = buffer, list(slots), index, last

    def buffer(self) -> Tensor:
        return self._buffer

    def parameters(self) -> List[ShardSlot]:
        return self._slots

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last


class ShardHooks:
    """The all-reduce hooks of one model's FSDP groups: ``groups`` = per group, (parameter names, padded
    shard numel of each). :meth:`hook` gives the group's hook; the last group to call it in a backward
    ends the state's step (FSDP calls them in backward order, one per group that has gradients). Each hook
    returns with its own group's exchange complete (not pipelined: FSDP waits for it before the next one)."""

    def __init__(self, state: Any, groups: Sequence[Tuple[Sequence[str], Sequence[int]]],
                 exchange_hook: Callable[[Any, Any], Any]) -> None:
        self.state = state
        self._exchange_hook = exchange_hook
        self.slots: List[List[ShardSlot]] = []
        named: List[Tuple[str, Any]] = []
        for names, numels in groups:
            slots = [ShardSlot(n) for n in numels]
            self.slots.append(slots)
            named.extend(zip(names, slots))
        self.names = [list(names) for names, _ in groups]
        self.numels = [sum(numels) for _, numels in groups]
        state.bind(named)  # the residuals are keyed by the parameters' names
        self.calls = 0

    def hook(self, i: int) -> Callable[[Tensor], None]:
        """FSDP's all-reduce hook of group ``i``: the sparse exchange of its shard, in place."""

        def run(reduce_output: Tensor) -> None:
            if reduce_output.numel() != self.numels[i]:
                raise RuntimeError(f"{message('fsdp_missing_grad')} (the module's parameters: {self.names[i]})")
            self.calls += 1
            last = self.calls == len(self.slots)
            if last:
                self.calls = 0
            fut = self._exchange_hook(self.state, ShardBucket(reduce_output, self.slots[i], i, last))
            # FSDP calls the next group's hook only once this one has returned: finish the exchange's collectives
            # here (the scale-free exchange otherwise completes a bucket in the next bucket's hook)
            self.state.exchange.flush(self.state)
            out = fut.wait()
            if out.data_ptr() != reduce_output.data_ptr():
                reduce_output.copy_(out)

        return run

    def end_step(self) -> None:
        """Before the optimizer step: end a backward in which some group had no gradient at all (FSDP did not
        call its hook), so the state's step still advances once per backward."""
        if self.calls:
            self.calls = 0
            self.state.end_exchange()


def fsdp_groups(module: torch.nn.Module) -> List[Tuple[Any, Any]]:
    """(module, param group) of every ``fully_shard``-ed submodule of ``module`` that owns parameters."""
    out = []
    for m in module.modules():
        get = getattr(m, "_get_fsdp_state", None)
        if get is None:
            continue
        st = get()
        groups = getattr(st, "_fsdp_param_groups", None)
        if groups is None:
            one = getattr(st, "_fsdp_param_group", None)
            groups = [] if one is None else [one]
        for g in groups:
            if g.fsdp_params:
                out.append((m, g))
    return out
