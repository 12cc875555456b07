"""Baseline DDP strategies for comparison with ``topk_ddp``: PowerSGD and fp16/bf16 compression.

Lightning's ``DDPStrategy`` registers ``ddp_comm_hook`` only on CUDA (``_register_ddp_hooks``); these
subclasses register their hook on every device, so the baselines also run on CPU/gloo.
"""
from __future__ import annotations

from typing import Any, Optional

import pytorch_lightning as pl
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from typing_extensions import override

COMPRESS_DTYPES = ("fp16", "bf16")


class PowerSGDDDPStrategy(pl.strategies.DDPStrategy):
    """DDP with torch's PowerSGD comm hook (rank-``matrix_approximation_rank`` low-rank compression with error
    feedback), on CPU as well as CUDA. Dense all-reduce for the first ``start_powerSGD_iter`` steps
    (torch requires >= 2 when error feedback is on, because DDP rebuilds its buckets after step 1).
    Other keywords go to ``DDPStrategy``."""

    strategy_name = "ddp_powersgd"

    def __init__(self, matrix_approximation_rank: int = 1, start_powerSGD_iter: int = 10,
                 min_compression_rate: float = 2.0, use_error_feedback: bool = True, warm_start: bool = True,
                 orthogonalization_epsilon: float = 0.0, batch_tensors_with_same_shape: bool = False,
                 **kwargs: Any) -> None:
        if int(matrix_approximation_rank) < 1:
            raise ValueError(f"ddp_powersgd: matrix_approximation_rank must be >= 1, got {matrix_approximation_rank!r}")
        if use_error_feedback and int(start_powerSGD_iter) < 2:
            raise ValueError("ddp_powersgd: start_powerSGD_iter must be >= 2 with use_error_feedback=True, "
                             f"got {start_powerSGD_iter!r}")
        self.powersgd_options = dict(
            matrix_approximation_rank=int(matrix_approximation_rank), start_powerSGD_iter=int(start_powerSGD_iter),
            min_compression_rate=float(min_compression_rate), use_error_feedback=bool(use_error_feedback),
            warm_start=bool(warm_start), orthogonalization_epsilon=float(orthogonalization_epsilon),
            batch_tensors_with_same_shape=bool(batch_tensors_with_same_shape),
        )
        self.powersgd_state: Optional[powerSGD_hook.PowerSGDState] = None
        super().__init__(**kwargs)

    @override
    def _register_ddp_hooks(self) -> None:
        self.powersgd_state = powerSGD_hook.PowerSGDState(process_group=None, **self.powersgd_options)
        self.model.register_comm_hook(self.powersgd_state, powerSGD_hook.powerSGD_hook)


class CompressedDDPStrategy(pl.strategies.DDPStrategy):
    """DDP whose gradients are all-reduced in fp16 or bf16 (torch's ``fp16_compress_hook`` /
    ``bf16_compress_hook``: half the bytes of fp32, no error feedback), on CPU as well as CUDA."""

    strategy_name = "ddp_fp16"

    def __init__(self, dtype: str = "fp16", **kwargs: Any) -> None:
        if dtype not in COMPRESS_DTYPES:
            raise ValueError(f"ddp_fp16: dtype must be one of {COMPRESS_DTYPES}, got {dtype!r}")
        self.compress_dtype = dtype
        super().__init__(**kwargs)

    @override
    def _register_ddp_hooks(self) -> None:
        hook = default_hooks.fp16_compress_hook if self.compress_dtype == "fp16" else default_hooks.bf16_compress_hook
        self.model.register_comm_hook(None, hook)
