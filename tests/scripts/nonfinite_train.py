"""One gradient fault per run, under every precision: does the skip equal a run that never saw the batch?

Each rank trains an MLP on its own fixed list of sklearn-digits batches with ``topk_ddp`` (several buckets).
In the poisoned run, one element of one gradient is NaN on ``--bad-rank`` at step ``STEP``, before the
exchange. The reference run is the same run without that batch. Cases (in this order, in one launch;
later Trainers reuse the process group):

  skip:<plugin>  nonfinite="skip"; plugin none | 32-true | bf16-mixed (TopKPrecision) | tk16 (TopKPrecision
                 fp16 with GradScaler) | mp16 (Lightning's MixedPrecision with a GradScaler on CPU)
  defaults:<plugin>  as skip:<plugin> with only density and nonfinite set (exchange="auto") under
                 Trainer(deterministic=True)
  scale          Lightning's MixedPrecision, the loss scale doubling every step vs a constant scale:
                 residuals after the same steps (in unscaled units they agree)
  raise          nonfinite="raise": every rank must raise FloatingPointError (last: it ends the run)

Every rank writes ``OUT/rank<r>.pt`` with what it saw. ``--num-nodes 2`` with NODE_RANK set by the caller
runs the hierarchical exchange (2 nodes x 2 processes).
"""
import argparse
import os
import traceback
from datetime import timedelta

import pytorch_lightning as pl
import torch
from pytorch_lightning.plugins.precision import MixedPrecision
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader

from lightning_topk import TopKDDPStrategy, TopKPrecision

STEP, STEPS, BATCH = 3, 8, 32
POISONED = "net.0.weight"


class Net(pl.LightningModule):
    def __init__(self, fault=None, fault_rank=0, value=float("nan")):
        super().__init__()
        torch.manual_seed(0)
        # 1.3 MB of gradients: several DDP buckets (the first one holds up to 1 MB)
        self.net = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 256), nn.ReLU(), nn.Linear(256, 10))
        self.fault, self.fault_rank, self.value = fault, fault_rank, value
        self.scales, self.residual_log = [], []

    def on_train_start(self):
        p = dict(self.named_parameters())[POISONED]
        p.register_hook(self._poison)

    def _poison(self, g):
        if self.fault is not None and self.global_step == self.fault and self.global_rank == self.fault_rank:
            g = g.clone()
            g.view(-1)[7] = self.value
        return g

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def on_train_batch_end(self, *args):
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        self.scales.append(None if scaler is None else scaler.get_scale())
        st = self.trainer.strategy.topk_state
        self.residual_log.append({k: v.clone() for k, v in st.residuals().items()})
        self.velocities = {k: v.clone() for k, v in st.velocities().items()}
        self.recipe = self.trainer.strategy.topk_recipe

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def batches(rank, drop=None):
    x, y = load_digits(return_X_y=True)
    g = torch.Generator().manual_seed(1 + rank)
    perm = torch.randperm(len(y), generator=g)[: STEPS * BATCH]
    xs = torch.tensor(x / 16.0, dtype=torch.float32)[perm]
    ys = torch.tensor(y)[perm]
    out = [(xs[i * BATCH:(i + 1) * BATCH], ys[i * BATCH:(i + 1) * BATCH]) for i in range(STEPS)]
    return [b for i, b in enumerate(out) if i != drop]


def plugin(name, **scaler_kw):
    kw = {"init_scale": 2.0**10, "growth_interval": 10**6, **scaler_kw}
    return {
        "none": lambda: None,
        "32-true": lambda: TopKPrecision("32-true", device="cpu"),
        "bf16-mixed": lambda: TopKPrecision("bf16-mixed", device="cpu"),
        "tk16": lambda: TopKPrecision("16-mixed", device="cpu", **kw),
        # On CPU Lightning's precision="16-mixed" flag turns into bf16: build the plugin explicitly.
        "mp16": lambda: MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", **kw)),
    }[name]()


def fit(args, precision=None, drop=None, defaults=False, **strategy_kw):
    if defaults:  # only density and nonfinite set, under Trainer(deterministic=True): exchange="auto"
        kw = dict(density=0.01, nonfinite="skip", timeout=timedelta(seconds=60))
    else:
        kw = dict(density=0.05, min_sparse_numel=0, dense_steps=1, nonfinite="skip", bucket_cap_mb=0.25,
                  timeout=timedelta(seconds=60))
        # a pinned exchange: probed timings could make auto's choice differ between the run and its reference
        kw.setdefault("exchange", "hierarchical" if strategy_kw.get("hierarchical") is True else "allgather")
    kw.update(strategy_kw)
    model = Net(fault=None if drop is not None else STEP, fault_rank=args.bad_rank, value=float(args.value))
    trainer = pl.Trainer(accelerator="cpu", devices=2, num_nodes=args.num_nodes, strategy=TopKDDPStrategy(**kw),
                         plugins=[precision] if precision is not None else None, max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False, num_sanity_val_steps=0, deterministic=defaults)
    rank = int(os.environ.get("NODE_RANK", 0)) * 2 + int(os.environ.get("LOCAL_RANK", 0))
    data = batches(rank, drop)
    trainer.fit(model, DataLoader(data, batch_size=None))
    model.plan = dict(getattr(trainer.strategy.topk_state.exchange, "plan", {}))
    return model


def params_of(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="skip:none")
    ap.add_argument("--num-nodes", type=int, default=1)
    ap.add_argument("--bad-rank", type=int, default=0)
    ap.add_argument("--value", default="nan")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    hier = {} if a.num_nodes == 1 else {"hierarchical": True}
    results = {}
    for case in a.cases.split(","):
        if case.startswith(("skip:", "defaults:")):
            name = case.split(":", 1)[1]
            d = case.startswith("defaults:")
            bad = fit(a, plugin(name), defaults=d, **hier)
            ref = fit(a, plugin(name), drop=STEP, defaults=d, **hier)
            results[case] = dict(bad=params_of(bad), ref=params_of(ref), scales=bad.scales, plans=(bad.plan, ref.plan),
                                 velocities=(bad.velocities, ref.velocities), recipe=bad.recipe,
                                 residuals_finite=all(bool(torch.isfinite(r).all())
                                                      for log in bad.residual_log for r in log.values()))
        elif case == "scale":
            grow = fit(a, plugin("mp16", growth_interval=1), drop=STEP)
            flat = fit(a, plugin("mp16"), drop=STEP)
            results[case] = dict(grow=grow.residual_log[-1], flat=flat.residual_log[-1],
                                 scales=(grow.scales, flat.scales))
        elif case == "raise":
            error = None
            try:
                fit(a, None, nonfinite="raise", **hier)
            except Exception as e:
                error = {"type": type(e).__name__, "message": str(e), "tb": traceback.format_exc()[-3000:]}
            results[case] = dict(error=error)
    torch.save(results, os.path.join(a.out, f"rank{torch.distributed.get_rank()}.pt"))


if __name__ == "__main__":
    main()
