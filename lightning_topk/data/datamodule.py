"""WebDataModule: WebDataset tar shards for Lightning, correct under DDP, with disk/RAM/device caches."""
from __future__ import annotations

import multiprocessing
import platform
import re
import signal
import sys
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader

from .cache import STATS, DecodedArena, DiskCache, EncodedArena, GpuCache, new_stats
from .decode import SampleDecoder
from .index import expand_shards, shard_infos
from .reader import iter_tar
from .stream import LocalSamples, ShardStream
from .transforms import BatchAugment, resolve_callable

RAM_LEVELS = ("off", "encoded", "decoded")
BAD_SAMPLE = ("raise", "skip")
WORKER_START = ("auto", None, "fork", "spawn", "forkserver")
# CPython releases that fixed gh-112275 (a forked child deadlocks in PyOS_AfterFork_Child when another thread
# held the interpreter's HEAD_LOCK at the fork); 3.12 and later never had it.
_FORK_FIXED = {(3, 8): 20, (3, 9): 20, (3, 10): 15, (3, 11): 10}
MID_EPOCH_RESUME = ("exact", "restart_epoch")
STATE_FORMAT = "lightning_topk.WebLoader/1"
GiB = 1 << 30


def fork_can_deadlock(version: Optional[Tuple[int, ...]] = None, implementation: Optional[str] = None) -> bool:
    """Whether this CPython can deadlock in a child forked while another thread runs (gh-112275): CPython
    before 3.8.20, 3.9.20, 3.10.15 and 3.11.10. Training runs threads (the heartbeat of ``topk_ddp``, loggers,
    pin-memory threads), so DataLoader workers started with ``fork`` can hang there, rarely and for good."""
    v = tuple(sys.version_info[:3] if version is None else version)
    if (implementation or sys.implementation.name) != "cpython" or v[:2] >= (3, 12):
        return False
    fixed = _FORK_FIXED.get(v[:2])
    return True if fixed is None else v[2] < fixed


_MAIN_GUARD = re.compile(r"""^\s*if\s+__name__\s*==\s*(['"])__main__\1\s*:""", re.M)


def main_is_guarded(path: Optional[str] = None) -> bool:
    """Whether the main script (``path``, default ``__main__.__file__``) can be imported without running:
    forkserver and spawn workers import it (as ``__mp_main__``), so an unguarded training script would run
    again in every worker. No file (``python -c``, a REPL): nothing is imported, True."""
    if path is None:
        path = getattr(sys.modules.get("__main__"), "__file__", None)
        if path is None:
            return True
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return bool(_MAIN_GUARD.search(f.read()))
    except OSError:
        return False


def resolve_worker_start(worker_start: Optional[str]) -> Optional[str]:
    """``"auto"``: ``"forkserver"`` where :func:`fork_can_deadlock` (and the platform has it) and the main
    script is guarded (:func:`main_is_guarded`), else ``None`` (the platform default: fork on Linux), with a
    warning when the unguarded script is what keeps fork. Any other value is returned as is."""
    if worker_start != "auto":
        return worker_start
    if fork_can_deadlock() and "forkserver" in multiprocessing.get_all_start_methods():
        if main_is_guarded():
            return "forkserver"
        rank_zero_warn("lightning_topk: DataLoader workers start with fork, which can deadlock on this CPython "
                       f"{platform.python_version()} while other threads run (gh-112275). Forkserver would "
                       "re-run this script in every worker: add an `if __name__ == \"__main__\":` guard to it "
                       "(then workers start with forkserver), or set worker_start explicitly.")
    return None


