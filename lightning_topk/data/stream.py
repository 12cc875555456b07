"""The per-rank iterable dataset: reads its share of the shards, caches, decodes and batches.

It yields ready batches (the DataLoader runs with ``batch_size=None``) so every rank produces exactly
``len(dataset)`` batches per epoch however the shards and workers fall. Rank, world size, epoch and the
batch a pass starts at are plain attributes / shared tensors set in the main process, so workers started
with fork, spawn or forkserver (persistent or not) all see them; nothing is read from the ``RANK``
environment variable.

A worker's order is computed on sample positions before anything is read (the segments of the epoch,
then the shuffle buffer's emission order), so a pass that starts at batch ``k`` of the epoch skips the
samples the first ``k`` batches held without reading or decoding them.
"""
from __future__ import annotations

import random
import warnings
from typing import Callable, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch.utils.data import IterableDataset, get_worker_info

from .cache import DecodedArena, DiskCache, S
from .decode import BadSampleError, SampleDecoder, collate
from .reader import ShardReader
from .split import (
    Segment,
    buffer_shuffle_order,
    epoch_order,
    mix_seed,
    num_batches,
    rank_segments,
    resume_split,
    segments_len,
    worker_batch_range,
    worker_segments,
)


def reorder(pairs: Iterable[Tuple[int, tuple]], order: Iterable[int]) -> Iterator[tuple]:
    """Items of ``pairs`` (``(position, item)`` in increasing position, at least every position of
    ``order``) in the order ``order`` lists their positions; items read ahead wait in a dict, which
    holds at most a shuffle buffer's worth when ``order`` comes from :func:`buffer_shuffle_order`."""
    held, it = {}, iter(pairs)
    for p in order:
        while p not in held:
            q, item = next(it)
            held[q] = item
        yield held.pop(p)


