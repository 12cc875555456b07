"""Sparse local SGD (torch only): the outer round of ``local_steps`` > 0, one module per part.

Every replica (a node: its processes all-reduce gradients densely every inner step, so they hold the same
weights) runs H inner optimizer steps alone. Then, on every rank:

1. the pseudo-gradient ``Δ = θ_anchor − θ_local`` (``θ_anchor`` = where this round started: ``θ_outer``);
2. a non-finite Δ (or float module buffer) on any rank is decided once on every rank (one all-reduce of a
   flag, before anything changes): the round is skipped (``θ_local := θ_outer``, error feedback and momentum
   untouched, module buffers back to the round's start) or raises;
3. error feedback: ``e = outer_ef_decay · e + Δ`` (SparseLoCo);
4. top-k of ``|e|`` in each chunk of ``outer_chunk`` entries at ``outer_density`` (``outer_chunk=0``: one
   top-k over the rank's whole shard);
5. the selected values are quantized to ``outer_value_bits`` (32: fp32; 16: bf16; 8/4/2: integer codes
   ``round(v / s)`` clamped to ``±(2^(b-1) − 1)`` with one fp32 scale ``s = max|v| / (2^(b-1) − 1)`` per chunk;
   2 bits is ternary); ``e`` keeps what was not sent, rounding error included
   (``sent + e_new = decay · e_old + Δ``);
6. one all-gather of the fixed-size packets (codes, scales, in-chunk positions: int16 for chunks up to
   32768, or a bitmap of the chunk where smaller, :class:`~.codec.PacketLayout`) among the replicas; every rank
   decodes the same sum and averages it over the replicas. Or (``outer_exchange``, :func:`~.exchanges.outer_exchange_for`)
   the scale-free exchange: every replica owns a range of chunks; one all-to-all sends each owner the
   replicas' packets of its range, the owner averages them, adds its own error feedback and re-selects the
   top-k at twice the density (``OWNER_K_FACTOR``), and one all-gather of the owners' ranges gives every rank
   the same update (:class:`~.exchanges.ScatterOuter`): about 3 (R − 1)/R packets out per replica, against R − 1;
7. the outer optimizer: SGD on the averaged pseudo-gradient ``g``: ``m = μ m + g``; step ``g + μ m``
   (Nesterov, DiLoCo) or ``m``; ``θ_outer −= outer_lr · step``. ``μ = 0`` with error feedback is SparseLoCo;
8. ``θ_local := θ_outer`` on every replica, and the module's floating-point buffers (BatchNorm's running
   statistics) are averaged over every rank (below).

With several processes per node the flat parameter vector's chunks are split among the node's local ranks
(shard l to local rank l): each rank runs 3-7 on its shard over the group of the ranks with its local rank
(one per node), and an intra-node all-gather of the updated shards rebuilds ``θ_outer``. So the inter-node
link carries each node's packet once, split over its processes.

``outer_streaming``: the all-gather of step 6 is launched asynchronously and its result applied one round
late (at the end of the next round, before that round's exchange is launched): compute goes on while it
travels. The next round then starts from the ``θ_outer`` that does not yet include it, and its Δ is taken
from that start (``θ_anchor``). At the end of training the last one is applied
(:meth:`~.round.OuterState.apply_in_flight`).

Buffers (``buffers``: the module's ``named_buffers``): DDP does not sync them under local SGD (no per-forward
broadcast), so each process keeps its own between rounds. At every round end the floating-point ones are
averaged over *every* rank (all processes of all nodes: each process saw its own batches), carried in the same
fp32 all-reduce as step 2's flag: ``b := b_anchor + (1/W) Σ_r (b_r − b_anchor)``, where ``b_anchor`` is their
value at the start of the round (the same on every rank). Averaging the change keeps buffers that no rank
changed (constant tables) bit for bit. A non-finite buffer on any rank counts as a non-finite pseudo-gradient,
and a skipped round puts the buffers back to ``b_anchor``, as it puts θ_local back to θ_outer. With
``outer_streaming`` they are averaged at the round end, when the round's exchange is launched (the all-reduce is
blocking: it carries the flag, which is). Integer buffers (``num_batches_tracked``) are left alone: every rank
runs the same number of forward passes. Between rounds nothing is synchronized, not even inside a node.

``dense_steps`` = N > 0 (post-local SGD, Lin et al. 2020): the first N inner steps are synchronous (the
exchange all-reduces the gradients over every rank); after the N-th, ``θ_outer`` is re-anchored at the
(identical) weights, the buffers are averaged over every rank, and the rounds start.

The modules (each imports torch, :mod:`~lightning_topk.comm.state` and :mod:`~lightning_topk.comm.wire`, and of this
package only the ones above it in this list):

* :mod:`.codec`: chunks, top-k, quantization, packets and bitmaps (:class:`~.codec.PacketLayout`, steps 4-6's bytes);
* :mod:`.outer_step`: which outer step (``outer_recipe``, :func:`~.outer_step.outer_step_for`), the outer SGD and
  the amplification guard (step 7);
* :mod:`.exchanges`: the outer exchanges, one small unit each, by name (:data:`~.exchanges.OUTER_EXCHANGES`: the
  all-gather, the scale-free owners; step 6), and the choice between them;
* :mod:`.flat`: the flat vector this rank owns a shard of, the module's buffers, the fault/buffer all-reduce (step 2);
* :mod:`.streaming`: the streamed exchange in flight;
* :mod:`.checkpoint`: the checkpoint section and :func:`~.checkpoint.reshard`;
* :mod:`.elastic_round`: the round among the replicas of a torchft quorum (``fault_tolerance="torchft"``):
  contributing replicas, rollback of an uncommitted round, the outer state a heal carries;
* :mod:`.round`: :class:`~.round.OuterState`, the round itself (steps 1-8), from the pieces above;
* :mod:`.exchange`: :class:`~.exchange.LocalExchange`, the per-step exchange ``"local"`` that drives it.
"""
from lightning_topk.comm.local.checkpoint import reshard
from lightning_topk.comm.local.codec import (
    INDEX_CODES,
    VALUE_BITS,
    PacketLayout,
    chunk_k,
    chunk_size,
    compress,
    decode_into,
    dequantize,
    mask_positions,
    pack_bitmap,
    pack_codes,
    qmax,
    quantize,
    shard_layout,
    sum_packets,
    unpack_bitmap,
    unpack_codes,
    wire_bytes_per_param,
)
from lightning_topk.comm.local.exchanges import (
    AUTO_EXCHANGE_INPUTS,
    OUTER_EXCHANGES,
    OWNER_K_FACTOR,
    OWNER_MIN_BITS,
    SCATTER_MAX_BYTE_SHARE,
    SCATTER_MIN_BITS,
    SCATTER_MIN_REPLICAS,
    AllgatherOuter,
    OuterExchange,
    ScatterOuter,
    build_outer_exchange,
    outer_exchange_for,
    owner_chunks,
    owner_layouts,
    round_bytes_out,
)
from lightning_topk.comm.local.outer_step import (
    AMPLIFY_NORM_GROWTH,
    AMPLIFY_RATIO,
    AMPLIFY_ROUNDS,
    NAMED_RECIPES,
    OUTER_RECIPE_TABLE,
    AmplifyGuard,
    OuterStep,
    inner_kind,
    outer_sgd_,
    outer_step_for,
)
from lightning_topk.comm.local.round import OuterState, OuterStats

