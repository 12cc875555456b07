"""Reading shards: the samples of a tar archive in order (:func:`iter_tar`), and :class:`ShardReader`, the part of
:class:`~lightning_topk.data.stream.ShardStream` that opens shards (through the disk cache) and reads the samples
of a segment, of positions along segments, or of shards drawn with replacement, serving RAM-cache hits without
touching the shard."""
from __future__ import annotations

import random
import tarfile
import warnings
from typing import Callable, Optional, Sequence

from webdataset.gopen import gopen
from webdataset.tariterators import base_plus_ext

from .cache import S
from .decode import BadSampleError
from .index import local_path
from .split import Segment


def iter_tar(fileobj, shard: str, seekable: bool, start: int = 0, stop: Optional[int] = None,
             want: Optional[Callable[[int], bool]] = None):
    """Yield ``(index, key, {ext: bytes})`` for samples ``start..stop-1``; earlier members are not read.

    Samples for which ``want(index)`` is false come as ``(index, key, None)``: their data is not read
    (a seekable file skips it). A truncated or corrupt archive raises BadSampleError naming the shard
    and the last key seen.
    """
    key, members, index, read = None, {}, -1, False
    try:
        tf = tarfile.open(fileobj=fileobj, mode="r:" if seekable else "r|")
        for m in tf:
            if not m.isreg():
                continue
            k, ext = base_plus_ext(m.name)
            if k is None or (k.startswith("__") and k.endswith("__")):
                continue
            if k != key:
                if key is not None and index >= start:
                    yield index, key, members if read else None
                key, members, index = k, {}, index + 1
                if stop is not None and index >= stop:
                    return
                read = index >= start and (want is None or want(index))
            if read:
                members[ext.lower()] = tf.extractfile(m).read()
            if not seekable:
                tf.members = []
        if key is not None and index >= start:
            yield index, key, members if read else None
    except (tarfile.TarError, OSError, EOFError) as exn:
        raise BadSampleError(f"corrupt or truncated tar member: {type(exn).__name__}: {exn}", shard, key or "?") from exn


class ShardReader:
    """Shard access of :class:`~lightning_topk.data.stream.ShardStream` (its base): reads ``urls``,
    ``shard_offsets``, ``arena``, ``disk_cache``, ``stats`` and ``on_bad_sample`` of the stream."""

    def _open(self, url: str, row: int):
        path = local_path(url)
        if self.disk_cache is not None and (path is None or self.disk_cache.cache_local):
            path, _ = self.disk_cache.fetch(url, self.stats, row)
        if path is not None:
            return open(path, "rb"), True
        return gopen(url, "rb"), False

    def _read_segment(self, seg: Segment, row: int, worker: int, want: Optional[Callable[[int], bool]] = None):
        """Items ``(kind, local, gid, shard, key, payload)`` (kind raw/dec/bad) for the samples of one segment
        that ``want`` (a predicate on the index in the shard; default: all) selects; others are not read."""
        s, a, b, base = seg
        url, arena = self.urls[s], self.arena
        gid0 = self.shard_offsets[s]
        wanted = want or (lambda i: True)
        cached = (lambda i: False) if arena is None else (lambda i: arena.has(base + i - a))

        def hit(i, key):
            self.stats[row, S["ram_hits"]] += 1
            kind = "dec" if arena.level == "decoded" else "raw"
            return (kind, base + i - a, gid0 + i, url, key, arena.get(base + i - a))

        first_miss = a
        while first_miss < b and (not wanted(first_miss) or cached(first_miss)):  # no shard access for these
            if wanted(first_miss):
                yield hit(first_miss, "?")
            first_miss += 1
        if first_miss == b:
            return
        seen = first_miss
        try:
            stream, seekable = self._open(url, row)
            with stream:
                for i, key, raw in iter_tar(stream, url, seekable, first_miss, b, lambda i: wanted(i) and not cached(i)):
                    seen = i + 1
                    if not wanted(i):
                        continue
                    if raw is None:
                        yield hit(i, key)
                        continue
                    local = base + i - a
                    if arena is not None:
                        self.stats[row, S["ram_misses"]] += 1
                        if arena.level == "encoded":
                            arena.put(local, raw, worker)
                    yield ("raw", local, gid0 + i, url, key, raw)
        except BadSampleError as exn:
            if self.on_bad_sample == "raise":
                raise
            warnings.warn(f"skipping {b - seen} samples: {exn}", RuntimeWarning, stacklevel=2)
        if seen < b:
            msg = f"shard ended after {seen} samples, expected {b}"
            if self.on_bad_sample == "raise":
                raise BadSampleError(msg + " (shard changed since it was counted?)", url, "?")
            for i in range(seen, b):
                if wanted(i):
                    yield ("bad", base + i - a, gid0 + i, url, "?", msg)

    def _read_positions(self, segs: Sequence[Segment], row: int, worker: int, keep: Optional[bytearray]):
        """``(position, item)`` for the samples of ``segs`` (positions count along them) that ``keep``
        marks (default: all); segments without a marked sample are not opened."""
        pos = 0
        for seg in segs:
            s, a, b, base = seg
            p0 = pos - a  # position of the shard's sample i is p0 + i
            pos += b - a
            if keep is not None and not any(keep[p0 + a:pos]):
                continue
            want = None if keep is None else (lambda i, p0=p0: keep[p0 + i] == 1)
            for item in self._read_segment(seg, row, worker, want):
                yield p0 + a + item[1] - base, item

    def _read_resampled(self, quota: int, rng: random.Random, row: int, keep: Optional[bytearray]):
        """``(position, item)`` for ``quota`` samples of shards drawn with replacement by ``rng``; only the
        positions ``keep`` marks (default: all) are read."""
        produced, dry = 0, 0
        while produced < quota:
            url = rng.choice(self.urls)
            got = 0
            try:
                stream, seekable = self._open(url, row)
                with stream:
                    want = None if keep is None else (lambda i, p0=produced: p0 + i < quota and keep[p0 + i] == 1)
                    for _, key, raw in iter_tar(stream, url, seekable, want=want):
                        if raw is not None:
                            yield produced, ("raw", -1, -1, url, key, raw)
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
