"""The three cache levels: local disk (remote shards), RAM (shared by a rank's workers), device.

RAM design: a rank's cache is one block of shared memory (``torch`` shared tensors, so the same pages
are mapped by the main process and by every DataLoader worker, with fork, spawn or forkserver, and by
persistent workers). It is allocated in the main process at setup and filled by the workers as they
read samples on the first epoch; no worker holds a private copy. The decoded level stores fixed-size
uint8 images at slot = the sample's local index, so once complete the main process serves whole
epochs by indexing it (no workers, no decoding, no per-sample Python). The encoded level stores the
raw members in per-worker regions (bump allocation, no locks) and is read back by the workers.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
import warnings
from typing import Dict, Optional, Tuple

import torch
from webdataset.gopen import gopen

from lightning_topk.files import publish

# stats counters (one row per worker + one for the main process)
STATS = ("ram_hits", "ram_misses", "disk_hits", "disk_misses", "bad_skipped")
S = {name: i for i, name in enumerate(STATS)}


def new_stats(num_workers: int) -> torch.Tensor:
    return torch.zeros(max(num_workers, 1) + 1, len(STATS), dtype=torch.int64).share_memory_()


class DiskCache:
    """Stores fetched shards in ``directory`` under a hash of their full URL (no name collisions).

    Writes are atomic (:mod:`lightning_topk.files`); the directory is kept under ``max_bytes`` by
    evicting the least recently used shards. A shard larger than the budget is streamed uncached.
    """

    def __init__(self, directory: str, max_bytes: int, cache_local: bool = False):
        if max_bytes <= 0:
            raise ValueError(f"disk_cache_bytes must be > 0, got {max_bytes}")
        self.directory = os.path.abspath(directory)
        self.max_bytes = int(max_bytes)
        self.cache_local = cache_local
        os.makedirs(self.directory, exist_ok=True)

    def path_for(self, url: str) -> str:
        base = re.sub(r"[^A-Za-z0-9._-]", "_", os.path.basename(url.rstrip("/|")))[-80:] or "shard"
        return os.path.join(self.directory, hashlib.sha1(url.encode()).hexdigest()[:20] + "-" + base)

    def fetch(self, url: str, stats: Optional[torch.Tensor] = None, row: int = -1) -> Tuple[str, bool]:
        """Local path of the cached shard (fetching it on a miss) and whether it is kept in the cache."""
        path = self.path_for(url)
        if os.path.isfile(path):
            try:
                os.utime(path)  # LRU clock
                if stats is not None:
                    stats[row, S["disk_hits"]] += 1
                return path, True
            except FileNotFoundError:
                pass  # evicted by another process just now
        if stats is not None:
            stats[row, S["disk_misses"]] += 1
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=self.directory)
        try:
            with os.fdopen(fd, "wb") as out, gopen(url, "rb") as src:
                shutil.copyfileobj(src, out, 1 << 20)
        except BaseException:
            os.unlink(tmp)
            raise
        if os.path.getsize(tmp) > self.max_bytes:
            warnings.warn(f"shard {url} is larger than disk_cache_bytes={self.max_bytes}; streaming it uncached", RuntimeWarning, stacklevel=2)
            return tmp, False
        publish(tmp, path, fsync=False)  # a cache: a lost copy is fetched again
        self.evict(keep=path)
        return path, True

    def evict(self, keep: str) -> None:
        entries = []
        for name in os.listdir(self.directory):
            p = os.path.join(self.directory, name)
            if name.startswith(".tmp-"):
                continue
            try:
                st = os.stat(p)
            except FileNotFoundError:
                continue
            entries.append((st.st_mtime, st.st_size, p))
        total = sum(e[1] for e in entries)
        for _, size, p in sorted(entries):
            if total <= self.max_bytes:
                break
            if p == keep:
                continue
            try:
                os.unlink(p)
                total -= size
            except FileNotFoundError:
                pass

    def held_bytes(self) -> int:
        total = 0
        for name in os.listdir(self.directory):
            if not name.startswith(".tmp-"):
                try:
                    total += os.path.getsize(os.path.join(self.directory, name))
                except FileNotFoundError:
                    pass
        return total


def pack_members(raw: Dict[str, bytes]) -> bytes:
    """Serialise a raw sample's members: [ext_len u8][ext][data_len u32 LE][data] ..."""
    parts = []
    for ext, data in raw.items():
        if ext.startswith("__"):
            continue
        e = ext.encode()
        parts += [bytes([len(e)]), e, len(data).to_bytes(4, "little"), data]
    return b"".join(parts)


def unpack_members(buf: memoryview) -> Dict[str, bytes]:
    out, i = {}, 0
    while i < len(buf):
        n = buf[i]
        ext = bytes(buf[i + 1:i + 1 + n]).decode()
        i += 1 + n
        m = int.from_bytes(buf[i:i + 4], "little")
        out[ext] = bytes(buf[i + 4:i + 4 + m])
        i += 4 + m
    return out


