"""The per-rank iterable dataset: reads its share of the shards, caches, decodes and batches.

It yields ready batches (the DataLoader runs with ``batch_size=None``) so every rank produces exactly
``len(dataset)`` batches per epoch however the shards and workers fall. Rank, world size and epoch are
plain attributes / shared tensors set in the main process, so workers started with fork, spawn or
forkserver all see them; nothing is read from the ``RANK`` environment variable.
"""
from __future__ import annotations

import random
import tarfile
import warnings
from typing import Iterator, List, Optional, Sequence

import torch
from torch.utils.data import IterableDataset, get_worker_info
from webdataset.filters import _shuffle
from webdataset.gopen import gopen
from webdataset.tariterators import base_plus_ext

from .cache import DecodedArena, DiskCache, S
from .decode import BadSampleError, SampleDecoder, collate
from .index import local_path
from .split import Segment, epoch_order, mix_seed, num_batches, rank_segments, segments_len, worker_segments


def iter_tar(fileobj, shard: str, seekable: bool, start: int = 0, stop: Optional[int] = None):
    """Yield ``(index, key, {ext: bytes})`` for samples ``start..stop-1``; earlier members are not read.

    A truncated or corrupt archive raises BadSampleError naming the shard and the last key seen.
    """
    key, members, index = None, {}, -1
    try:
        tf = tarfile.open(fileobj=fileobj, mode="r:" if seekable else "r|")
        for m in tf:
            if not m.isreg():
                continue
            k, ext = base_plus_ext(m.name)
            if k is None or (k.startswith("__") and k.endswith("__")):
                continue
            if k != key:
                if members:
                    yield index, key, members
                key, members, index = k, {}, index + 1
                if stop is not None and index >= stop:
                    return
            if index >= start:
                members[ext.lower()] = tf.extractfile(m).read()
            if not seekable:
                tf.members = []
        if members:
            yield index, key, members
    except (tarfile.TarError, OSError, EOFError) as exn:
        raise BadSampleError(f"corrupt or truncated tar member: {type(exn).__name__}: {exn}", shard, key or "?") from exn


