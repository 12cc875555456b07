"""Sparse local SGD as an exchange (``local_steps`` > 0, ``exchange="local"``).

Every inner step the comm hook all-reduces each bucket densely *inside the node* (the node's processes then
hold one replica); with one process per node it issues no collective at all and hands DDP the local
gradient. The step controller's per-step fault decision is the node's too (:meth:`LocalExchange.decision_group`):
between outer rounds nothing crosses the node boundary. Every ``local_steps`` optimizer-step attempts
(skipped ones included, so that every node enters the round at the same step), :meth:`LocalExchange.after_optimizer_step`
runs the outer round of :class:`~lightning_topk.comm.local.round.OuterState` (pseudo-gradient, error feedback,
per-chunk top-k, quantized values, all-gather among the nodes, outer SGD, ``θ_local := θ_outer``).

Post-local SGD (``dense_steps`` = N > 0): the first N optimizer-step attempts are synchronous, as DDP: the hook
all-reduces every bucket densely over every rank and the step controller decides over every rank. After the
N-th, θ_outer is re-anchored at the (identical) weights and local SGD starts.

Usage without Lightning::

    state = TopKState(TopKConfig(local_steps=50, outer_density=0.02, outer_value_bits=4))
    ddp.register_comm_hook(state, exchange_hook)           # after state.exchange = state.exchange_for("local")
    state.exchange.bind(model.named_parameters(), model.named_buffers())  # θ_outer := the weights now
    ... loss.backward(); optimizer.step(); state.exchange.after_optimizer_step(model.named_parameters())
"""
# No `from __future__ import annotations` here: DDP checks the hook's annotations at registration.
import logging
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_topk.comm.exchanges.base import Exchange, Layout
from lightning_topk.comm.exchanges.kit import _link, flat_group, future_on, open_bucket
from lightning_topk.comm.exchanges.registry import register
from lightning_topk.comm.faults import nonfinite
from lightning_topk.comm.local.round import OuterState
from lightning_topk.comm.state import TopKState
from lightning_topk.comm.telemetry import clock
from lightning_topk.comm.wire import ring_allreduce_wire

log = logging.getLogger(__name__)


