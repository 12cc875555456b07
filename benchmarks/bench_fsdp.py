"""``topk_fsdp`` against ``topk_ddp`` and dense HSDP on 2 simulated nodes x 2 gloo processes (CPU, loopback):
memory per rank, final loss at equal tokens, cross-node bytes per step (issue 33).

    python benchmarks/bench_fsdp.py [--phases memory,accuracy] [--acc-steps 360] [--mmap-threshold B] [--json fsdp]

Every run is a Lightning Trainer on ``num_nodes=2, devices=2``, started as two simulated nodes on loopback
(``tests.helpers.procs.run_nodes``; this file re-runs itself with ``--worker``). The model is
``TransformerLM`` with AdamW (``foreach=False``), fp32. Configs:

  hsdp            Lightning's ModelParallelStrategy, ``fully_shard`` of every block and the net on its 2-D mesh
                  (torch's HSDP: reduce-scatter in the node, dense fp32 all-reduce of the shard across nodes)
  topk_fsdp       TopKFSDPStrategy(density=0.01, exchange="allgather"): FSDP2 in the node, the top-k exchange of
                  the shard across nodes (``--exchange``; "auto" sends dense on loopback, see EXCHANGE)
  topk_fsdp_local TopKFSDPStrategy with the ``topk_fsdp_local`` preset (local_steps=16, outer top-k 0.1 at 4 bits)
  topk_ddp        TopKDDPStrategy(density=0.01, exchange="allgather"): every rank holds the full model
  topk_fsdp_warmup    topk_fsdp with ``warmup_steps=100`` (density 0.25 -> 0.01 over the first 100 steps)
  topk_fsdp_local_lm  topk_fsdp with the LM's local SGD recipe (conf/experiment_strategy/
                  transformer_lm_bytes_topk_local.yaml: dense_steps=160, local_steps=4, outer density 1, 4 bits,
                  outer lr 1, no outer momentum)
  topk_fsdp_update  topk_fsdp with local_steps=1: the top-k (1%, fp32, error feedback) of each step's AdamW update
                  instead of its gradient, plain averaging
  topk_fsdp_dense     topk_fsdp with ``dense_steps`` (``--dense-steps``, 100): HSDP's all-reduce for the first steps
  topk_fsdp_frozen    topk_fsdp_dense with AdamW's second moment frozen when the dense steps end
                  (``lightning_topk.optim.FrozenVarianceAdamW(freeze_variance_after=--dense-steps)``)
  topk_fsdp_update_dense, topk_fsdp_update_frozen  topk_fsdp_update with the dense steps, and with the frozen v too
                  (the ``transformer_lm_fsdp`` preset's per-step recipe)
  hsdp_frozen     hsdp with the frozen-v AdamW (the optimizer change alone)
  topk_local      TopKDDPStrategy with the ``topk_local`` preset (the same options as topk_fsdp_local): local
                  SGD's DDP counterpart (θ_outer whole on every rank, momentum and error feedback on its part)

Memory (``--phases memory``): a model of ``--mem-d-model`` x ``--mem-layers`` (3.24M parameters by default),
a few steps; at the last step's ``on_before_optimizer_step`` every rank counts the storage bytes it holds of
parameters (a DTensor's local shard), gradients, optimizer state (AdamW's ``exp_avg``/``exp_avg_sq`` local
shards and ``step``), the top-k residuals (``TopKState``'s bucket buffers; the undo copies of ``nonfinite="skip"``
separately, here none: the default ``nonfinite="raise"``) and local SGD's outer buffers (θ_outer, momentum,
error feedback). Each tensor's whole storage is counted once (FSDP2's padded shards included). FSDP2's
transient all-gather buffers and activations are not counted. Measured beside: the process's resident set at
that moment above its resident set before the model was built (``/proc/self/statm``: the counted state plus
activations, FSDP's buffers and allocator slack), and its peak RSS (``ru_maxrss``: mostly the interpreter's, and
every rank builds the full model before it is sharded, so the peak holds it once). ``--mem-batch`` shrinks the
batch so that a larger model's steps stay short. glibc's default mmap threshold grows as large blocks are freed,
so freed tensors (the full model before sharding, FSDP's all-gather and reduce-scatter buffers) stay resident and
the RSS of the FSDP configs overstates what they hold; ``--mmap-threshold 131072`` fixes the threshold. The
recorded runs:

    python benchmarks/bench_fsdp.py --phases memory --json fsdp_memory
    python benchmarks/bench_fsdp.py --phases memory --mem-d-model 512 --mem-layers 8 --mem-heads 8 --mem-batch 2 \
        --mmap-threshold 131072 --json fsdp_memory_25m_mmap
    python benchmarks/bench_fsdp.py --phases accuracy \
        --acc-configs hsdp,topk_fsdp,topk_ddp,topk_fsdp_warmup,topk_fsdp_local,topk_fsdp_local_lm --json fsdp_accuracy
    python benchmarks/bench_fsdp.py --phases accuracy --acc-configs hsdp,topk_fsdp_update --json fsdp_accuracy_update
    python benchmarks/bench_fsdp.py --phases accuracy --acc-configs hsdp,topk_fsdp_update_frozen,topk_fsdp_update_dense,\
        topk_fsdp_frozen,topk_fsdp_dense,hsdp_frozen --json fsdp_accuracy_adam
    python benchmarks/bench_fsdp.py --phases accuracy --acc-configs hsdp,topk_fsdp_update_frozen --dense-steps 160 \
        --json fsdp_accuracy_adam_dense160
    python benchmarks/bench_fsdp.py --phases accuracy --acc-configs hsdp,topk_fsdp_update_frozen --outer-chunk 0 \
        --json fsdp_accuracy_adam_chunk0

``--beta1-after`` sets the ``*_frozen`` configs' ``beta1_after_freeze`` (AdamW's beta1 after the freeze).
``--outer-chunk`` sets the ``topk_fsdp_update*`` configs' ``outer_chunk`` (default: TopKConfig's, 4096; 0: one top-k
of each rank's whole shard).

Accuracy (``--phases accuracy``): the byte-level text shipped in the package (``lightning_topk.data.text``,
``seq_len`` 65, no download), the ``transformer_lm_bytes`` preset's model (d_model 128, 2 layers, 4 heads),
16 sequences per process per step (4096 tokens per step over the 4 ranks), AdamW lr 2e-3 (10 warm-up steps then
cosine), no gradient clipping, ``--acc-steps`` steps for every config (equal tokens). The figure is the loss on
the held-out split (5%, 605 sequences) of the final model, averaged over the 4 ranks (each evaluates its own
replica on the whole split), and the mean training loss of the last 10 steps.

Cross-node bytes: ``TopKState.totals`` of ``topk_fsdp`` (``bytes_inter``: the payload each rank hands to the
cross-node collective; ``bytes_wire``: what leaves the rank for the algorithm used), per step; local SGD's
``OuterStats.bytes`` per round / local_steps; HSDP's dense all-reduce is computed, not measured: a ring
all-reduce of the fp32 shard over the R=2 nodes sends 2(R-1)/R * 4 * n/L bytes per rank.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
import tempfile
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

NODES, DEVICES = 2, 2
CONFIGS = ("hsdp", "topk_fsdp", "topk_fsdp_local", "topk_ddp", "topk_local", "topk_fsdp_warmup",
           "topk_fsdp_local_lm", "topk_fsdp_update", "topk_fsdp_dense", "topk_fsdp_frozen", "topk_fsdp_update_dense",
           "topk_fsdp_update_frozen", "hsdp_frozen")
# topk_fsdp_update: the top-k of each step's optimizer update instead of its gradient (local SGD with one inner step:
# each replica's AdamW sees only its own gradients, the update's error feedback keeps what was not sent), at the
# per-step exchange's density, fp32 values, plain averaging
UPDATE = dict(local_steps=1, outer_density=0.01, outer_value_bits=32, outer_recipe="average", outer_ef_decay=1.0)
# The AdamW variants (issue 33): DENSE_STEPS synchronous (dense) steps first; the *_frozen configs also freeze
# AdamW's second moment at that step (lightning_topk.optim.FrozenVarianceAdamW, freeze_variance_after=DENSE_STEPS)
DENSE_STEPS = 100
BETA1_AFTER_ARG: dict = {}  # --beta1-after: the *_frozen configs' beta1_after_freeze (absent: betas[0])
FROZEN = ("topk_fsdp_frozen", "topk_fsdp_update_frozen", "hsdp_frozen", "topk_ddp_update_frozen")
WARMUP_STEPS = 100  # topk_fsdp_warmup: DGC's warm-up, density 0.25 -> 0.01 geometrically over these steps
# topk_fsdp_local_lm: conf/experiment_strategy/transformer_lm_bytes_topk_local.yaml's recipe for this LM (post-local
# SGD: 160 synchronous steps, then H 4 with dense 4-bit outer values and plain averaging)
LM_LOCAL = dict(dense_steps=160, local_steps=4, outer_density=1.0, outer_value_bits=4, outer_lr=1.0,
                outer_momentum=0.0)
# topk_fsdp's and topk_ddp's exchange. Pinned: on loopback exchange="auto"'s cost model finds the dense all-reduce
# cheaper than selecting top-k and sends every bucket dense (then topk_fsdp is HSDP bit for bit).
EXCHANGE = "allgather"


# ---- worker (one Trainer process) -------------------------------------------------------------------------
def storage_bytes(tensors, seen):
    """Bytes of the storages behind ``tensors`` not in ``seen`` (a DTensor counts its local shard)."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = getattr(t, "_local_tensor", t)
        s = t.untyped_storage()
        key = (s.data_ptr(), s.nbytes())
        if key in seen or s.nbytes() == 0:
            continue
        seen.add(key)
        total += s.nbytes()
    return total


