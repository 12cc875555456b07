"""Equalised rank/worker split of a sharded data set at sample granularity.

Every rank gets exactly ``total // world_size`` samples (at most ``world_size - 1`` samples of the
data set are left out per epoch), whatever the shard count, so every rank runs the same number of
batches. A rank's partition is fixed across epochs (contiguous in a seed-shuffled shard order), which
is what lets the RAM and GPU cache levels hit from epoch 2 on; the order inside the partition and the
split among DataLoader workers change every epoch.

A segment is ``(shard_index, start, stop, base)``: samples ``start..stop-1`` of the shard, whose
position in the rank's canonical order (its "local index") starts at ``base``.

Everything here is a pure function of (seed, epoch, rank, world size, batch size, workers), which is what
lets a resumed job compute where every worker stood from the number of batches consumed.
"""
from __future__ import annotations

import math
import random
from typing import List, Sequence, Tuple

Segment = Tuple[int, int, int, int]


def mix_seed(*parts: int) -> int:
    """Deterministic seed from integers (Python's hash of ints is stable, but keep it explicit)."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = (h ^ (int(p) & 0xFFFFFFFFFFFFFFFF)) * 0x100000001B3 & 0xFFFFFFFFFFFFFFFF
    return h


def rank_segments(counts: Sequence[int], rank: int, world_size: int, seed: int, shuffle_shards: bool = True) -> List[Segment]:
    """The rank's fixed partition: samples ``[rank*P, (rank+1)*P)`` of the shards in seed order."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world_size {world_size}")
    order = list(range(len(counts)))
    if shuffle_shards:
        random.Random(mix_seed(seed, 1)).shuffle(order)
    per_rank = sum(counts) // world_size
    lo, hi = rank * per_rank, (rank + 1) * per_rank
    segs, pos = [], 0
    for s in order:
        n = counts[s]
        a, b = max(lo, pos), min(hi, pos + n)
        if a < b:
            segs.append((s, a - pos, b - pos, a - lo))
        pos += n
    return segs


def segments_len(segs: Sequence[Segment]) -> int:
    return sum(b - a for _, a, b, _ in segs)


def epoch_order(segs: Sequence[Segment], epoch: int, seed: int, rank: int, shuffle: bool) -> List[Segment]:
    """Per-epoch order of the rank's segments: permuted, then rotated by a random sample offset."""
    segs = list(segs)
    if not shuffle or not segs:
        return segs
    rng = random.Random(mix_seed(seed, 2, epoch, rank))
    rng.shuffle(segs)
    total = segments_len(segs)
    cut = rng.randrange(total)
    head, tail, pos = [], [], 0
    for s, a, b, base in segs:
        n = b - a
        if pos + n <= cut:
            head.append((s, a, b, base))
        elif pos >= cut:
            tail.append((s, a, b, base))
        else:
            k = cut - pos
            head.append((s, a, a + k, base))
            tail.append((s, a + k, b, base + k))
        pos += n
    return tail + head


def num_batches(samples: int, batch_size: int, drop_last: bool) -> int:
    return samples // batch_size if drop_last else math.ceil(samples / batch_size)


def slice_segments(segs: Sequence[Segment], lo: int, hi: int) -> List[Segment]:
    """Samples ``lo..hi-1`` of the concatenated segments."""
    out, pos = [], 0
    for s, a, b, base in segs:
        n = b - a
        x, y = max(lo, pos), min(hi, pos + n)
        if x < y:
            out.append((s, a + x - pos, a + y - pos, base + x - pos))
        pos += n
    return out


def worker_batch_range(n_batches: int, worker: int, num_workers: int) -> Tuple[int, int]:
    """Contiguous block of batch indices for a worker (only the last batch of the epoch may be partial)."""
    return n_batches * worker // num_workers, n_batches * (worker + 1) // num_workers


def worker_segments(segs: Sequence[Segment], batch_size: int, drop_last: bool, worker: int, num_workers: int) -> List[Segment]:
    total = segments_len(segs)
    nb = num_batches(total, batch_size, drop_last)
    b0, b1 = worker_batch_range(nb, worker, num_workers)
    used = min(total, nb * batch_size)
    return slice_segments(segs, min(b0 * batch_size, used), min(b1 * batch_size, used))


def worker_batch_counts(n_batches: int, num_workers: int) -> List[int]:
    return [b1 - b0 for b0, b1 in (worker_batch_range(n_batches, w, num_workers) for w in range(num_workers))]


def resume_split(n_batches: int, num_workers: int, consumed: int) -> Tuple[List[int], int]:
    """Batches each worker had yielded when the first ``consumed`` batches of an epoch were taken, and the
    worker the next batch comes from.

    A DataLoader takes one batch from each worker in turn (0, 1, ..., skipping workers that are done), so
    a resumed pass whose worker ``p`` plays worker ``(p + next) % num_workers`` continues the sequence.
    """
    counts = worker_batch_counts(n_batches, num_workers)
    taken, w = [0] * num_workers, 0
    for _ in range(consumed):
        while taken[w] >= counts[w]:
            w = (w + 1) % num_workers
        taken[w] += 1
        w = (w + 1) % num_workers
    return taken, w


def buffer_shuffle_order(n: int, bufsize: int, rng: random.Random) -> List[int]:
    """The order in which a shuffle buffer of ``bufsize`` (webdataset's ``shuffle``, ``initial=bufsize``)
    emits items ``0..n-1``. It depends only on ``n`` and the random stream, so it is computed on indices
    and a resumed pass can skip the items already emitted without reading them."""
    buf: List[int] = []
    out: List[int] = []
    nxt = 0

    def pick() -> int:
        k = rng.randint(0, len(buf) - 1)
        item = buf[k]
        buf[k] = buf[-1]
        buf.pop()
        return item

    while nxt < n:
        buf.append(nxt)
        nxt += 1
        if len(buf) < bufsize and nxt < n:
            buf.append(nxt)
            nxt += 1
        if len(buf) >= bufsize:
            out.append(pick())
    while buf:
        out.append(pick())
    return out
