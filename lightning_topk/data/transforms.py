"""Transforms: resolving user transforms to picklable callables, per-sample helpers, batched augmentation."""
from __future__ import annotations

import importlib
import pickle
from typing import Any, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from .split import mix_seed


def resolve_callable(spec: Any, option: str = "transform", need_pickle: bool = True):
    """A callable from a callable, an import path (``"pkg.mod:fn"`` or ``"pkg.mod.fn"``) or a Hydra
    ``{"_target_": ...}`` mapping. With ``need_pickle`` it must pickle (spawn/forkserver workers)."""
    if spec is None:
        return None
    if isinstance(spec, str):
        mod, _, name = spec.partition(":") if ":" in spec else spec.rpartition(".")
        try:
            fn = getattr(importlib.import_module(mod), name)
        except (ImportError, AttributeError, ValueError) as exn:
            raise ValueError(f"{option}={spec!r}: cannot import it ({exn})") from exn
    elif hasattr(spec, "keys") and "_target_" in spec:
        from hydra.utils import instantiate

        fn = instantiate(spec)
    elif callable(spec):
        fn = spec
    else:
        raise ValueError(f"{option} must be a callable, an import path or a mapping with _target_, got {spec!r}")
    if not callable(fn):
        raise ValueError(f"{option}={spec!r} resolved to a non-callable {fn!r}")
    if need_pickle:
        try:
            pickle.dumps(fn)
        except Exception as exn:
            raise ValueError(f"{option}={fn!r} cannot be pickled for DataLoader workers ({exn}); "
                             "use a module-level function/class or a Hydra _target_") from exn
    return fn


class ToFloat:
    """Per-sample transform: ``(uint8 image, label, ...)`` -> ``(float image in [0,1] normalised, label, ...)``."""

    def __init__(self, mean: Optional[Sequence[float]] = None, std: Optional[Sequence[float]] = None):
        self.mean = None if mean is None else torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = None if std is None else torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)

    def __call__(self, sample: tuple) -> tuple:
        x = sample[0].float().div_(255.0)
        if self.mean is not None:
            x = (x - self.mean) / self.std
        return (x, *sample[1:])


class BatchAugment:
    """Batched augmentation on the batch's device: random crop with zero padding, horizontal flip,
    then ``uint8 -> float / 255`` and normalisation with ``mean``/``std`` (per channel).

    Random numbers come from a generator seeded with ``seed`` (give each rank its own seed). With
    ``step=(epoch, batch index)`` it is re-seeded from ``(seed, epoch, batch index)`` first, so a batch's
    augmentation does not depend on the batches before it (a resumed run draws the same numbers).
    """

    def __init__(self, crop_padding: int = 0, flip: bool = False, mean: Optional[Sequence[float]] = None,
                 std: Optional[Sequence[float]] = None, seed: int = 0):
        if crop_padding < 0:
            raise ValueError(f"crop_padding must be >= 0, got {crop_padding}")
        if (mean is None) != (std is None):
            raise ValueError("give both mean and std, or neither")
        self.crop_padding, self.flip, self.seed = int(crop_padding), bool(flip), int(seed)
        self.mean = None if mean is None else torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
        self.std = None if std is None else torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
        self._gen = None

    def _generator(self, device: torch.device) -> torch.Generator:
        if self._gen is None or self._gen.device != device:
            self._gen = torch.Generator(device=device).manual_seed(self.seed)
        return self._gen

    def __call__(self, images: torch.Tensor, train: bool = True, step: Optional[Tuple[int, int]] = None) -> torch.Tensor:
        if images.dtype != torch.uint8:
            return images  # already converted by a per-sample transform
        x = images
        if train and (self.crop_padding or self.flip):
            g = self._generator(x.device)
            if step is not None:
                g.manual_seed(mix_seed(self.seed, 5, *step) & 0x7FFFFFFFFFFFFFFF)
            n, _, h, w = x.shape
            if self.crop_padding:
                p = self.crop_padding
                padded = F.pad(x, (p, p, p, p))
                oy = torch.randint(0, 2 * p + 1, (n,), device=x.device, generator=g)
                ox = torch.randint(0, 2 * p + 1, (n,), device=x.device, generator=g)
                rows = (oy[:, None] + torch.arange(h, device=x.device))[:, :, None]  # [n,h,1]
                cols = (ox[:, None] + torch.arange(w, device=x.device))[:, None, :]  # [n,1,w]
                b = torch.arange(n, device=x.device)[:, None, None]
                x = padded.permute(0, 2, 3, 1)[b, rows, cols].permute(0, 3, 1, 2)
            if self.flip:
                m = torch.rand(n, device=x.device, generator=g) < 0.5
                x = torch.where(m[:, None, None, None], x.flip(-1), x)
        x = x.float().div_(255.0)
        if self.mean is not None:
            x = (x - self.mean.to(x.device)) / self.std.to(x.device)
        return x.contiguous()
