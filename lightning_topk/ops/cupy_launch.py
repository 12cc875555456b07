"""Loading and launching the CUDA kernels of :mod:`lightning_topk.ops.cuda` through CuPy: the kernel sources
(``lightning_topk/kernels``, ``#include`` lines inlined), whether CuPy can run them here, compilation
(``RawModule``, cached), launches on torch's current stream with tensors shared through DLPack, and the argument
checks the public functions share. Importing this module does not import CuPy."""
from __future__ import annotations

import functools
import importlib.resources
import os
import re
import warnings
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple

import torch
from torch import Tensor

# kernel file (without .cu) -> the extern "C" kernels it defines
KERNEL_FILES: Dict[str, Tuple[str, ...]] = {
    "threshold_count": ("multi_threshold_count_f32", "multi_threshold_count_f16", "multi_threshold_count_bf16"),
    "compact": ("compact_count_f32", "compact_write_f32", "compact_count_f16", "compact_write_f16",
                "compact_count_bf16", "compact_write_bf16"),
    "scatter_add": ("scatter_add_f32", "scatter_add_f64", "scatter_add_f16", "scatter_add_bf16"),
    "fused_lars": ("lars_norms", "lars_trust", "lars_update"),
}
# No FMA contraction: every multiply and add rounds on its own, as in the torch references.
NVRTC_OPTIONS: Tuple[str, ...] = ("--std=c++14", "--fmad=false")

_BLOCK = 256
_INCLUDE = re.compile(r'^#include "([A-Za-z0-9_]+\.cuh)"\s*$', re.M)


# ----------------------------------------------------------------------------------------- loading
def _kernel_dir_text(name: str) -> str:
    try:
        return importlib.resources.files("lightning_topk.kernels").joinpath(name).read_text()
    except ModuleNotFoundError:  # source checkout whose install does not map lightning_topk.kernels
        return (Path(__file__).resolve().parents[2] / "kernels" / name).read_text()


@functools.lru_cache(maxsize=None)
def kernel_source(name: str) -> str:
    """Full CUDA source of ``kernels/<name>.cu`` with its ``#include "*.cuh"`` lines inlined.

    This exact string is what ``RawModule(code=...)`` compiles (NVRTC has no include path to them).
    """
    if name not in KERNEL_FILES:
        raise ValueError(f"kernel_source: unknown kernel file {name!r}; allowed: {', '.join(KERNEL_FILES)}")
    return _INCLUDE.sub(lambda m: _kernel_dir_text(m.group(1)), _kernel_dir_text(f"{name}.cu"))


# CuPy ships one wheel per CUDA major version; the package extras pull the matching one.
_INSTALL_HINT = ("pip install 'lightning-topk[cuda12]' for a CUDA 12 build of torch, or 'lightning-topk[cuda13]' "
                "for CUDA 13 (torch.version.cuda tells which)")


def _disabled() -> bool:
    return os.environ.get("LIGHTNING_TOPK_DISABLE_CUPY", "") not in ("", "0")


@functools.lru_cache(maxsize=None)
def cupy_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device (and LIGHTNING_TOPK_DISABLE_CUPY is unset)."""
    return not _disabled() and _cupy_problem() is None


def _cupy_problem() -> Optional[str]:
    """Why CuPy cannot run the kernels here, or None."""
    try:
        import cupy
    except ImportError as e:
        return f"CuPy is not installed ({e}); {_INSTALL_HINT}"
    try:
        if cupy.cuda.runtime.getDeviceCount() > 0:
            return None
        return "CuPy sees no CUDA device"
    except Exception as e:  # a CuPy built for another CUDA major version, or no driver
        return f"CuPy cannot use the GPU ({type(e).__name__}: {e}); check that its wheel matches your CUDA: {_INSTALL_HINT}"


@functools.lru_cache(maxsize=None)
def _warn_torch_fallback_on_cuda() -> None:
    warnings.warn(f"lightning_topk.ops.cuda: CUDA tensors run the torch references, not the kernels: "
                  f"{_cupy_problem()}", RuntimeWarning, stacklevel=3)


@functools.lru_cache(maxsize=None)
def _module(name: str):
    problem = _cupy_problem()
    if problem is not None:
        raise ImportError(f"lightning_topk.ops.cuda: cannot compile kernels/{name}.cu: {problem}")
    import cupy

    return cupy.RawModule(code=kernel_source(name), options=NVRTC_OPTIONS)


def _use_cupy(*tensors: Tensor) -> bool:
    if not all(t.is_cuda for t in tensors):
        return False
    if cupy_available():
        return True
    if not _disabled():
        _warn_torch_fallback_on_cuda()
    return False


def _launch(device: torch.device, module: str, kernel: str, grid: int, args: Sequence,
            shared_mem: int = 0) -> None:
    """Launch ``kernel`` on torch's current stream of ``device``; tensors in ``args`` go through DLPack."""
    import cupy

    with cupy.cuda.Device(device.index):
        stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream)
        with stream:  # from_dlpack on the same stream: no extra synchronisation
            cargs = [cupy.from_dlpack(_dlpack_view(a)) if isinstance(a, Tensor) else a for a in args]
            fn = _module(module).get_function(kernel)
            fn((int(grid),), (_BLOCK,), tuple(cargs), shared_mem=int(shared_mem))


def _dlpack_view(t: Tensor) -> Tensor:
    # CuPy has no bfloat16 dtype: hand 16-bit floats over as int16 (same bytes; kernels take unsigned short*).
    t = t.detach()
    return t.view(torch.int16) if t.dtype in (torch.bfloat16, torch.float16) else t


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _grid_for(n: int, device: torch.device) -> int:
    return max(1, min((n + _BLOCK - 1) // _BLOCK, _sm_count(device.index) * 8))


def _compute_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _check_float(name: str, what: str, t: Tensor) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name}: {what} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name}: {what} must be a floating-point tensor, got dtype {t.dtype}")


def _scalar(name: str, what: str, v) -> float:
    if isinstance(v, Tensor):
        if v.numel() != 1:
            raise ValueError(f"{name}: {what} must be a number or a 1-element tensor, got shape {tuple(v.shape)}")
        return float(v)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name}: {what} must be a number, got {type(v).__name__}")
    return float(v)
