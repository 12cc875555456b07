"""End-of-run summary: accuracy, throughput, wire bytes vs a dense all-reduce, where the logs and checkpoints are."""
from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, Mapping, Optional

import pytorch_lightning as pl
import torch
from pytorch_lightning.trainer.states import TrainerFn

from lightning_topk.files import atomic_write


class ThroughputMonitor(pl.Callback):
    """Counts training samples (all ranks) and the wall time spent in training epochs, validation excluded."""

    def __init__(self) -> None:
        self.samples = 0
        self.steps = 0
        self.train_seconds = 0.0
        self._t0: Optional[float] = None
        self._val_t0: Optional[float] = None

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.samples += _batch_size(batch) * trainer.world_size
        self.steps += 1

    def on_validation_start(self, trainer, pl_module) -> None:
        if self._t0 is not None:
            self.train_seconds += time.perf_counter() - self._t0
            self._t0 = None

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
            self._t0 = time.perf_counter()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self._t0 is not None:
            self.train_seconds += time.perf_counter() - self._t0
            self._t0 = None

    def on_train_end(self, trainer, pl_module) -> None:
        # Stored as callback metrics because spawn launchers send exactly those back to the main process.
        vals = {"samples": self.samples, "batches": self.steps, "train_seconds": self.train_seconds,
                "global_step": trainer.global_step, "epochs": trainer.current_epoch}
        totals = getattr(trainer.strategy, "topk_totals", None)
        if totals is not None:
            vals.update(bytes_sent=totals.bytes_sent, bytes_dense=totals.bytes_dense, numel=totals.numel,
                        numel_sent=totals.numel_sent, bytes_inter=totals.bytes_inter, bytes_intra=totals.bytes_intra,
                        select_seconds=totals.select_time_s, comm_seconds=totals.comm_time_s,
                        bytes_wire=totals.bytes_wire, bytes_dense_wire=totals.bytes_dense_wire)
            vals.update({k[len("topk/"):]: v for k, v in totals.as_metrics().items() if k.startswith("topk/buckets_")})
            vals.update(_auto_would(trainer.strategy))
        cfg = getattr(trainer.strategy, "topk_config", None)
        if cfg is not None:
            vals.update(local_steps=cfg.local_steps, outer_density=cfg.outer_density,
                        outer_value_bits=cfg.outer_value_bits, outer_streaming=float(cfg.outer_streaming),
                        dense_steps=cfg.dense_steps)
            exchange = getattr(getattr(trainer.strategy, "topk_state", None), "exchange", None)
            vals["outer_scatter"] = float(getattr(getattr(exchange, "outer", None), "exchange", "") == "scatter")
        choice = getattr(trainer.strategy, "topk_mode", None)
        if choice is not None and choice.inputs:  # mode="auto" decided from the link: its inputs
            vals.update(mode_auto=1.0, mode_link_gbps=choice.inputs["link_gbps"],
                        mode_compute_ms=choice.inputs["compute_ms"])
        for k, v in vals.items():
            trainer.callback_metrics[f"{PREFIX}{k}"] = torch.tensor(float(v), dtype=torch.float64)


PREFIX = "run_summary/"


def _auto_would(strategy: Any) -> Dict[str, float]:
    """For a run that pins an exchange: what ``exchange="auto"`` under the constants model would send each
    bucket of the last step by (``auto_buckets_<exchange>``), and both plans' predicted milliseconds per step."""
    from lightning_topk.comm.exchanges import Layout
    from lightning_topk.comm.exchanges.auto import plan_for, predicted_for

    state, cfg = getattr(strategy, "topk_state", None), getattr(strategy, "topk_config", None)
    pinned = _pinned_exchange(strategy)
    if state is None or cfg is None or pinned is None or not state.bucket_sizes:
        return {}
    layout = Layout(strategy.num_nodes, strategy.num_processes)
    device = strategy.root_device.type
    plan = plan_for(cfg, layout, device, state.bucket_sizes)
    out: Dict[str, float] = {}
    for n in state.bucket_sizes:
        key = f"auto_buckets_{plan[n][0]}"
        out[key] = out.get(key, 0.0) + 1.0
    out["auto_predicted_ms"] = 1e3 * sum(plan[n][1] for n in state.bucket_sizes)
    out["pinned_predicted_ms"] = 1e3 * predicted_for(cfg, layout, device, state.bucket_sizes, pinned)
    out["link_gbps"] = cfg.auto_link_gbps
    out["sparse_penalty"] = cfg.sparse_penalty
    return out


def _pinned_exchange(strategy: Any) -> Optional[str]:
    """The exchange every bucket is pinned to (``None`` under ``exchange="auto"``, local SGD or without top-k)."""
    cfg = getattr(strategy, "topk_config", None)
    if cfg is None or getattr(strategy, "world_size", 1) < 2 or getattr(cfg, "local_steps", 0) > 0:
        return None
    ex = strategy._exchange() if hasattr(strategy, "_exchange") else cfg.exchange
    return None if ex == "auto" else ex