def rss_bytes():
    """This process's resident set now (``/proc/self/statm``; 0 where there is none)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def count_memory(module, optimizer, strategy):
    seen = set()
    params = list(module.parameters())
    out = {
        "params_numel_full": sum(p.numel() for p in params),
        "param_bytes": storage_bytes(params, seen),
        "grad_bytes": storage_bytes([p.grad for p in params], seen),
        "optim_bytes": storage_bytes([v for s in optimizer.state.values() for v in s.values()
                                      if hasattr(v, "untyped_storage")], seen),
    }
    st = getattr(strategy, "topk_state", None)
    res, undo = [], []
    if st is not None:
        for b in st._buckets.values():
            res += [b.residual, b.velocity]
        for pair in st.undo._copies.values():
            undo += list(pair)
        undo += list(st.undo._tensor_copies.values())
    out["residual_bytes"] = storage_bytes(res, seen)
    out["undo_bytes"] = storage_bytes(undo, seen)
    top = getattr(strategy, "topk", None)
    outer = getattr(top, "outer", None) or getattr(getattr(st, "exchange", None), "outer", None)  # fsdp, ddp
    out["outer_bytes"] = (storage_bytes([outer.theta, outer.mom, outer.ef, outer.anchor, outer.pending], seen)
                          if outer is not None else 0)
    out["total_bytes"] = sum(out[k] for k in ("param_bytes", "grad_bytes", "optim_bytes", "residual_bytes",
                                              "undo_bytes", "outer_bytes"))
    return out


def worker(a):
    OUTER_CHUNK_ARG.update({} if a.outer_chunk is None else {"outer_chunk": a.outer_chunk})
    BETA1_AFTER_ARG.update({} if a.beta1_after is None else {"beta1_after_freeze": a.beta1_after})
    import numpy as np
    import pytorch_lightning as pl
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_topk.data.text import VOCAB_SIZE, byte_sequences
    from lightning_topk.lightning.fsdp import TopKFSDPStrategy
    from lightning_topk.lightning.registry import LOCAL_DEFAULTS
    from lightning_topk.lightning.strategy import TopKDDPStrategy
    from lightning_topk.models.components.transformer import TransformerLM

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    seq_len = 65
    train, val = byte_sequences(seq_len=seq_len, val_fraction=0.05, seed=0)

    class LM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = TransformerLM(VOCAB_SIZE, d_model=a.d_model, layers=a.layers, heads=a.heads, ff_mult=4,
                                     max_len=seq_len - 1, dropout=0.0)
            self.losses, self.memory, self.t0 = [], None, None

        def configure_model(self):
            if a.config not in ("hsdp", "hsdp_frozen"):
                return  # topk_fsdp shards every block, then the rest; topk_ddp replicates
            from torch.distributed.fsdp import fully_shard

            for block in self.net.blocks.layers:
                fully_shard(block, mesh=self.device_mesh)
            fully_shard(self.net, mesh=self.device_mesh)

        def forward_loss(self, x):
            logits = self.net(x[:, :-1])
            return nn.functional.cross_entropy(logits.reshape(-1, VOCAB_SIZE), x[:, 1:].reshape(-1))

        def training_step(self, batch, i):
            if self.trainer.global_step == 1 and self.t0 is None:
                self.t0 = time.perf_counter()
            loss = self.forward_loss(batch[0].long())
            self.losses.append(float(loss.detach()))
            return loss

        def on_before_optimizer_step(self, optimizer):
            if a.measure_memory and self.trainer.global_step == a.steps - 1:
                self.memory = count_memory(self, optimizer, self.trainer.strategy)
                self.memory["rss_bytes"] = rss_bytes()
                self.memory["rss_above_start_bytes"] = self.memory["rss_bytes"] - rss_start

        def configure_optimizers(self):
            if a.config in FROZEN:
                from lightning_topk.optim import FrozenVarianceAdamW

                opt = FrozenVarianceAdamW(self.parameters(), lr=2e-3, weight_decay=0.01, foreach=False,
                                          freeze_variance_after=a.dense_steps, **BETA1_AFTER_ARG)
            else:
                opt = torch.optim.AdamW(self.parameters(), lr=2e-3, weight_decay=0.01, foreach=False)
            warm = 10

            def lr(step):
                if step < warm:
                    return (step + 1) / warm
                return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, a.steps - warm))))

            return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, lr),
                                                       "interval": "step"}}

    if a.config in ("hsdp", "hsdp_frozen"):
        strategy = pl.strategies.ModelParallelStrategy()
    elif a.config == "topk_fsdp":
        strategy = TopKFSDPStrategy(density=0.01, exchange=a.exchange)
    elif a.config == "topk_fsdp_local":
        strategy = TopKFSDPStrategy(**LOCAL_DEFAULTS)
    elif a.config == "topk_ddp":
        strategy = TopKDDPStrategy(density=0.01, exchange=a.exchange)
    elif a.config == "topk_local":
        strategy = TopKDDPStrategy(**LOCAL_DEFAULTS)
    elif a.config == "topk_fsdp_warmup":
        strategy = TopKFSDPStrategy(density=0.01, exchange=a.exchange, warmup_steps=WARMUP_STEPS)
    elif a.config == "topk_fsdp_local_lm":
        strategy = TopKFSDPStrategy(**LM_LOCAL)
    elif a.config == "topk_fsdp_update":
        strategy = TopKFSDPStrategy(**UPDATE, **OUTER_CHUNK_ARG)
    elif a.config in ("topk_fsdp_dense", "topk_fsdp_frozen"):
        strategy = TopKFSDPStrategy(density=0.01, exchange=a.exchange, dense_steps=a.dense_steps)
    elif a.config in ("topk_fsdp_update_dense", "topk_fsdp_update_frozen"):
        strategy = TopKFSDPStrategy(**UPDATE, dense_steps=a.dense_steps, **OUTER_CHUNK_ARG)
    elif a.config == "topk_ddp_update_frozen":
        strategy = TopKDDPStrategy(**UPDATE, dense_steps=a.dense_steps, **OUTER_CHUNK_ARG)
    else:
        raise ValueError(a.config)
    trainer = pl.Trainer(accelerator="cpu", devices=DEVICES, num_nodes=NODES, strategy=strategy, max_steps=a.steps,
                         use_distributed_sampler=False, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         precision="32-true")
    rss_start = rss_bytes()  # torch, Lightning and the text loaded; no model yet
    model = LM()
    world = NODES * DEVICES
    rank = int(os.environ.get("NODE_RANK", 0)) * DEVICES + int(os.environ.get("LOCAL_RANK", 0))
    data = torch.from_numpy(train[rank::world].astype(np.int64))
    loader = DataLoader(TensorDataset(data), batch_size=a.batch, shuffle=False, drop_last=True)
    t_start = time.perf_counter()
    trainer.fit(model, loader)
    fit_s = time.perf_counter() - t_start
    step_s = (time.perf_counter() - model.t0) / max(1, a.steps - 1) if model.t0 else float("nan")
    info = {"config": a.config, "rank": trainer.global_rank, "steps": trainer.global_step, "fit_s": fit_s,
            "step_s": step_s, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "train_loss_last10": sum(model.losses[-10:]) / len(model.losses[-10:]),
            "train_loss_first": model.losses[0], "memory": model.memory}
    if a.eval:  # every rank evaluates its own replica on the whole held-out split (FSDP: collectives per group)
        net = model.net
        net.eval()
        v = torch.from_numpy(val.astype(np.int64))
        tot, n = 0.0, 0
        with torch.no_grad():
            for i in range(0, len(v), 64):
                x = v[i:i + 64]
                tot += float(model.forward_loss(x)) * len(x)
                n += len(x)
        info["val_loss"] = tot / n
        t = torch.tensor([info["val_loss"]], dtype=torch.float64)
        dist.all_reduce(t)
        info["val_loss_mean"] = float(t) / world
    st = getattr(trainer.strategy, "topk_state", None)
    if st is not None:
        tt = st.totals
        info["exchange"] = {"steps": st.step, "bytes_inter": tt.bytes_inter, "bytes_intra": tt.bytes_intra,
                            "bytes_sent": tt.bytes_sent, "bytes_dense": tt.bytes_dense, "bytes_wire": tt.bytes_wire,
                            "bytes_dense_wire": tt.bytes_dense_wire, "numel": tt.numel, "numel_sent": tt.numel_sent,
                            "buckets_by": dict(tt.buckets_by), "last_bytes_inter": st.last.bytes_inter,
                            "last_bytes_wire": st.last.bytes_wire, "last_numel": st.last.numel}
    top = getattr(trainer.strategy, "topk", None)
    # local SGD's outer state: topk_fsdp's ShardedTopK holds it, topk_ddp's local exchange (TopKState.exchange)
    outer = getattr(top, "outer", None) or getattr(getattr(st, "exchange", None), "outer", None)
    if outer is not None:
        info["outer"] = {"rounds": outer.stats.rounds, "last_round_bytes": outer.stats.bytes,
                         "buffer_bytes": outer.stats.buffer_bytes, "density": outer.stats.density,
                         "local_steps": outer.config.local_steps, "shard_numel": int(outer.shard)}
        info["dense_steps"] = outer.config.dense_steps
    if top is not None:
        info["shard_numel_padded"] = sum(sum(n) for _, n in top.specs)  # this rank's padded gradient shards
    with open(f"{a.out}.rank{trainer.global_rank}", "w") as f:
        json.dump(info, f)


# ---- driver -----------------------------------------------------------------------------------------------
def run(config, steps, d_model, layers, heads, measure_memory, evaluate, tmp, exchange=EXCHANGE, batch=16):
    from tests.helpers.procs import run_nodes

    out = os.path.join(tmp, f"{config}-{d_model}x{layers}-{steps}")
    args = [os.path.abspath(__file__), "--worker", "--config", config, "--steps", steps, "--d-model", d_model,
            "--layers", layers, "--heads", heads, "--out", out]
    args += ["--exchange", exchange, "--batch", batch, "--dense-steps", DENSE_STEPS_ARG[0]]
    args += ["--outer-chunk", OUTER_CHUNK_ARG["outer_chunk"]] if OUTER_CHUNK_ARG else []
    args += ["--beta1-after", BETA1_AFTER_ARG["beta1_after_freeze"]] if BETA1_AFTER_ARG else []
    args += ["--measure-memory"] if measure_memory else []
    args += ["--eval"] if evaluate else []
    t0 = time.perf_counter()
    env = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if MMAP_THRESHOLD[0]:  # glibc: allocations above this are mmap-ed and go back to the OS when freed
        env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD[0])
    run_nodes(args, num_nodes=NODES, timeout=1800, env=env)
    wall = time.perf_counter() - t0
    ranks = []
    for r in range(NODES * DEVICES):
        with open(f"{out}.rank{r}") as f:
            ranks.append(json.load(f))
    return ranks, wall


DENSE_STEPS_ARG = [DENSE_STEPS]  # --dense-steps
OUTER_CHUNK_ARG: dict = {}  # --outer-chunk (the topk_fsdp_update* configs; empty: TopKConfig's default)
MMAP_THRESHOLD = [0]  # --mmap-threshold (0: glibc's default, a threshold that grows as large blocks are freed)


def hsdp_bytes_per_rank(numel_shard, replicas=NODES):
    """Computed: a ring all-reduce of ``numel_shard`` fp32 entries over ``replicas`` ranks, bytes out per rank."""
    return 2 * (replicas - 1) / replicas * 4 * numel_shard


def memory_phase(a, tmp):
    rows = []
    print(f"\n# memory per rank (bytes counted at the last step), {NODES} nodes x {DEVICES} processes, "
          f"d_model {a.mem_d_model}, {a.mem_layers} layers, AdamW, {a.mem_steps} steps\n")
    print("| config | params | grads | AdamW state | residuals | outer | total (MB) | / topk_ddp | "
          "RSS above start (MB) | peak RSS (MB) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    by = {}
    for config in a.mem_configs.split(","):
        ranks, wall = run(config, a.mem_steps, a.mem_d_model, a.mem_layers, a.mem_heads, True, False, tmp,
                          a.exchange, a.mem_batch)
        mem = [r["memory"] for r in ranks]
        keys = [k for k in mem[0] if k.endswith("_bytes")]  # the counted ones, and the RSS now
        mean = {k: sum(m[k] for m in mem) / len(mem) for k in keys}
        row = {"phase": "memory", "config": config, "params": mem[0]["params_numel_full"],
               "d_model": a.mem_d_model, "layers": a.mem_layers, "steps": a.mem_steps, "batch": a.mem_batch,
               "per_rank_mean": mean, "per_rank": mem, "max_total_bytes": max(m["total_bytes"] for m in mem),
               "peak_rss_bytes": [r["peak_rss_bytes"] for r in ranks], "step_s": max(r["step_s"] for r in ranks),
               "wall_s": wall}
        by[config] = row
        rows.append(row)
    ddp = by.get("topk_ddp")
    for config, row in by.items():
        m = row["per_rank_mean"]
        if ddp is not None:
            row["ratio_to_topk_ddp"] = m["total_bytes"] / ddp["per_rank_mean"]["total_bytes"]
        if config == "topk_fsdp_local" and "topk_local" in by:
            row["ratio_to_topk_local"] = m["total_bytes"] / by["topk_local"]["per_rank_mean"]["total_bytes"]
        if "hsdp" in by:
            row["ratio_to_hsdp"] = m["total_bytes"] / by["hsdp"]["per_rank_mean"]["total_bytes"]
        mb = {k: v / 2**20 for k, v in m.items()}
        print(f"| {config} | {mb['param_bytes']:.2f} | {mb['grad_bytes']:.2f} | {mb['optim_bytes']:.2f} | "
              f"{mb['residual_bytes']:.2f} | {mb['outer_bytes']:.2f} | {mb['total_bytes']:.2f} | "
              f"{row.get('ratio_to_topk_ddp', float('nan')):.3f} | {mb['rss_above_start_bytes']:.0f} | "
              f"{sum(row['peak_rss_bytes']) / len(row['peak_rss_bytes']) / 2**20:.0f} |", flush=True)
    return rows


def accuracy_phase(a, tmp):
    rows = []
    print(f"\n# final loss at equal tokens: {a.acc_steps} steps x 4096 tokens, d_model {a.acc_d_model}, "
          f"{a.acc_layers} layers\n")
    by = {}
    for config in a.acc_configs.split(","):
        ranks, wall = run(config, a.acc_steps, a.acc_d_model, a.acc_layers, a.acc_heads, False, True, tmp,
                          a.exchange)
        r0 = ranks[0]
        row = {"phase": "accuracy", "config": config, "steps": a.acc_steps, "tokens": a.acc_steps * 16 * 64 * 4,
               "d_model": a.acc_d_model, "layers": a.acc_layers, "val_loss": r0["val_loss_mean"],
               "val_loss_per_rank": [r["val_loss"] for r in ranks],
               "train_loss_last10": sum(r["train_loss_last10"] for r in ranks) / len(ranks),
               "train_loss_first": r0["train_loss_first"], "step_s": max(r["step_s"] for r in ranks),
               "wall_s": wall}
        if config.endswith(("_dense", "_frozen")) and config != "hsdp_frozen":
            row["dense_steps"] = a.dense_steps
        if config.startswith(("topk_fsdp_update", "topk_ddp_update")) and OUTER_CHUNK_ARG:
            row["outer_chunk"] = OUTER_CHUNK_ARG["outer_chunk"]
        if config in FROZEN:
            extra = "".join(f", {k}={v}" for k, v in BETA1_AFTER_ARG.items())
            row["optimizer"] = f"FrozenVarianceAdamW(freeze_variance_after={a.dense_steps}{extra})"
            row["freeze_variance_after"] = a.dense_steps
            row.update(BETA1_AFTER_ARG)
        shard = r0.get("shard_numel_padded")
        if "exchange" in r0 and "outer" not in r0:  # under local SGD TopKState counts the inner steps' traffic
            ex = [r["exchange"] for r in ranks]
            steps = max(1, ex[0]["steps"])
            row["cross_node"] = {
                "source": "measured (TopKState.totals, per rank, mean over ranks and steps)",
                "bytes_inter_per_step": sum(e["bytes_inter"] for e in ex) / len(ex) / steps,
                "bytes_wire_per_step": sum(e["bytes_wire"] for e in ex) / len(ex) / steps,
                "bytes_dense_wire_per_step": sum(e["bytes_dense_wire"] for e in ex) / len(ex) / steps,
                "numel_per_step": ex[0]["numel"] / steps, "numel_sent_per_step": ex[0]["numel_sent"] / steps,
                "buckets_by": ex[0]["buckets_by"], "exchange_steps": steps,
                "last_step_bytes_inter": sum(e["last_bytes_inter"] for e in ex) / len(ex),
                "last_step_bytes_wire": sum(e["last_bytes_wire"] for e in ex) / len(ex)}
        if "outer" in r0:
            o = [r["outer"] for r in ranks]
            row["cross_node"] = {
                "source": "measured (OuterStats.bytes of the last round, per rank, / local_steps)",
                "rounds": o[0]["rounds"], "local_steps": o[0]["local_steps"],
                "bytes_per_round": sum(x["last_round_bytes"] for x in o) / len(o),
                "bytes_inter_per_step": sum(x["last_round_bytes"] for x in o) / len(o) / o[0]["local_steps"],
                "buffer_bytes_per_round": o[0]["buffer_bytes"]}
            dense = max(0, min(a.acc_steps, r0["dense_steps"]))
            if dense and shard:
                row["cross_node"]["dense_steps"] = dense
                row["cross_node"]["amortized_bytes_per_step_computed"] = (
                    dense * hsdp_bytes_per_rank(shard) + o[0]["rounds"] * row["cross_node"]["bytes_per_round"]
                ) / a.acc_steps
                row["cross_node"]["amortized_note"] = (
                    "computed: the synchronous steps as HSDP's fp32 ring all-reduce of the shard, plus rounds x "
                    "the last round's measured bytes, over all steps")
        if shard:
            row["shard_numel_padded"] = shard
        by[config] = row
        rows.append(row)
        print(f"  {config}: val {row['val_loss']:.4f}, train(last 10) {row['train_loss_last10']:.4f}, "
              f"step {row['step_s']:.2f} s, wall {wall:.0f} s", flush=True)
    n_shard = next((r["shard_numel_padded"] for r in rows if r.get("shard_numel_padded")), None)
    print("\n| config | val loss | / hsdp | train loss (last 10) | / hsdp | cross-node bytes/step/rank | step (s) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for config, row in by.items():
        if "hsdp" in by:
            row["val_ratio_to_hsdp"] = row["val_loss"] / by["hsdp"]["val_loss"]
            row["train_ratio_to_hsdp"] = row["train_loss_last10"] / by["hsdp"]["train_loss_last10"]
        if config == "hsdp" and n_shard:
            row["cross_node"] = {"source": "computed: ring all-reduce of the fp32 shard over 2 nodes, "
                                           "2(R-1)/R * 4 * n/L bytes per rank (n/L: topk_fsdp's padded shard)",
                                 "bytes_inter_per_step": hsdp_bytes_per_rank(n_shard)}
        cn = row.get("cross_node", {}).get("bytes_inter_per_step", float("nan"))
        wire = row.get("cross_node", {}).get("bytes_wire_per_step")
        wire_s = f" (wire {wire:,.0f})" if wire is not None else ""
        print(f"| {config} | {row['val_loss']:.4f} | {row.get('val_ratio_to_hsdp', float('nan')):.4f} | "
              f"{row['train_loss_last10']:.4f} | {row.get('train_ratio_to_hsdp', float('nan')):.4f} | "
              f"{cn:,.0f}{wire_s} | {row['step_s']:.2f} |", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phases", default="memory,accuracy")
    ap.add_argument("--mem-configs", default="topk_ddp,hsdp,topk_fsdp,topk_local,topk_fsdp_local")
    ap.add_argument("--mem-d-model", type=int, default=256)
    ap.add_argument("--mem-layers", type=int, default=4)
    ap.add_argument("--mem-heads", type=int, default=4)
    ap.add_argument("--mem-steps", type=int, default=3)
    ap.add_argument("--mem-batch", type=int, default=16, help="sequences per process per step (memory runs)")
    ap.add_argument("--acc-configs", default="hsdp,topk_fsdp,topk_fsdp_local")
    ap.add_argument("--acc-d-model", type=int, default=128)
    ap.add_argument("--acc-layers", type=int, default=2)
    ap.add_argument("--acc-heads", type=int, default=4)
    ap.add_argument("--acc-steps", type=int, default=360, help="2 epochs of the text (the preset's max_epochs)")
    ap.add_argument("--mmap-threshold", type=int, default=0,
                    help="MALLOC_MMAP_THRESHOLD_ of the workers (bytes; 0: glibc's default): with a fixed threshold "
                         "freed tensors leave the resident set, which then follows the live memory more closely")
    ap.add_argument("--json", default="fsdp", help="results name under benchmarks/results/ ('': none)")
    ap.add_argument("--note", default="", help="a note stored in the JSON")
    # worker mode (one Trainer process; the driver starts these)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--d-model", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--heads", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--exchange", default=EXCHANGE, help="topk_fsdp's and topk_ddp's exchange (default %(default)s)")
    ap.add_argument("--measure-memory", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--eval", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=16, help=argparse.SUPPRESS)
    ap.add_argument("--dense-steps", type=int, default=DENSE_STEPS,
                    help="the *_dense and *_frozen configs' dense steps and freeze step (default %(default)s)")
    ap.add_argument("--outer-chunk", type=int, default=None,
                    help="the topk_fsdp_update* configs' outer_chunk (default: TopKConfig's; 0: one top-k per shard)")
    ap.add_argument("--beta1-after", type=float, default=None,
                    help="the *_frozen configs' beta1 after the freeze (FrozenVarianceAdamW's beta1_after_freeze)")
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    from _results import write_results

    import lightning_topk

    MMAP_THRESHOLD[0] = a.mmap_threshold
    DENSE_STEPS_ARG[0] = a.dense_steps
    if a.outer_chunk is not None:
        OUTER_CHUNK_ARG["outer_chunk"] = a.outer_chunk
    if a.beta1_after is not None:
        BETA1_AFTER_ARG["beta1_after_freeze"] = a.beta1_after
    load_before = os.getloadavg()[0]
    print(f"# {NODES} simulated nodes x {DEVICES} gloo processes (CPU), {lightning_topk.__file__}")
    print(f"# load average before: {os.getloadavg()}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        phases = a.phases.split(",")
        if "memory" in phases:
            rows += memory_phase(a, tmp)
        if "accuracy" in phases:
            rows += accuracy_phase(a, tmp)
    print(f"\n# load average after: {os.getloadavg()}")
    if a.json:
        print(write_results(a.json, rows, sys.argv, nodes=NODES, processes_per_node=DEVICES, backend="gloo",
                            library=lightning_topk.__file__, load_before=load_before,
                            load_after=os.getloadavg()[0], exchange=a.exchange,
                            malloc_mmap_threshold=a.mmap_threshold or None, note=a.note))


if __name__ == "__main__":
    main()