class EncodedArena:
    """RAM level, encoded: raw sample bytes for a rank's local indices, in shared memory."""

    level = "encoded"

    def __init__(self, num_local: int, budget_bytes: int, num_workers: int):
        self.regions = max(num_workers, 1)
        self.region_bytes = int(budget_bytes) // self.regions
        self.data = torch.empty(self.region_bytes * self.regions, dtype=torch.uint8).share_memory_()
        self.ptr = torch.zeros(self.regions, dtype=torch.int64).share_memory_()
        # directory: offset, length (-1 = not cached); length is written last and acts as commit flag
        self.dir = torch.full((num_local, 2), -1, dtype=torch.int64).share_memory_()

    def has(self, local: int) -> bool:
        return bool(self.dir[local, 1] >= 0)

    def get(self, local: int) -> Dict[str, bytes]:
        off, n = self.dir[local].tolist()
        return unpack_members(memoryview(self.data[off:off + n].numpy()))

    def put(self, local: int, raw: Dict[str, bytes], worker: int) -> bool:
        if self.has(local):
            return True
        blob = pack_members(raw)
        region = worker % self.regions
        start = int(self.ptr[region])
        if start + len(blob) > self.region_bytes:
            return False
        off = region * self.region_bytes + start
        self.data[off:off + len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        self.ptr[region] = start + len(blob)
        self.dir[local, 0] = off
        self.dir[local, 1] = len(blob)
        return True

    def held_bytes(self) -> int:
        return int(self.ptr.sum())


class DecodedArena:
    """RAM level, decoded: fixed-size uint8 images + int64 labels at slot = local index.

    Only local indices below ``capacity`` (= budget // bytes per sample) are cached, so a smaller
    budget caches a fixed prefix of the rank's partition and the rest streams as usual.
    """

    level = "decoded"

    def __init__(self, num_local: int, budget_bytes: int, shape: Tuple[int, ...]):
        per = int(torch.Size(shape).numel()) + 8
        self.capacity = min(num_local, int(budget_bytes) // per)
        self.num_local = num_local
        self.images = torch.empty((self.capacity, *shape), dtype=torch.uint8).share_memory_()
        self.labels = torch.empty(self.capacity, dtype=torch.int64).share_memory_()
        self.filled = torch.zeros(self.capacity, dtype=torch.uint8).share_memory_()

    def has(self, local: int) -> bool:
        return local < self.capacity and bool(self.filled[local])

    def get(self, local: int) -> tuple:
        return (self.images[local].clone(), int(self.labels[local]))

    def put(self, local: int, sample: tuple, worker: int = 0) -> bool:
        if local >= self.capacity:
            return False
        img, label = sample
        if tuple(img.shape) != tuple(self.images.shape[1:]) or img.dtype != torch.uint8:
            raise ValueError(f"ram_cache='decoded' needs fixed-size uint8 images {tuple(self.images.shape[1:])}, "
                             f"got {img.dtype} {tuple(img.shape)}; set image_size=")
        self.images[local] = img
        self.labels[local] = int(label)
        self.filled[local] = 1
        return True

    def held_bytes(self) -> int:
        per = self.images[0].numel() + 8 if self.capacity else 0
        return int(self.filled.sum()) * per

    def missing(self) -> torch.Tensor:
        """Local indices below ``capacity`` not held yet."""
        return (self.filled == 0).nonzero().flatten()


class GpuCache:
    """Device level: the rank's decoded uint8 images and labels resident on the training device.

    Filled from batches after they reach the device during the first epoch; serves later epochs by
    index so no decoding and no host-to-device image copy happens. Samples decoded on the host to
    complete it (:meth:`stage`) are copied to the device on its next use, where the device is known.
    """

    def __init__(self, num_local: int, budget_bytes: int, shape: Tuple[int, ...]):
        self.num_local, self.shape = num_local, tuple(shape)
        self.per_sample = int(torch.Size(shape).numel()) + 8
        self.enabled = num_local * self.per_sample <= budget_bytes
        if not self.enabled:
            warnings.warn(f"gpu_cache_bytes={budget_bytes} is smaller than this rank's {num_local} samples "
                          f"({num_local * self.per_sample} bytes); the GPU cache level is off", RuntimeWarning, stacklevel=2)
        self.images = self.labels = self.filled = None
        self.staged = []  # (local, images, labels) on the host, waiting for the device
        self.hits = 0

    def _ready(self, device: torch.device) -> None:
        if self.images is None:
            self.images = torch.empty((self.num_local, *self.shape), dtype=torch.uint8, device=device)
            self.labels = torch.empty(self.num_local, dtype=torch.int64, device=device)
            self.filled = torch.zeros(self.num_local, dtype=torch.bool, device=device)
        staged, self.staged = self.staged, []
        for local, images, labels in staged:
            self._write(local, images, labels)

    def _write(self, local: torch.Tensor, images: torch.Tensor, labels: torch.Tensor) -> None:
        device = self.images.device
        local = local.to(device)
        self.images[local] = images.to(device)
        self.labels[local] = labels.to(device)
        self.filled[local] = True

    def put(self, local: torch.Tensor, images: torch.Tensor, labels: torch.Tensor) -> None:
        if not self.enabled:
            return
        self._ready(images.device)
        self._write(local, images, labels)

    def stage(self, local: torch.Tensor, images: torch.Tensor, labels: torch.Tensor) -> None:
        """Host tensors to be written at the next :meth:`put`/:meth:`get` (on that call's device)."""
        self.staged.append((local, images, labels))

    def missing(self) -> torch.Tensor:
        """Local indices neither held nor staged (one device-to-host copy)."""
        held = torch.zeros(self.num_local, dtype=torch.bool) if self.filled is None else self.filled.cpu()
        for local, _, _ in self.staged:
            held[local] = True
        return (~held).nonzero().flatten()

    def get(self, local: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        self._ready(local.device)
        local = local.to(self.images.device)
        self.hits += int(local.numel())
        return self.images[local], self.labels[local]

    def held_bytes(self) -> int:
        return 0 if not self.enabled else (self.num_local - len(self.missing())) * self.per_sample