def fit_stats(trainer: pl.Trainer) -> Dict[str, float]:
    """Rank 0's throughput and byte counts of the last ``fit`` (read right after fit, before test)."""
    return {k[len(PREFIX):]: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(PREFIX)}


def _batch_size(batch: Any) -> int:
    """Samples in a batch: the first field (tensor rows, or list length) of a tuple/list/dict batch."""
    if isinstance(batch, dict):
        batch = next(iter(batch.values()))
    field = batch[0] if isinstance(batch, (tuple, list)) and batch else batch
    if isinstance(field, torch.Tensor):
        return int(field.shape[0]) if field.ndim else 1
    return len(field) if isinstance(field, (list, tuple)) else 1


def collect(trainer: pl.Trainer, test_metrics: Mapping[str, float], stats: Mapping[str, float],
            output_dir: str, strategy_name: str) -> Dict[str, Any]:
    """The summary as a plain dict (``stats`` from :func:`fit_stats`); :func:`save` writes it as JSON."""
    out: Dict[str, Any] = {"strategy": strategy_name, "world_size": trainer.world_size,
                           "num_nodes": trainer.num_nodes,
                           "global_step": int(stats.get("global_step", trainer.global_step)),
                           "epochs": int(stats.get("epochs", trainer.current_epoch)), "output_dir": os.path.abspath(output_dir)}
    out["metrics"] = {k: float(v) for k, v in test_metrics.items()}
    mode = exchange_mode(stats)
    if mode:
        out["mode"] = mode
    choice = getattr(trainer.strategy, "topk_mode", None)
    if choice is not None:  # what mode="auto" did and why (rank 0's, the same on every rank)
        out["mode_choice"] = choice.describe()
    if "samples" in stats:
        secs = stats["train_seconds"]
        out.update(samples=int(stats["samples"]), train_seconds=round(secs, 3),
                   samples_per_second=round(stats["samples"] / secs, 2) if secs > 0 else 0.0)
    if stats.get("bytes_dense"):
        # Compression on the wire (what leaves a rank for the algorithm used) against a dense ring
        # all-reduce of the same buckets in fp32 (bf16: half of it); payload figures under their own names.
        sent, dense = int(stats["bytes_sent"]), int(stats["bytes_dense"])
        wire, dense_wire = int(stats.get("bytes_wire", 0)), int(stats.get("bytes_dense_wire", 0))
        out["bytes"] = {"wire": wire, "dense_wire": dense_wire, "ratio": round(dense_wire / max(1, wire), 2),
                        "ratio_bf16": round(dense_wire / 2 / max(1, wire), 2),
                        "sent": sent, "dense": dense, "payload_ratio": round(dense / max(1, sent), 2),
                        "density": round(stats["numel_sent"] / max(1.0, stats["numel"]), 6),
                        "inter_node": int(stats["bytes_inter"]), "intra_node": int(stats["bytes_intra"])}
        scope = getattr(trainer.strategy, "topk_bytes_scope", None)  # topk_fsdp: what crosses nodes
        if scope:
            out["bytes"]["scope"] = scope
        out["exchange_seconds"] = {"select": round(stats.get("select_seconds", 0.0), 3),
                                   "comm": round(stats.get("comm_seconds", 0.0), 3)}
        steps = max(1, out["global_step"])
        used = {k[len("buckets_"):]: round(v / steps, 3) for k, v in stats.items() if k.startswith("buckets_") and v}
        out["exchange"] = {"configured": getattr(getattr(trainer.strategy, "topk_config", None), "exchange", None),
                           "buckets_per_step": used}
        would = {k[len("auto_buckets_"):]: int(v) for k, v in stats.items() if k.startswith("auto_buckets_")}
        if would:
            out["exchange"]["pinned"] = _pinned_exchange(trainer.strategy)
            out["exchange"]["auto_would"] = {"buckets": would, "predicted_ms": round(stats["auto_predicted_ms"], 3),
                                             "pinned_predicted_ms": round(stats["pinned_predicted_ms"], 3),
                                             "link_gbps": stats["link_gbps"],
                                             "sparse_penalty": stats["sparse_penalty"]}
    out["log_dirs"] = [lg.log_dir for lg in trainer.loggers if getattr(lg, "log_dir", None)]
    ckpt = trainer.checkpoint_callback
    path = None
    if ckpt is not None:
        last = os.path.join(str(ckpt.dirpath), "last.ckpt") if ckpt.dirpath else ""
        path = ckpt.last_model_path or (last if os.path.isfile(last) else "") or ckpt.best_model_path or None
    out["checkpoint"] = path
    return out