__all__ = [
    "AMPLIFY_NORM_GROWTH",
    "AMPLIFY_RATIO",
    "AMPLIFY_ROUNDS",
    "AUTO_EXCHANGE_INPUTS",
    "AllgatherOuter",
    "AmplifyGuard",
    "INDEX_CODES",
    "NAMED_RECIPES",
    "OUTER_EXCHANGES",
    "OUTER_RECIPE_TABLE",
    "OWNER_K_FACTOR",
    "OWNER_MIN_BITS",
    "OuterExchange",
    "OuterState",
    "OuterStats",
    "OuterStep",
    "PacketLayout",
    "SCATTER_MAX_BYTE_SHARE",
    "SCATTER_MIN_BITS",
    "SCATTER_MIN_REPLICAS",
    "ScatterOuter",
    "VALUE_BITS",
    "build_outer_exchange",
    "chunk_k",
    "chunk_size",
    "compress",
    "decode_into",
    "dequantize",
    "inner_kind",
    "mask_positions",
    "outer_exchange_for",
    "outer_sgd_",
    "outer_step_for",
    "owner_chunks",
    "owner_layouts",
    "pack_bitmap",
    "pack_codes",
    "qmax",
    "quantize",
    "reshard",
    "round_bytes_out",
    "shard_layout",
    "sum_packets",
    "unpack_bitmap",
    "unpack_codes",
    "wire_bytes_per_param",
]
