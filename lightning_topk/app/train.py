"""Compose -> instantiate -> fit -> test -> summary, for ``lightning-topk-train`` and the Hydra compose API.

``run(cfg)`` takes a composed config (see ``conf/config.yaml``); everything is built with
``hydra.utils.instantiate``.
"""
from __future__ import annotations

import contextlib
import glob
import hashlib
import logging
import os
import warnings
from typing import Any, Dict, Iterator, List, Optional

import pytorch_lightning as pl
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from lightning_topk.app import summary as summary_mod
from lightning_topk.lightning.registry import register_strategies

register_strategies()  # `strategy=topk_ddp` by name in the configs

log = logging.getLogger(__name__)

RESUME_CHOICES = ("auto", "never")


class MultirunNotSupported(RuntimeError):
    """Hydra multirun with a strategy that re-runs the command for each process (popen)."""


def _hydra_mode() -> Optional[str]:
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    return str(HydraConfig.get().mode).rsplit(".", 1)[-1]  # "RUN" | "MULTIRUN"


def _choice(group: str) -> Optional[str]:
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return HydraConfig.get().runtime.choices.get(group)
    return None


def _named(node: Any) -> List[Any]:
    """Instantiate every non-null entry of a ``{name: {_target_: ...}}`` group (callbacks, logger)."""
    if node is None:
        return []
    return [instantiate(v) for v in node.values() if v is not None]


def _amp_device(accelerator: str) -> str:
    if accelerator == "cpu":
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def _set_threads(threads: Any, trainer: pl.Trainer) -> None:
    if threads is None or trainer.strategy.root_device.type != "cpu":
        return
    if threads == "auto":
        threads = max(1, (os.cpu_count() or 1) // max(1, trainer.num_devices))
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"run.threads must be 'auto', null or an int >= 1, got {threads!r}")
    torch.set_num_threads(threads)


def starts_children_by_rerunning(trainer: pl.Trainer) -> bool:
    """True when Lightning will start the other local processes by re-running the command (popen launcher):
    more than one device and no cluster (SLURM, torchrun) that starts the processes itself."""
    from pytorch_lightning.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    launcher = getattr(trainer.strategy, "launcher", None)
    return (isinstance(launcher, _SubprocessScriptLauncher) and trainer.num_devices > 1
            and not trainer.strategy.cluster_environment.creates_processes_externally)


def _check_multirun(trainer: pl.Trainer) -> None:
    if _hydra_mode() == "MULTIRUN" and starts_children_by_rerunning(trainer):
        raise MultirunNotSupported(
            "Hydra multirun (-m) cannot be combined with a strategy that starts its processes by re-running the "
            f"command (start_method=popen, strategy={_choice('strategy') or type(trainer.strategy).__name__}, "
            f"{trainer.num_devices} devices): each child would start the whole sweep again. Use "
            "strategy=topk_ddp_spawn (or strategy.start_method=spawn), a single device (trainer.devices=1), "
            "or hydra/launcher=slurm, where SLURM starts the processes."
        )


def _resume_path(resume: Any, trainer: pl.Trainer) -> Optional[str]:
    """``auto``: newest of ``<default_root_dir>/hpc_ckpt_*.ckpt`` and the checkpoint callback's ``last*.ckpt``."""
    if resume is None or resume == "never":
        return None
    if resume != "auto":
        if not os.path.exists(str(resume)):  # a file, or a distributed checkpoint's folder (topk_fsdp)
            raise FileNotFoundError(f"run.resume: checkpoint {resume!r} does not exist (or use 'auto' / 'never')")
        return str(resume)
    candidates = glob.glob(os.path.join(str(trainer.default_root_dir), "hpc_ckpt_*.ckpt"))
    ckpt = trainer.checkpoint_callback
    if ckpt is not None and getattr(ckpt, "dirpath", None):
        candidates += glob.glob(os.path.join(str(ckpt.dirpath), "last*.ckpt"))
    if not candidates:
        return None
    path = max(candidates, key=os.path.getmtime)
    log.info("run.resume=auto: resuming from %s", path)
    return path


def config_digest(cfg: DictConfig) -> str:
    """SHA-1 of the resolved job config (identical in every process of one run)."""
    return hashlib.sha1(OmegaConf.to_yaml(cfg, resolve=True).encode()).hexdigest()