def exchange_mode(stats: Mapping[str, float]) -> Optional[str]:
    """How gradients travelled: sparse local SGD (with its settings) or the per-step exchange, and whether
    ``mode="auto"`` chose it from the link; None without top-k telemetry."""
    if "local_steps" not in stats:
        return None
    h = int(stats["local_steps"])
    chosen = (f" (chosen by mode='auto' from {stats['mode_link_gbps']:.3g} Gbit/s between nodes and "
              f"{stats['mode_compute_ms']:.1f} ms compute per step; set mode, local_steps or a preset to override)"
              if stats.get("mode_auto") else "")
    if h <= 0:
        return "per-step exchange" + chosen
    return (f"sparse local SGD: {h} local steps per outer round, outer density {stats['outer_density']:g}, "
            f"{int(stats['outer_value_bits'])}-bit values" + (", streaming" if stats.get("outer_streaming") else "")
            + (", scale-free outer exchange" if stats.get("outer_scatter") else "")
            + (f", first {int(stats['dense_steps'])} steps synchronous" if stats.get("dense_steps") else "") + chosen)


def save(summary: Mapping[str, Any], path: str) -> None:
    """Write the summary as JSON atomically."""
    with atomic_write(path, "w") as f:
        json.dump(summary, f, indent=2)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000.0
    return str(n)


def _exchange_text(ex: Mapping[str, Any], summary: Mapping[str, Any]) -> str:
    used = ", ".join(f"{name} {n:g}" for name, n in sorted(ex["buckets_per_step"].items(), key=lambda kv: -kv[1]))
    text = f"exchange={ex['configured']!r}; buckets per step: {used or 'none'}"
    would = ex.get("auto_would")
    if would:
        plan = ", ".join(f"{n} bucket{'s' if n > 1 else ''} {name}"
                         for name, n in sorted(would["buckets"].items(), key=lambda kv: -kv[1]))
        nodes, world = summary["num_nodes"], summary["world_size"]
        text += (f". Pinned: exchange='auto' would send {plan} here (constants model, "
                 f"{nodes} node{'s' if nodes > 1 else ''} x {world // max(1, nodes)} processes"
                 + (f", {would['link_gbps']:g} Gbit/s between nodes" if nodes > 1 else "")
                 + f": {would['predicted_ms']:.2f} ms per step predicted against {would['pinned_predicted_ms']:.2f} ms "
                 f"for {ex['pinned']}; sparse exchanges scored x{would['sparse_penalty']:g} for their slower convergence)")
    return text


def render(summary: Mapping[str, Any], console=None) -> None:
    """Print the summary as a Rich table."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title="lightning-topk run summary", show_header=False, title_justify="left")
    table.add_column(style="bold cyan")
    table.add_column(overflow="fold")
    table.add_row("strategy", f"{summary['strategy']} ({summary['world_size']} processes, "
                              f"{summary['num_nodes']} node{'s' if summary['num_nodes'] > 1 else ''})")
    if summary.get("mode"):
        table.add_row("mode", summary["mode"])
    if summary.get("mode_choice"):
        table.add_row("mode choice", summary["mode_choice"])
    for k, v in summary.get("metrics", {}).items():
        table.add_row(k, f"{v:.4f}")
    if "samples_per_second" in summary:
        table.add_row("throughput", f"{summary['samples_per_second']:.1f} samples/s "
                                    f"({summary['samples']} samples in {summary['train_seconds']:.1f} s, "
                                    f"{summary['global_step']} steps)")
    b = summary.get("bytes")
    if b:
        scope = f"; {b['scope']}" if b.get("scope") else ""
        if b["dense_wire"] == 0 and b["wire"] == 0:
            table.add_row("wire bytes / dense", f"0 B / 0 B per rank (one replica: nothing to exchange{scope})")
        else:
            table.add_row("wire bytes / dense", f"{_fmt_bytes(b['wire'])} / {_fmt_bytes(b['dense_wire'])} per rank "
                                                f"({b['ratio']:.1f}x less than a dense fp32 all-reduce, "
                                                f"{b['ratio_bf16']:.1f}x less than bf16; density {b['density']:.4g}"
                                                f"{scope})")
        table.add_row("payload sent / dense", f"{_fmt_bytes(b['sent'])} / {_fmt_bytes(b['dense'])} per rank "
                                              "(handed to the collectives)")
        ex = summary.get("exchange")
        if ex:
            table.add_row("exchange", _exchange_text(ex, summary))
        x = summary.get("exchange_seconds")
        if x:
            table.add_row("exchange time", f"selection {x['select']:.2f} s, communication {x['comm']:.2f} s "
                                           "(rank 0, in the comm hooks)")
    else:
        table.add_row("wire bytes / dense", "not measured (strategy has no top-k telemetry)")
    for d in summary.get("log_dirs", []):
        table.add_row("logs", d)
    table.add_row("checkpoint", summary.get("checkpoint") or "none")
    table.add_row("output dir", summary["output_dir"])
    console.print(table)
