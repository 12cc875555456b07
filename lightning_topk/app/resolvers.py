"""The ``lt.*`` OmegaConf resolvers used in ``conf/`` (``${lt.devices:}``, ``${lt.run_dir:}``, ...)."""
from __future__ import annotations

import os
from datetime import datetime
from typing import Any, Optional

import torch

DEFAULT_CACHE = "~/.cache/lightning_topk"


def cache_dir(path: Optional[str] = None) -> str:
    """Shard cache directory: ``path`` if given, else ``$LIGHTNING_TOPK_CACHE``, else ``~/.cache/lightning_topk``."""
    return os.path.abspath(os.path.expanduser(path or os.environ.get("LIGHTNING_TOPK_CACHE") or DEFAULT_CACHE))


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