class ShardStream(ShardReader, IterableDataset):
    def __init__(self, urls: Sequence[str], counts: Optional[Sequence[int]], decoder: SampleDecoder, *, rank: int,
                 world_size: int, batch_size: int, drop_last: bool, seed: int, shuffle: bool, shuffle_buffer: int,
                 num_workers: int, transform=None, on_bad_sample: str = "raise", samples_per_epoch: Optional[int] = None,
                 disk_cache: Optional[DiskCache] = None, stats: Optional[torch.Tensor] = None):
        self.urls, self.decoder, self.transform = list(urls), decoder, transform
        self.rank, self.world_size, self.batch_size, self.drop_last = rank, world_size, batch_size, drop_last
        self.seed, self.shuffle, self.shuffle_buffer = seed, shuffle, shuffle_buffer
        self.num_workers, self.on_bad_sample, self.disk_cache = num_workers, on_bad_sample, disk_cache
        self.resampled = samples_per_epoch is not None
        if self.resampled:
            self.segments: List[Segment] = []
            self.num_local = int(samples_per_epoch) // world_size
        else:
            self.segments = rank_segments(counts, rank, world_size, seed, shuffle_shards=shuffle)
            self.num_local = segments_len(self.segments)
            offsets = [0]
            for c in counts:
                offsets.append(offsets[-1] + c)
            self.shard_offsets = offsets
        if self.num_local == 0:
            raise ValueError(f"rank {rank} of {world_size} gets no samples: the shards hold too few samples")
        self.stats = stats if stats is not None else torch.zeros(max(num_workers, 1) + 1, len(S), dtype=torch.int64)
        self.arena = None  # EncodedArena | DecodedArena, attached by the DataModule
        self._pos = torch.zeros(2, dtype=torch.int64).share_memory_()  # epoch, batch the next pass starts at

    # ---------------------------------------------------------------- position / size
    def set_position(self, epoch: int, start: int = 0) -> None:
        """The next pass is epoch ``epoch`` from its batch ``start`` on (earlier batches are skipped)."""
        self._pos[0], self._pos[1] = int(epoch), int(start)

    @property
    def position(self) -> Tuple[int, int]:
        return int(self._pos[0]), int(self._pos[1])

    def __len__(self) -> int:
        return num_batches(self.num_local, self.batch_size, self.drop_last)

    def local_ids(self) -> torch.Tensor:
        """Global sample id of each local index (position in the concatenated shard list)."""
        ids = torch.empty(self.num_local, dtype=torch.int64)
        for s, a, b, base in self.segments:
            ids[base:base + b - a] = torch.arange(self.shard_offsets[s] + a, self.shard_offsets[s] + b)
        return ids

    # ---------------------------------------------------------------- iteration
    def _decode(self, kind: str, local: int, shard: str, key: str, payload, worker: int) -> tuple:
        """One item's sample, kept in the decoded RAM level when there is one; raises BadSampleError."""
        if kind == "bad":
            raise BadSampleError(payload, shard, key)
        if kind != "raw":
            return payload
        sample = self.decoder(payload, shard, key)
        if isinstance(self.arena, DecodedArena) and local >= 0:
            self.arena.put(local, sample, worker)
        return sample

    def _transformed(self, sample: tuple) -> tuple:
        if self.transform is None:
            return sample
        sample = self.transform(sample)
        return sample if isinstance(sample, tuple) else (sample,)

    def _decode_items(self, items, row: int, worker: int, before: Optional[Callable[[], Optional[tuple]]] = None):
        """Decode and transform; when skipping, a bad sample becomes a repeat of the worker's previous good
        one (``before()`` gives the one preceding a pass that starts mid-epoch)."""
        last, pending = None, 0
        for kind, local, gid, shard, key, payload in items:
            try:
                sample = self._decode(kind, local, shard, key, payload, worker)
            except BadSampleError as exn:
                if self.on_bad_sample == "raise":
                    raise
                warnings.warn(f"skipping bad sample: {exn}", RuntimeWarning, stacklevel=2)
                self.stats[row, S["bad_skipped"]] += 1
                if last is None and before is not None:
                    last, before = before(), None
                if last is None:
                    pending += 1
                else:
                    yield last
                continue
            last = (local, gid, self._transformed(sample))
            yield last
            for _ in range(pending):  # bad samples seen before the first good one
                yield last
            pending = 0
        if pending:
            raise RuntimeError(f"worker {worker} of rank {self.rank}: all its samples were bad")

    def _batches(self, samples) -> Iterator[dict]:
        buf = []
        for item in samples:
            buf.append(item)
            if len(buf) == self.batch_size:
                yield self._collate(buf)
                buf = []
        if buf:
            yield self._collate(buf)

    @staticmethod
    def _collate(buf) -> dict:
        local, gid, data = zip(*buf)
        return {"local": torch.tensor(local), "ids": torch.tensor(gid), "data": collate(data)}

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        slot, nworkers = (info.id, info.num_workers) if info is not None else (0, 1)
        row = slot if info is not None else self.stats.shape[0] - 1
        epoch, start = self.position
        taken, first = resume_split(len(self), nworkers, start)
        worker = (slot + first) % nworkers  # the DataLoader asks this process first: it plays worker `first`
        if self.resampled:
            b0, b1 = worker_batch_range(len(self), worker, nworkers)
            n = min(self.num_local, b1 * self.batch_size) - min(self.num_local, b0 * self.batch_size)
            shard_seed = mix_seed(self.seed, 6, epoch, self.rank, worker)
        else:
            order = epoch_order(self.segments, epoch, self.seed, self.rank, self.shuffle)
            mine = worker_segments(order, self.batch_size, self.drop_last, worker, nworkers)
            n = segments_len(mine)

        def read(keep: Optional[bytearray]):
            if self.resampled:
                return self._read_resampled(n, random.Random(shard_seed), row, keep)
            return self._read_positions(mine, row, worker, keep)

        emit = range(n)
        if self.shuffle and self.shuffle_buffer > 1:
            rng = random.Random(mix_seed(self.seed, 3, epoch, self.rank, worker))
            emit = buffer_shuffle_order(n, self.shuffle_buffer, rng)
        skip = taken[worker] * self.batch_size
        if not skip:
            return self._batches(self._decode_items(reorder(read(None), emit), row, worker))
        keep = bytearray(n)
        for p in emit[skip:]:
            keep[p] = 1

        def before() -> Optional[tuple]:
            """The last good sample of the skipped part (what a bad first sample repeats)."""
            for p in reversed(emit[:skip]):
                one = bytearray(n)
                one[p] = 1
                for _, (kind, local, gid, shard, key, payload) in read(one):
                    try:
                        return local, gid, self._transformed(self._decode(kind, local, shard, key, payload, worker))
                    except BadSampleError:
                        break
            return None

        return self._batches(self._decode_items(reorder(read(keep), emit[skip:]), row, worker, before))

    # ---------------------------------------------------------------- completing the cache levels
    def iter_locals(self, local: torch.Tensor, row: int, worker: int) -> Iterator[dict]:
        """Batches of the samples with the given local indices, decoded (and kept in the decoded RAM level);
        bad samples are left out with a warning, or raise, as ``on_bad_sample`` says."""
        want = set(local.tolist())
        buf = []
        for seg in self.segments:
            s, a, b, base = seg
            if not want.intersection(range(base, base + b - a)):
                continue
            for kind, loc, gid, shard, key, payload in self._read_segment(
                    seg, row, worker, lambda i, base=base, a=a: base + i - a in want):
                try:
                    buf.append((loc, gid, self._decode(kind, loc, shard, key, payload, worker)))
                except BadSampleError as exn:
                    if self.on_bad_sample == "raise":
                        raise
                    warnings.warn(f"skipping bad sample: {exn}", RuntimeWarning, stacklevel=2)
                    self.stats[row, S["bad_skipped"]] += 1
                if len(buf) == self.batch_size:
                    yield self._collate(buf)
                    buf = []
        if buf:
            yield self._collate(buf)

    # ---------------------------------------------------------------- served from the main process
    def ram_servable(self) -> bool:
        """Whether the decoded RAM level can hold the whole partition (it serves epochs once it does)."""
        return isinstance(self.arena, DecodedArena) and self.transform is None and self.arena.capacity == self.num_local

    def _epoch_perm(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_local)
        g = torch.Generator().manual_seed(mix_seed(self.seed, 4, epoch, self.rank) & 0x7FFFFFFFFFFFFFFF)
        return torch.randperm(self.num_local, generator=g)

    def iter_indices(self, epoch: int, start: int = 0) -> Iterator[torch.Tensor]:
        perm = self._epoch_perm(epoch)
        for i in range(start, len(self)):
            yield perm[i * self.batch_size:(i + 1) * self.batch_size]

    def iter_ram(self, epoch: int, start: int = 0) -> Iterator[dict]:
        """An epoch from batch ``start`` on, from the decoded RAM level: one gather per batch in the main process."""
        ids, row = self.local_ids(), self.stats.shape[0] - 1
        for idx in self.iter_indices(epoch, start):
            self.stats[row, S["ram_hits"]] += len(idx)
            yield {"local": idx, "ids": ids[idx], "data": (self.arena.images[idx], self.arena.labels[idx])}

    def iter_gpu(self, epoch: int, start: int = 0) -> Iterator[dict]:
        """An epoch from batch ``start`` on, from the device level: only index tensors leave the host."""
        ids = self.local_ids()
        for idx in self.iter_indices(epoch, start):
            yield {"local": idx, "ids": ids[idx], "served": "gpu"}


class LocalSamples(IterableDataset):
    """Given local indices of a ShardStream, split among DataLoader workers (see ShardStream.iter_locals)."""

    def __init__(self, ds: ShardStream, local: torch.Tensor):
        self.ds, self.local = ds, local

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        w, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        n = len(self.local)
        return self.ds.iter_locals(self.local[n * w // nw:n * (w + 1) // nw], w if info is not None else -1, w)