def start_forkserver() -> None:
    """Start multiprocessing's fork server (if not running) with the SLURM requeue signal blocked, so that the
    workers forked from it never receive it: SLURM signals every process of the step, and a worker started by
    forkserver or spawn would otherwise die of SIGUSR1 (its default action), failing the training step. The
    signal mask is inherited through fork and exec; this process unblocks it at once (nothing is lost)."""
    from multiprocessing import forkserver

    from lightning_topk.lightning.faults import requeue_signals

    # Import what every worker needs once, in the fork server, instead of in each worker it forks (only
    # takes effect when this call starts the server).
    forkserver.set_forkserver_preload(["__main__", "torch", "lightning_topk.data.datamodule"])
    sigs = set(requeue_signals())
    if not sigs or not hasattr(signal, "pthread_sigmask"):
        forkserver.ensure_running()
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    try:
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class WebLoader(DataLoader):
    """DataLoader over a ShardStream: places each pass (epoch, first batch), serves epochs after the first
    from the device or decoded RAM level, and resumes mid-epoch exactly through the ``state_dict`` /
    ``load_state_dict`` pair that Lightning saves with the fit loop. See "Resume" in docs/data.md.

    ``position_fn()`` returns the trainer's ``(epoch, batch index)`` for the pass about to start; without
    it the epoch comes from an internal counter (0, 1, ...; :meth:`set_epoch` pins it) and the batch index
    from a loaded state. The position is read when the first batch is requested, not in ``iter()``.
    """

    def __init__(self, dataset, *args, gpu_cache: Optional[GpuCache] = None, position_fn: Optional[Callable] = None,
                 mid_epoch_resume: str = "exact", **kw):
        super().__init__(dataset, *args, **kw)
        self.gpu_cache, self.position_fn, self.mid_epoch_resume = gpu_cache, position_fn, mid_epoch_resume
        self._next_epoch = 0
        self._epoch: Optional[int] = None
        self._consumed = 0
        self._level: Optional[str] = None
        self._loaded: Optional[dict] = None

    def set_epoch(self, epoch: int) -> None:
        self._next_epoch = int(epoch)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> Dict[str, Any]:
        """Epoch, batches of it handed to the training loop (not those workers prefetched), and the options
        that fix the order of its batches."""
        return {"format": STATE_FORMAT, "epoch": self._epoch, "consumed": self._consumed,
                "options": self._options(self._level)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError(f"not a WebLoader state (format {STATE_FORMAT!r}): {str(state)[:200]}")
        self._loaded = state

    def _options(self, level: Optional[str]) -> Dict[str, Any]:
        """What the order of an epoch's batches depends on, besides seed and epoch, by option name."""
        ds = self.dataset
        out = {"world_size": ds.world_size, "batch_size": ds.batch_size, "drop_last": ds.drop_last, "seed": ds.seed,
               "shuffle": ds.shuffle, "samples_per_epoch": ds.num_local * ds.world_size if ds.resampled else None,
               "train_shards": f"{len(ds.urls)} shards, {ds.num_local} samples per rank"}
        if level is not None:
            out["ram_cache/gpu_cache (level serving the epoch)"] = level
        if level == "stream":
            out.update(num_workers=self.num_workers, shuffle_buffer=ds.shuffle_buffer)
        return out

    def _check(self, saved: Dict[str, Any], epoch: int, start: int, level: Optional[str]) -> int:
        """The batch to resume at: ``start``, or 0 (with a warning) if an option changed and
        ``mid_epoch_resume='restart_epoch'``; raises if one changed and it is 'exact'."""
        now = self._options(level)
        for name, value in now.items():
            old = saved["options"].get(name, value)
            if old != value:
                option = name.split(" ")[0]
                msg = (f"resuming epoch {epoch} at batch {start}: {option} was {old!r} when the checkpoint was written "
                       f"and is {value!r} now, so the rest of the epoch cannot be reproduced")
                if self.mid_epoch_resume == "exact":
                    raise ValueError(msg + f". Set {option} back, resume from an end-of-epoch checkpoint, or pass "
                                           "mid_epoch_resume='restart_epoch' to replay the epoch from its start")
                rank_zero_warn(msg + "; mid_epoch_resume='restart_epoch': replaying the epoch from its start")
                return 0
        return start

    def _position(self) -> Tuple[int, int, Optional[dict]]:
        loaded, self._loaded = self._loaded, None
        pos = self.position_fn() if self.position_fn is not None else None
        if pos is None and loaded is not None and loaded["epoch"] is not None:
            e, c = loaded["epoch"], loaded["consumed"]
            pos = (e, c) if c < len(self) else (e + 1, 0)
        epoch, start = pos if pos is not None else (self._next_epoch, 0)
        self._next_epoch = epoch + 1
        if start and loaded is None:
            rank_zero_warn(f"resuming epoch {epoch} at batch {start}, but the checkpoint holds no WebLoader state "
                           "(written by an older version?): replaying the epoch from its start")
            start = 0
        elif start and (loaded["epoch"], loaded["consumed"]) != (epoch, start):
            rank_zero_warn(f"the loader state was saved at epoch {loaded['epoch']} batch {loaded['consumed']}, the "
                           f"trainer resumes epoch {epoch} at batch {start} (checkpoint written during a step, e.g. "
                           "on a signal); following the trainer")
        return epoch, start, loaded

    # ------------------------------------------------------------------ passes
    def _serving_level(self, epoch: int) -> str:
        """Which level serves ``epoch``: the first epoch streams (and fills the levels); later ones come from the
        device level, else the decoded RAM level, once the level holds the whole partition. Samples a level
        lacks (a resumed job, or batches the first epoch never reached) are decoded first, so the choice
        depends on the epoch and the options only."""
        ds, gc = self.dataset, self.gpu_cache
        use_gpu = gc is not None and gc.enabled
        if epoch == 0 or not (use_gpu or ds.ram_servable()):
            return "stream"
        if ds.ram_servable():
            for _ in self._decode_locals(ds.arena.missing()):  # the workers write into the shared level
                pass
        ram = ds.ram_servable() and not len(ds.arena.missing())
        if use_gpu:
            miss = gc.missing()
            if ram and len(miss):
                gc.stage(miss, ds.arena.images[miss], ds.arena.labels[miss])
            elif not ram:
                for batch in self._decode_locals(miss):
                    gc.stage(batch["local"], *batch["data"])
            if not len(gc.missing()):
                return "gpu"
        return "ram" if ram else "stream"

    def _decode_locals(self, local: torch.Tensor):
        """Decoded batches of these local indices, by this loader's workers."""
        if not len(local):
            return iter(())
        kw = dict(num_workers=self.num_workers)
        if self.num_workers:
            kw.update(multiprocessing_context=self.multiprocessing_context)
        return iter(DataLoader(LocalSamples(self.dataset, local), batch_size=None, **kw))

    def __iter__(self):
        epoch, start, loaded = self._position()
        if start:
            start = self._check(loaded, epoch, start, None)
        level = self._serving_level(epoch)
        if start:
            start = self._check(loaded, epoch, start, level)
        self._epoch, self._consumed, self._level = epoch, start, level
        ds = self.dataset
        ds.set_position(epoch, start)
        if level == "gpu":
            batches = ds.iter_gpu(epoch, start)
        elif level == "ram":
            batches = ds.iter_ram(epoch, start)
        else:
            batches = super().__iter__()
        for batch in batches:
            batch["pos"] = (epoch, self._consumed)
            self._consumed += 1
            yield batch


class CacheStatsLogger(pl.Callback):
    """Logs the data module's cache counters (``data/<name>``, summed over ranks) at each train epoch end."""

    def __init__(self, prog_bar: bool = False):
        self.prog_bar = prog_bar

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        dm = trainer.datamodule
        if not isinstance(dm, WebDataModule):
            return
        for k, v in dm.cache_stats().items():
            pl_module.log(f"data/{k}", float(v), on_epoch=True, sync_dist=True, reduce_fx="sum",
                          prog_bar=self.prog_bar and k.endswith("hits"))


class WebDataModule(pl.LightningDataModule):
    """LightningDataModule over WebDataset tar shards. See docs/data.md for every option.

    Batches leave the loaders as dicts (``local``, ``ids``, ``data``) and become ``(images, labels, ...)``
    tuples in :meth:`on_after_batch_transfer`, after the batched augmentation on the device.
    """

    def __init__(self, train_shards: Union[str, Sequence[str]], val_shards: Union[str, Sequence[str], None] = None,
                 keys: Sequence[str] = ("png;jpg", "cls"), batch_size: int = 64, val_batch_size: Optional[int] = None,
                 num_workers: int = 2, seed: int = 0, shuffle: bool = True, shuffle_buffer: int = 1000,
                 drop_last: bool = False, samples_per_epoch: Optional[int] = None, shard_sizes: Any = None,
                 image_mode: str = "RGB", image_size: Any = None, transform: Any = None, val_transform: Any = None,
                 crop_padding: int = 0, flip: bool = False, mean: Optional[Sequence[float]] = None,
                 std: Optional[Sequence[float]] = None, disk_cache_dir: Optional[str] = None,
                 disk_cache_bytes: int = 20 * GiB, disk_cache_local: bool = False, ram_cache: str = "off",
                 ram_cache_bytes: int = 4 * GiB, gpu_cache: bool = False, gpu_cache_bytes: int = 4 * GiB,
                 on_bad_sample: str = "raise", persistent_workers: bool = False, pin_memory: bool = False,
                 worker_start: Optional[str] = "auto", log_cache_stats: bool = True, mid_epoch_resume: str = "exact",
                 rank: Optional[int] = None, world_size: Optional[int] = None):
        super().__init__()
        if ram_cache not in RAM_LEVELS:
            raise ValueError(f"ram_cache must be one of {RAM_LEVELS}, got {ram_cache!r}")
        if on_bad_sample not in BAD_SAMPLE:
            raise ValueError(f"on_bad_sample must be one of {BAD_SAMPLE}, got {on_bad_sample!r}")
        if worker_start not in WORKER_START:
            raise ValueError(f"worker_start must be one of {WORKER_START}, got {worker_start!r}")
        if mid_epoch_resume not in MID_EPOCH_RESUME:
            raise ValueError(f"mid_epoch_resume must be one of {MID_EPOCH_RESUME}, got {mid_epoch_resume!r}")
        for name, v in (("batch_size", batch_size), ("num_workers", num_workers + 1), ("shuffle_buffer", shuffle_buffer + 1)):
            if int(v) < 1:
                raise ValueError(f"{name} must be {'>= 1' if name == 'batch_size' else '>= 0'}, got {v}")
        if samples_per_epoch is not None and (ram_cache != "off" or gpu_cache):
            raise ValueError("samples_per_epoch (resampled shards) draws a different sample set each epoch; "
                             "it cannot be combined with ram_cache or gpu_cache")
        if transform is not None and (ram_cache == "decoded" or gpu_cache):
            raise ValueError("transform= runs per sample on CPU after decoding, which ram_cache='decoded' and gpu_cache "
                             "skip; use crop_padding/flip/mean/std (batched, on device) or ram_cache='encoded'")
        self.train_shards, self.val_shards, self.keys = train_shards, val_shards, tuple(keys)
        self.batch_size, self.val_batch_size = int(batch_size), int(val_batch_size or batch_size)
        self.num_workers, self.seed, self.shuffle, self.shuffle_buffer = int(num_workers), int(seed), shuffle, int(shuffle_buffer)
        self.drop_last, self.samples_per_epoch, self.shard_sizes = drop_last, samples_per_epoch, shard_sizes
        self.decoder = SampleDecoder(self.keys, image_mode, image_size)
        self.transform = resolve_callable(transform, "transform", need_pickle=num_workers > 0)
        self.val_transform = resolve_callable(val_transform, "val_transform", need_pickle=num_workers > 0)
        self.augment_args = dict(crop_padding=crop_padding, flip=flip, mean=mean, std=std)
        BatchAugment(**self.augment_args)  # validate now
        self.disk_cache = DiskCache(disk_cache_dir, disk_cache_bytes, disk_cache_local) if disk_cache_dir else None
        self.ram_cache, self.ram_cache_bytes = ram_cache, int(ram_cache_bytes)
        self.gpu_cache_on, self.gpu_cache_bytes = bool(gpu_cache), int(gpu_cache_bytes)
        self.on_bad_sample, self.persistent_workers, self.pin_memory = on_bad_sample, persistent_workers, pin_memory
        self.worker_start, self.log_cache_stats, self.mid_epoch_resume = worker_start, log_cache_stats, mid_epoch_resume
        self._rank, self._world = rank, world_size
        self.train_set: Optional[ShardStream] = None
        self.val_set: Optional[ShardStream] = None
        self.gpu_cache: Optional[GpuCache] = None
        self.augment: Optional[BatchAugment] = None
        self.gpu_misses = 0

    # ------------------------------------------------------------------ setup
    def rank_world(self):
        if self._rank is not None or self._world is not None:
            return int(self._rank or 0), int(self._world or 1)
        if self.trainer is not None:
            return self.trainer.global_rank, self.trainer.world_size
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1

    def setup(self, stage: Optional[str] = None) -> None:
        rank, world = self.rank_world()
        if stage in (None, "fit") and self.train_set is None:
            self.train_set = self._build(self.train_shards, "train_shards", train=True, rank=rank, world=world)
            self.augment = BatchAugment(**self.augment_args, seed=self.seed * 1000003 + rank)
        if self.val_shards is not None and stage in (None, "fit", "validate") and self.val_set is None:
            self.val_set = self._build(self.val_shards, "val_shards", train=False, rank=rank, world=world)
        if self.augment is None:
            self.augment = BatchAugment(**self.augment_args, seed=self.seed)
        if self.log_cache_stats and self.trainer is not None and not any(
                isinstance(c, CacheStatsLogger) for c in self.trainer.callbacks):
            self.trainer.callbacks.append(CacheStatsLogger())

    def _build(self, shards, option: str, train: bool, rank: int, world: int) -> ShardStream:
        urls = expand_shards(shards, option)
        resampled = train and self.samples_per_epoch is not None
        infos = None
        if not resampled:
            fetch = (lambda u: self.disk_cache.fetch(u)[0]) if self.disk_cache is not None else None
            infos = shard_infos(urls, self.shard_sizes if train else None, self.on_bad_sample, fetch)
            if infos is None:
                raise ValueError(f"{option}: cannot count the samples of remote shards {urls[:2]}...; pass shard_sizes=, "
                                 "disk_cache_dir= (shards are fetched and counted at setup) or samples_per_epoch=")
        ds = ShardStream(urls, None if infos is None else [i.samples for i in infos], self.decoder, rank=rank,
                         world_size=world, batch_size=self.batch_size if train else self.val_batch_size,
                         drop_last=self.drop_last if train else False, seed=self.seed, shuffle=self.shuffle and train,
                         shuffle_buffer=self.shuffle_buffer, num_workers=self.num_workers,
                         transform=self.transform if train else self.val_transform, on_bad_sample=self.on_bad_sample,
                         samples_per_epoch=self.samples_per_epoch if train else None, disk_cache=self.disk_cache,
                         stats=new_stats(self.num_workers))
        first = self._peek(ds)
        if train and (self.ram_cache == "decoded" or self.gpu_cache_on):
            if len(first) != 2 or not isinstance(first[0], torch.Tensor) or first[0].dtype != torch.uint8 \
                    or first[0].ndim != 3 or not isinstance(first[1], int):
                raise ValueError(f"ram_cache='decoded' and gpu_cache need keys=(image, int label), e.g. ('png;jpg','cls'); "
                                 f"keys={self.keys} give {[type(v).__name__ for v in first]}")
            shape = tuple(first[0].shape)
            if self.ram_cache == "decoded":
                ds.arena = DecodedArena(ds.num_local, self.ram_cache_bytes, shape)
            if self.gpu_cache_on:
                self.gpu_cache = GpuCache(ds.num_local, self.gpu_cache_bytes, shape)
        elif train and self.ram_cache == "encoded":
            budget = self.ram_cache_bytes
            if infos is not None and all(i.nbytes for i in infos):
                need = sum(infos[s].nbytes * (b - a) / max(infos[s].samples, 1) for s, a, b, _ in ds.segments)
                budget = min(budget, int(need * 1.05) + 64 * ds.num_local + (1 << 16))
            ds.arena = EncodedArena(ds.num_local, budget, self.num_workers)
        return ds

    def _peek(self, ds: ShardStream) -> tuple:
        """Decode one sample at setup so wrong keys or an unreadable first shard fail early."""
        s, a = (ds.segments[0][0], ds.segments[0][1]) if ds.segments else (0, 0)
        url = ds.urls[s]
        stream, seekable = ds._open(url, -1)
        with stream:
            for _, key, raw in iter_tar(stream, url, seekable, a, a + 1):
                try:
                    return self.decoder(raw, url, key)
                except Exception:
                    if self.on_bad_sample == "raise":
                        raise
                    return ()
        return ()

    # ------------------------------------------------------------------ loaders
    def _loader(self, ds: ShardStream, **kw) -> WebLoader:
        kw.update(batch_size=None, num_workers=self.num_workers, pin_memory=self.pin_memory)
        if self.num_workers > 0:
            start = resolve_worker_start(self.worker_start)
            if start == "forkserver":
                start_forkserver()
            kw.update(persistent_workers=self.persistent_workers, multiprocessing_context=start)
        return WebLoader(ds, **kw)

    def _train_position(self) -> Optional[Tuple[int, int]]:
        """The epoch and batch index the trainer's fit loop runs next (after a restore: where it resumes)."""
        t = self.trainer
        if t is None or not t.training:
            return None
        return t.current_epoch, t.fit_loop.epoch_loop.batch_progress.current.ready

    def train_dataloader(self) -> WebLoader:
        if self.train_set is None:
            self.setup("fit")
        return self._loader(self.train_set, gpu_cache=self.gpu_cache, position_fn=self._train_position,
                            mid_epoch_resume=self.mid_epoch_resume)

    def val_dataloader(self):
        if self.val_shards is None:
            return []
        if self.val_set is None:
            self.setup("validate")
        return self._loader(self.val_set)

    # ------------------------------------------------------------------ device side
    def finalize_batch(self, batch: Any, train: bool = True) -> Any:
        """Internal batch dict (already on its device) -> ``(images, labels, ...)`` with augmentation applied."""
        if not (isinstance(batch, dict) and "data" in batch or isinstance(batch, dict) and "served" in batch):
            return batch
        if batch.get("served") == "gpu":
            data = self.gpu_cache.get(batch["local"])
        else:
            data = batch["data"]
            gc = self.gpu_cache
            if train and gc is not None and gc.enabled:
                gc.put(batch["local"], data[0], data[1])
                self.gpu_misses += int(batch["local"].numel())
        if self.augment is not None and isinstance(data[0], torch.Tensor) and data[0].dtype == torch.uint8 \
                and data[0].ndim == 4:
            data = (self.augment(data[0], train=train, step=batch.get("pos")), *data[1:])
        return tuple(data)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        train = self.trainer is None or self.trainer.training
        return self.finalize_batch(batch, train=train)

    # ------------------------------------------------------------------ telemetry
    def cache_stats(self) -> Dict[str, int]:
        """Counters of this rank since setup: RAM/disk/GPU hits and misses, bad samples skipped, bytes held."""
        out = {name: 0 for name in STATS}
        for ds in (self.train_set, self.val_set):
            if ds is not None:
                for name, v in zip(STATS, ds.stats.sum(0).tolist()):
                    out[name] += int(v)
        arena = self.train_set.arena if self.train_set is not None else None
        out["ram_bytes"] = arena.held_bytes() if arena is not None else 0
        out["gpu_hits"] = self.gpu_cache.hits if self.gpu_cache is not None else 0
        out["gpu_misses"] = self.gpu_misses
        out["gpu_bytes"] = self.gpu_cache.held_bytes() if self.gpu_cache is not None else 0
        out["disk_bytes"] = self.disk_cache.held_bytes() if self.disk_cache is not None else 0
        return out