def build(cfg: DictConfig) -> Dict[str, Any]:
    """Instantiate data, model, strategy, precision plugin, callbacks, loggers and the trainer from ``cfg``."""
    if cfg.run.resume not in RESUME_CHOICES and not isinstance(cfg.run.resume, str) and cfg.run.resume is not None:
        raise ValueError(f"run.resume must be one of {RESUME_CHOICES}, a checkpoint path or null, got {cfg.run.resume!r}")
    datamodule = instantiate(cfg.data)
    optimizer = instantiate(cfg.optimizer) if cfg.get("optimizer") else None
    scheduler = instantiate(cfg.scheduler) if cfg.get("scheduler") else None
    model = instantiate(cfg.model, optimizer=optimizer, scheduler=scheduler)
    strategy = instantiate(cfg.strategy)
    plugins = []
    if cfg.get("precision"):
        prec = cfg.precision
        if prec.get("device", "missing") is None:
            prec = OmegaConf.merge(prec, {"device": _amp_device(str(cfg.trainer.accelerator))})
        plugins.append(instantiate(prec))
    monitor = summary_mod.ThroughputMonitor()
    callbacks = _named(cfg.get("callbacks")) + [monitor]
    loggers = _named(cfg.get("logger"))
    for lg in loggers:
        _ = lg.version  # pin the version now, so spawned fit/test processes log into the same directory
    if not loggers:
        callbacks = [c for c in callbacks if not isinstance(c, pl.callbacks.LearningRateMonitor)]
    has_bar = any(isinstance(c, pl.callbacks.ProgressBar) for c in callbacks)
    trainer = instantiate(cfg.trainer, strategy=strategy, plugins=plugins, callbacks=callbacks,
                          logger=loggers if loggers else False,
                          enable_checkpointing=any(isinstance(c, pl.callbacks.ModelCheckpoint) for c in callbacks),
                          enable_progress_bar=has_bar)
    return dict(datamodule=datamodule, model=model, trainer=trainer, monitor=monitor)


def run(cfg: DictConfig) -> Dict[str, Any]:
    """Train and test as configured; print and save the summary on rank 0; return the summary dict."""
    pl.seed_everything(int(cfg.seed), workers=True)
    # WebDataModule's IterableDatasets report their exact per-rank length (equalised split), so Lightning's
    # generic warning about __len__ with several workers does not apply.
    warnings.filterwarnings("ignore", message=".*Your `IterableDataset` has `__len__` defined.*")
    objs = build(cfg)
    trainer: pl.Trainer = objs["trainer"]
    model, dm = objs["model"], objs["datamodule"]
    _check_multirun(trainer)
    # Same line in every process's Hydra log: popen children must see the same composed config.
    log.info("rank %d/%d config sha1 %s", trainer.global_rank, trainer.world_size, config_digest(cfg))
    _set_threads(cfg.run.get("threads", "auto"), trainer)
    trainer.fit(model, datamodule=dm, ckpt_path=_resume_path(cfg.run.resume, trainer))
    stats = summary_mod.fit_stats(trainer)
    metrics: Dict[str, float] = {}
    if cfg.run.test:
        metrics = _test(trainer, model, dm)
    strategy_name = _choice("strategy") or getattr(trainer.strategy, "strategy_name", type(trainer.strategy).__name__)
    result = summary_mod.collect(trainer, metrics, stats, str(cfg.run.output_dir), strategy_name)
    if trainer.is_global_zero:
        summary_mod.save(result, os.path.join(str(cfg.run.output_dir), "summary.json"))
        if cfg.run.get("print_summary", True):
            summary_mod.render(result)
    return result


def _test(trainer: pl.Trainer, model: pl.LightningModule, dm: pl.LightningDataModule) -> Dict[str, float]:
    """Test (or validate) the model as fit left it. Inside SLURM, Lightning's ``trainer.test(model)`` without a
    ``ckpt_path`` restores the newest ``hpc_ckpt_<N>.ckpt`` of ``default_root_dir`` instead (after a requeue:
    an older model), so the run tells Lightning that no checkpoint is to be loaded."""
    from pytorch_lightning.utilities.model_helpers import is_overridden

    if is_overridden("test_dataloader", dm, pl.LightningDataModule):
        run = trainer.test
    elif is_overridden("val_dataloader", dm, pl.LightningDataModule) and getattr(dm, "val_shards", 1) is not None:
        run = trainer.validate  # no test split: report the val metrics
    else:
        return {}
    step = trainer.global_step
    with _no_checkpoint_restore(trainer):
        out = run(model, datamodule=dm, verbose=False)
    log.info("run.test: %s ran on the final weights (global step %d)", run.__name__, step)
    return {k: float(v) for k, v in (out[0] if out else {}).items()}


@contextlib.contextmanager
def _no_checkpoint_restore(trainer: pl.Trainer) -> Iterator[None]:
    """``trainer.test/validate(model)`` loads no checkpoint inside this block, not even SLURM's hpc one.

    Lightning picks the checkpoint in ``_CheckpointConnector._select_ckpt_path``: a path the user set through
    ``trainer.ckpt_path`` (``_user_managed``) is taken as is, before the SLURM rule that turns ``None`` into
    ``"hpc"``. Lightning's public setter cannot mark ``None`` as user-set, so the two attributes are set here.
    """
    conn = trainer._checkpoint_connector
    if not hasattr(conn, "_user_managed"):
        raise RuntimeError("run.test: this Lightning version has no _CheckpointConnector._user_managed; the final "
                           "test could restore a SLURM hpc checkpoint instead of the trained weights")
    conn._ckpt_path, conn._user_managed = None, True
    try:
        yield
    finally:
        conn._user_managed = False
    if trainer.ckpt_path is not None:
        raise RuntimeError(f"run.test: Lightning restored {trainer.ckpt_path} for the final test instead of using "
                           "the trained weights")