class ShardStream(IterableDataset):
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
        self._epoch = torch.zeros(1, dtype=torch.int64).share_memory_()

    # ---------------------------------------------------------------- epoch / size
    def set_epoch(self, epoch: int) -> None:
        self._epoch[0] = int(epoch)

    @property
    def epoch(self) -> int:
        return int(self._epoch[0])

    def __len__(self) -> int:
        return num_batches(self.num_local, self.batch_size, self.drop_last)

    def local_ids(self) -> torch.Tensor:
        """Global sample id of each local index (position in the concatenated shard list)."""
        ids = torch.empty(self.num_local, dtype=torch.int64)
        for s, a, b, base in self.segments:
            ids[base:base + b - a] = torch.arange(self.shard_offsets[s] + a, self.shard_offsets[s] + b)
        return ids

    # ---------------------------------------------------------------- shard access
    def _open(self, url: str, row: int):
        path = local_path(url)
        if self.disk_cache is not None and (path is None or self.disk_cache.cache_local):
            path, _ = self.disk_cache.fetch(url, self.stats, row)
        if path is not None:
            return open(path, "rb"), True
        return gopen(url, "rb"), False

    def _read_segment(self, seg: Segment, row: int, worker: int):
        """Items ``(kind, local, gid, shard, key, payload)`` for one segment; kind is raw/dec/bad."""
        s, a, b, base = seg
        url, arena = self.urls[s], self.arena
        gid0 = self.shard_offsets[s]
        first_miss = a
        if arena is not None:
            while first_miss < b and arena.has(base + first_miss - a):
                first_miss += 1
        for i in range(a, first_miss):  # cached prefix: no shard access at all
            self.stats[row, S["ram_hits"]] += 1
            yield ("dec" if arena.level == "decoded" else "raw", base + i - a, gid0 + i, url, "?", arena.get(base + i - a))
        if first_miss == b:
            return
        seen = first_miss
        try:
            stream, seekable = self._open(url, row)
            with stream:
                for i, key, raw in iter_tar(stream, url, seekable, first_miss, b):
                    local = base + i - a
                    if arena is not None and arena.has(local):
                        self.stats[row, S["ram_hits"]] += 1
                        yield ("dec" if arena.level == "decoded" else "raw", local, gid0 + i, url, key, arena.get(local))
                    else:
                        if arena is not None:
                            self.stats[row, S["ram_misses"]] += 1
                            if arena.level == "encoded":
                                arena.put(local, raw, worker)
                        yield ("raw", local, gid0 + i, url, key, raw)
                    seen = i + 1
        except BadSampleError as exn:
            if self.on_bad_sample == "raise":
                raise
            warnings.warn(f"skipping {b - seen} samples: {exn}", RuntimeWarning, stacklevel=2)
        if seen < b:
            msg = f"shard ended after {seen} samples, expected {b}"
            if self.on_bad_sample == "raise":
                raise BadSampleError(msg + " (shard changed since it was counted?)", url, "?")
            for i in range(seen, b):
                yield ("bad", base + i - a, gid0 + i, url, "?", msg)

    def _read_resampled(self, quota: int, rng: random.Random, row: int):
        produced, dry = 0, 0
        while produced < quota:
            url = rng.choice(self.urls)
            got = 0
            try:
                stream, seekable = self._open(url, row)
                with stream:
                    for _, key, raw in iter_tar(stream, url, seekable):
                        yield ("raw", -1, -1, url, key, raw)
                        got += 1
                        produced += 1
                        if produced >= quota:
                            return
            except BadSampleError:
                if self.on_bad_sample == "raise":
                    raise
                self.stats[row, S["bad_skipped"]] += 1
            dry = 0 if got else dry + 1
            if dry > 10 * len(self.urls):
                raise RuntimeError(f"no readable samples in shards {self.urls[:3]}...")

    # ---------------------------------------------------------------- iteration
    def _decode_items(self, items, row: int, worker: int):
        """Decode, cache decoded samples, apply the transform; bad samples become repeats when skipping."""
        last, pending = None, 0
        for kind, local, gid, shard, key, payload in items:
            try:
                if kind == "bad":
                    raise BadSampleError(payload, shard, key)
                sample = self.decoder(payload, shard, key) if kind == "raw" else payload
                if kind == "raw" and isinstance(self.arena, DecodedArena) and local >= 0:
                    self.arena.put(local, sample, worker)
            except BadSampleError as exn:
                if self.on_bad_sample == "raise":
                    raise
                warnings.warn(f"skipping bad sample: {exn}", RuntimeWarning, stacklevel=2)
                self.stats[row, S["bad_skipped"]] += 1
                if last is None:
                    pending += 1
                else:
                    yield last
                continue
            if self.transform is not None:
                sample = self.transform(sample)
                sample = sample if isinstance(sample, tuple) else (sample,)
            last = (local, gid, sample)
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
        worker, nworkers = (info.id, info.num_workers) if info is not None else (0, 1)
        row = worker if info is not None else self.stats.shape[0] - 1
        epoch = self.epoch
        rng = random.Random(mix_seed(self.seed, 3, epoch, self.rank, worker))
        if self.resampled:
            nb = len(self)
            from .split import worker_batch_range
            b0, b1 = worker_batch_range(nb, worker, nworkers)
            quota = min(self.num_local, b1 * self.batch_size) - min(self.num_local, b0 * self.batch_size)
            items = self._read_resampled(quota, rng, row)
        else:
            order = epoch_order(self.segments, epoch, self.seed, self.rank, self.shuffle)
            mine = worker_segments(order, self.batch_size, self.drop_last, worker, nworkers)
            items = (it for seg in mine for it in self._read_segment(seg, row, worker))
        if self.shuffle and self.shuffle_buffer > 1:
            items = _shuffle(items, bufsize=self.shuffle_buffer, initial=self.shuffle_buffer, rng=rng)
        return self._batches(self._decode_items(items, row, worker))

    # ---------------------------------------------------------------- served from the main process
    def ram_servable(self) -> bool:
        return isinstance(self.arena, DecodedArena) and self.transform is None and self.arena.complete()

    def _epoch_perm(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_local)
        g = torch.Generator().manual_seed(mix_seed(self.seed, 4, epoch, self.rank) & 0x7FFFFFFFFFFFFFFF)
        return torch.randperm(self.num_local, generator=g)

    def iter_indices(self, epoch: int) -> Iterator[torch.Tensor]:
        perm = self._epoch_perm(epoch)
        for i in range(len(self)):
            yield perm[i * self.batch_size:(i + 1) * self.batch_size]

    def iter_ram(self, epoch: int) -> Iterator[dict]:
        """An epoch from the decoded RAM level: one gather per batch in the main process."""
        ids, row = self.local_ids(), self.stats.shape[0] - 1
        for idx in self.iter_indices(epoch):
            self.stats[row, S["ram_hits"]] += len(idx)
            yield {"local": idx, "ids": ids[idx], "data": (self.arena.images[idx], self.arena.labels[idx])}

    def iter_gpu(self, epoch: int) -> Iterator[dict]:
        """An epoch from the device level: only index tensors leave the host."""
        ids = self.local_ids()
        for idx in self.iter_indices(epoch):
            yield {"local": idx, "ids": ids[idx], "served": "gpu"}