@register("local")
class LocalExchange(Exchange):
    """Intra-node dense all-reduce per inner step; the sparse outer round every ``local_steps`` steps."""

    sparse = False
    momentum_correction = False
    parameter_scope = True
    local_sgd = True

    def __init__(self, state: Any, layout: Optional[Layout] = None, groups: Any = None, **kwargs: Any) -> None:
        super().__init__(state, layout)
        self.state = state
        self.groups = groups
        # One process per node: the strategy turns DDP's reducer off for the inner steps (nothing to reduce;
        # DDP's per-parameter bookkeeping cost ~30% of an inner step on the cluster model, BENCHMARKS.md);
        # the gradients are then flagged and counted in before_decision, not in the hook.
        self.bypass = False
        self.outer: Optional[OuterState] = None
        self._section: Optional[Dict[str, Any]] = None
        self.inner_optimizer_states: Optional[List[Any]] = None  # per-rank inner optimizer state (checkpoint)

    @classmethod
    def check(cls, config: Any, layout: Optional[Layout] = None) -> None:
        super().check(config, layout)
        if getattr(config, "local_steps", 0) <= 0:
            raise ValueError("topk_ddp: exchange='local' needs local_steps > 0 (inner optimizer steps per outer "
                             "round); set local_steps or another exchange")

    # ---- parameters -----------------------------------------------------------------------------------
    def bind(self, named_parameters: Iterable[Tuple[str, Tensor]],
             named_buffers: Iterable[Tuple[str, Tensor]] = (), optimizers: Optional[List[Any]] = None) -> None:
        """θ_outer := these parameters now (call before the first optimizer step, on every rank); a loaded
        section is applied here (θ_local and this rank's buffers included). ``named_buffers``: the module's
        buffers (BatchNorm statistics), averaged over every rank at each round end and kept per rank in the
        checkpoint (:class:`~lightning_topk.comm.local.round.OuterState`). ``optimizers``: the inner optimizer(s), for
        ``outer_recipe="auto"`` (:func:`~lightning_topk.comm.local.outer_step.outer_step_for`)."""
        named = [(n, p) for n, p in named_parameters if p.requires_grad]
        g = self.groups
        local = g.local_world if g is not None else 1
        self.outer = OuterState(self.state.config, named,
                                inter=g.inter if g is not None else self.state.process_group,
                                intra=g.intra if g is not None else None, local=local,
                                local_rank=g.local_rank if g is not None else 0,
                                flag_group=self.state.process_group, buffers=list(named_buffers),
                                optimizers=optimizers)
        if self._section is not None:
            self._load(self._section)
            self._section = None
        elif self.state.step > 0:
            carried = self._carry_residuals(optimizers)
            log.warning("topk_local: resuming at step %d without a saved outer state (another world size, or a "
                        "checkpoint of another strategy or of the per-step exchange): the outer round restarts from "
                        "these weights, outer momentum at zero, error feedback %s", self.state.step, carried)

    def _carry_residuals(self, optimizers: Optional[List[Any]]) -> str:
        """A per-step checkpoint (``local_steps=0``) resumed under local SGD: fold its residuals (gradient mass
        not sent yet) into the outer error feedback, in the pseudo-gradient's units: ``ef += lr * e`` (the SGD
        step the per-step exchange would have taken for it; with several processes per node, the node's mean),
        so the next outer rounds send it. Only for ``torch.optim.SGD`` (with another optimizer a gradient has no
        fixed step: the residuals are dropped, and this says how much). Momentum-correction velocities are
        dropped. Returns what was done, for the warning."""
        o = self.outer
        assert o is not None
        res = self.state.take_pending("residual")
        vel = self.state.take_pending("velocity")
        v = o.view
        flat = torch.zeros(v.local * v.shard, dtype=torch.float32, device=o.theta.device)
        lrs = torch.zeros_like(flat)
        opt = optimizers[0] if optimizers and len(optimizers) == 1 else None
        lr_of = {id(p): float(g["lr"]) for g in getattr(opt, "param_groups", []) for p in g["params"]}
        off = 0
        for name, p, k in zip(v.names, v.params, v.numels):
            t = res.get(name)
            if t is not None and t.numel() == k:
                flat[off:off + k] = t.reshape(-1).to(flat)
            lrs[off:off + k] = lr_of.get(id(p), 0.0)
            off += k
        g = self.groups
        if g is not None and g.local_world > 1:  # the node's ranks: one replica, the mean of their residuals
            dist.all_reduce(flat, group=g.intra)
            flat.div_(g.local_world)
        mass = float(flat.norm())
        extra = f"; {len(vel)} parameters' momentum-correction velocities dropped" if vel else ""
        if mass == 0.0:
            return "at zero" + extra
        if type(opt) is not torch.optim.SGD:
            return (f"at zero: the checkpoint's per-step residuals (L2 norm {mass:.4g}, gradient units) were dropped: "
                    f"{type(opt).__name__ if opt is not None else 'an unknown optimizer'} has no fixed step for a "
                    "gradient (carried into the outer error feedback for torch.optim.SGD only)" + extra)
        o.ef.add_(v.mine(flat.mul_(lrs)))
        return (f"holding the checkpoint's per-step residuals (L2 norm {mass:.4g}) times the inner lr (the step the "
                "per-step exchange would have taken; sent by the next outer rounds)" + extra)

    # ---- the step ---------------------------------------------------------------------------------------
    def hook(self, state: TopKState, bucket: dist.GradBucket) -> torch.futures.Future:
        grad, n, _params, names, _device, stats = open_bucket(state, bucket)
        bad = state.flags.note_input(names, grad)
        L = self.groups.local_world if self.groups is not None else 1
        self._account(state, stats, n, grad.element_size())
        group, world = flat_group(state)
        eb = grad.element_size()
        if self.outer is not None and self.outer.synchronous and world > 1:
            # post-local SGD (``dense_steps``): the first steps all-reduce densely over every rank, as DDP
            state.add_stats(stats, numel_sent=n, bytes_sent=n * eb, **_link(state, n * eb),
                            bytes_wire=ring_allreduce_wire(n * eb, world))
            L, reduce_group = world, group
        else:
            reduce_group = self.groups.intra if self.groups is not None else None
            if L > 1:
                state.add_stats(stats, bytes_sent=n * eb, bytes_intra=n * eb, bytes_wire=ring_allreduce_wire(n * eb, L))
        if L > 1:
            t = clock(grad.device)
            grad.mul_(1.0 / L)  # before the sum, as torch's reducer (DDP bit for bit at any L)
            fut = dist.all_reduce(grad, group=reduce_group, async_op=True).get_future()

            def finish(done: torch.futures.Future) -> Tensor:
                done.wait()  # a failed all-reduce raises its own error, before `grad` is read
                state.add_time(stats, "comm_time_s", t)
                state.flags.note_result(grad)
                return grad

            out = fut.then(finish)
        else:
            state.flags.note_result(grad, bad)  # the input itself: one read pass, not two
            out = future_on(grad.device)
            out.set_result(grad)
        if bucket.is_last():
            state.end_exchange()
        return out

    def _account(self, state: Any, stats: Any, n: int, element_size: int) -> None:
        """One inner step's telemetry for ``n`` entries: the last outer round's figures, and what the step
        replaces (a dense fp32 ring all-reduce among all ranks)."""
        self._outer_stats(stats)
        _group, world = flat_group(state)
        state.add_stats(stats, "local", buckets=1, numel=n, numel_sent=0, bytes_dense=n * element_size,
                        bytes_dense_wire=ring_allreduce_wire(4 * n, world))

    @property
    def reducer_off(self) -> bool:
        """Whether DDP's reducer is off for the next step: ``bypass`` (one process per node), except during the
        synchronous first ``dense_steps``, whose gradients the hook all-reduces over every rank."""
        return self.bypass and not (self.outer is not None and self.outer.synchronous)

    def before_decision(self, state: Any) -> None:
        """With DDP's reducer off (``bypass``), the hook saw nothing: flag the gradients and count the step."""
        if not self.reducer_off or self.outer is None:
            return
        grads = [(name, p.grad) for name, p in zip(self.outer.view.names, self.outer.view.params) if p.grad is not None]
        if grads:
            bad = torch.stack([nonfinite(g) for _, g in grads]).any()
            state.flags.note_input(tuple(name for name, _ in grads), None, bad=bad)
            g0 = grads[0][1]
            state.flags.note_result(g0, bad)
            self._account(state, state.current, sum(g.numel() for _, g in grads), g0.element_size())
        state.end_exchange()

    def _outer_stats(self, stats: Any) -> None:
        """The last outer round's figures on every step's stats (telemetry logs the last step)."""
        o = self.outer
        if o is None or o.stats.rounds == 0:
            return
        stats.outer_bytes = float(o.stats.bytes)
        stats.outer_bytes_per_step = o.stats.bytes / max(1, o.config.local_steps)
        stats.outer_density = o.stats.density
        stats.outer_time_s = o.stats.time_s
        stats.outer_hidden_frac = o.stats.hidden_frac

    def decision_group(self, state: Any) -> Any:
        """Inner steps are decided by the node alone (it is one replica): its ranks, or no collective at all
        (``None``) with one process per node. No inner step waits for another node. During the synchronous
        first ``dense_steps`` the replicas must stay identical: every rank decides together."""
        if self.outer is not None and self.outer.synchronous:
            return state.flat_group
        g = self.groups
        return g.intra if g is not None and g.local_world > 1 else None

    def after_optimizer_step(self, params: Any) -> None:
        """Count an inner optimizer-step attempt (a step this node skipped counts too: every node reaches the
        outer round at the same step); run the outer round at the H-th."""
        if self.outer is None:
            raise RuntimeError("topk_local: the exchange was not bound to the parameters before the first step; "
                               "call state.exchange.bind(model.named_parameters()) after building it")
        if self.outer.step():
            st = self.state
            nbytes = self.outer.stats.bytes
            link = "bytes_inter" if st.num_nodes > 1 else "bytes_intra"
            for s in (st.totals,):
                s.bytes_wire += nbytes
                # the packet, and the float buffers' fp32 all-reduce (BatchNorm statistics) if it ran
                s.bytes_sent += self.outer.payload_bytes + (4 * self.outer.bufs.nbuf if self.outer.stats.buffer_bytes else 0)
                setattr(s, link, getattr(s, link) + nbytes)
            st.totals.comm_time_s += self.outer.stats.time_s
            self._outer_stats(st.last)

    def end_training(self) -> None:
        """At the end of training, on every rank: apply a streamed outer exchange still in flight
        (:meth:`~lightning_topk.comm.local.round.OuterState.apply_in_flight`)."""
        if self.outer is not None:
            self.outer.apply_in_flight()

    def start_training(self) -> None:
        """When training (re)starts in this process: undo :meth:`end_training`'s early application, so training
        goes on as if it had not stopped."""
        if self.outer is not None:
            self.outer.resume_in_flight()

    def flush(self, state: Any) -> None:
        if self.outer is not None:
            self.outer.finish_flight()

    @property
    def in_flight(self) -> bool:
        return self.outer is not None and self.outer.in_flight

    # ---- checkpoint --------------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        if self.outer is None:
            return dict(self._section or {})
        sd = self.outer.state_dict()
        if self.inner_optimizer_states is not None:
            sd["inner_optimizer_states"] = self.inner_optimizer_states
        return sd

    def load_state_dict(self, sd: Optional[Dict[str, Any]]) -> None:
        if not sd:
            return
        if self.outer is None:
            self._section = dict(sd)  # applied at bind (after DDP broadcast rank 0's weights)
        else:
            self._load(sd)

    def _load(self, sd: Dict[str, Any]) -> None:
        assert self.outer is not None
        self.outer.load_state_dict(sd)
