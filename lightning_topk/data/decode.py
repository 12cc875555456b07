"""Sample decoding: raw tar members (extension -> bytes) to tensors, with errors that name shard and key."""
from __future__ import annotations

import io
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np
import torch
from PIL import Image
from webdataset.autodecode import basichandlers

IMAGE_EXTS = ("png", "jpg", "jpeg", "ppm", "pgm", "pbm", "bmp", "webp", "tif", "tiff", "gif")
IMAGE_MODES = ("L", "RGB")


class BadSampleError(RuntimeError):
    """A sample could not be read or decoded; the message names the shard and the sample key."""

    def __init__(self, message: str, shard: str = "?", key: str = "?"):
        super().__init__(f"{message} [shard={shard!r}, key={key!r}]")
        self.shard, self.key = shard, key

    def __reduce__(self):  # keep the message intact when re-raised across DataLoader workers
        return (_rebuild_bad_sample, (self.args[0], self.shard, self.key))


def _rebuild_bad_sample(msg, shard, key):
    err = BadSampleError("", shard, key)
    err.args = (msg,)
    return err


def parse_keys(keys: Sequence[str]) -> Tuple[Tuple[str, ...], ...]:
    """("png;jpg", "cls") -> (("png", "jpg"), ("cls",)); each entry takes the first extension present."""
    if isinstance(keys, str) or not keys:
        raise ValueError(f"keys must be a non-empty list like ('png;jpg', 'cls'), got {keys!r}")
    return tuple(tuple(e.strip().lower() for e in k.split(";") if e.strip()) for k in keys)


def image_size_hw(image_size) -> Optional[Tuple[int, int]]:
    if image_size is None:
        return None
    if isinstance(image_size, int):
        return (image_size, image_size)
    h, w = image_size
    return (int(h), int(w))


def decode_image(data: bytes, mode: str, size: Optional[Tuple[int, int]]) -> torch.Tensor:
    """Encoded image bytes -> uint8 tensor [C, H, W] in ``mode`` ('L' or 'RGB'), resized to ``size`` if given."""
    with Image.open(io.BytesIO(data)) as img:
        img = img.convert(mode)
        if size is not None and img.size != (size[1], size[0]):
            img = img.resize((size[1], size[0]), Image.BILINEAR)
        arr = np.array(img, dtype=np.uint8)
    if arr.ndim == 2:
        arr = arr[None]
    else:
        arr = arr.transpose(2, 0, 1)
    return torch.from_numpy(np.ascontiguousarray(arr))


def _decode_npy_image(value: np.ndarray, size) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(value))
    if t.ndim == 2:
        t = t[None]
    elif t.ndim == 3 and t.shape[-1] in (1, 3, 4) and t.shape[0] not in (1, 3, 4):
        t = t.permute(2, 0, 1).contiguous()
    if size is not None and tuple(t.shape[-2:]) != size:
        raise ValueError(f"array image has shape {tuple(t.shape)}, expected spatial size {size}")
    return t


class SampleDecoder:
    """Picklable decoder: raw sample dict -> tuple with one value per key spec.

    Images (png/jpg/...) become uint8 ``[C, H, W]`` tensors; ``cls`` becomes an int; uint8 ``npy``
    arrays of rank 2/3 are treated as images; other extensions use webdataset's basic handlers.
    """

    def __init__(self, keys, image_mode: str = "RGB", image_size=None):
        if image_mode not in IMAGE_MODES:
            raise ValueError(f"image_mode must be one of {IMAGE_MODES}, got {image_mode!r}")
        self.keys = parse_keys(keys)
        self.image_mode = image_mode
        self.size = image_size_hw(image_size)

    def pick(self, raw: Dict[str, Any], shard: str, key: str) -> Tuple[Tuple[str, bytes], ...]:
        out = []
        for alts in self.keys:
            for ext in alts:
                if ext in raw:
                    out.append((ext, raw[ext]))
                    break
            else:
                present = sorted(k for k in raw if not k.startswith("__"))
                raise BadSampleError(f"sample has no member for key {';'.join(alts)!r} (members: {present})", shard, key)
        return tuple(out)

    def __call__(self, raw: Dict[str, Any], shard: str = "?", key: str = "?") -> tuple:
        values = []
        for ext, data in self.pick(raw, shard, key):
            try:
                if ext in IMAGE_EXTS:
                    values.append(decode_image(data, self.image_mode, self.size))
                    continue
                value = basichandlers(ext, data)
                if value is None:
                    value = data
                if ext == "npy" and isinstance(value, np.ndarray) and value.dtype == np.uint8 and value.ndim in (2, 3):
                    value = _decode_npy_image(value, self.size)
                values.append(value)
            except Exception as exn:  # PIL/numpy/json raise many types; report them uniformly
                raise BadSampleError(f"cannot decode member .{ext}: {type(exn).__name__}: {exn}", shard, key) from exn
        return tuple(values)


def collate(samples: Sequence[tuple]) -> tuple:
    """Stack tensors and ints field by field; other values stay lists."""
    fields = []
    for col in zip(*samples):
        first = col[0]
        if isinstance(first, torch.Tensor):
            fields.append(torch.stack(col))
        elif isinstance(first, (int, np.integer)) and not isinstance(first, bool):
            fields.append(torch.tensor(col, dtype=torch.int64))
        elif isinstance(first, (float, np.floating)):
            fields.append(torch.tensor(col, dtype=torch.float32))
        else:
            fields.append(list(col))
    return tuple(fields)
