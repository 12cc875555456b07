"""Checkpoint/resume scenarios on sklearn digits; every rank dumps what it ended with, per phase.

Phases (run in order in one launch; Lightning's popen launcher re-runs this script for rank 1 and
later Trainers reuse the process group):

  straight       topk_ddp, 2 epochs, no checkpoint (the reference)
  stop           topk_ddp, 1 epoch, ModelCheckpoint(save_top_k=-1, save_last=True) into OUT/ckpt
  ddp_from_topk  plain DDPStrategy resumes OUT/ckpt/epoch=0-step=N.ckpt to 2 epochs, saves OUT/ddp/last.ckpt
  topk_from_ddp  topk_ddp resumes OUT/ddp/last.ckpt to 3 epochs
  resume         topk_ddp resumes ckpt_path="last" (OUT/ckpt) to 2 epochs, save_top_k=1 (prunes epoch 0)
  shrink         (--devices 1) topk_ddp resumes OUT/ckpt/last.ckpt to 3 epochs
  url_stop       topk_ddp, 1 epoch, then trainer.save_checkpoint("file://OUT/url/e1.ckpt") (a URL path)
  url_resume     topk_ddp resumes ckpt_path="file://OUT/url/e1.ckpt" to 2 epochs
  slurm          topk_ddp, 2 epochs, default_root_dir OUT/slurm, ckpt_path=None (SLURM auto-resume
                 of hpc_ckpt_N.ckpt); --slow sleeps per step; the caller starts the ranks with SLURM env;
                 --slow-finalize-rank R: rank R's logger takes 2 s to finalize (Lightning's requeue handler
                 finalizes the loggers before it names the hpc checkpoint, so rank R names it last)
  lost_shard     every rank deletes rank 1's residual shard of OUT/ckpt/last.ckpt, then topk_ddp resumes
                 it to one more epoch

--defaults: topk_ddp with only density set (exchange="auto"); --auto-model: its auto_model option;
--exchange E (with --defaults): E pinned and min_sparse_numel 0 (sparse from the first step);
--local-steps H (with --defaults): sparse local SGD.

The training DataLoader is resumable (Lightning's state_dict/load_state_dict interface for loaders):
it records how many batches of the epoch it handed out and skips them after a mid-epoch restore.
Lightning fetches exactly one batch per step from a sized loader, so that count is what was trained.
"""
import argparse
import json
import os
import sys
import time
import warnings

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_probe import digits

from lightning_topk import TopKDDPStrategy
from lightning_topk.models import ImageClassifier, SmallCNN


class ResumableLoader(DataLoader):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self._handed_out = 0
        self._skip = 0

    def __iter__(self):
        it = super().__iter__()
        skip, self._skip = self._skip, 0
        for _ in range(skip):
            next(it)
        self._handed_out = skip
        for batch in it:
            self._handed_out += 1
            yield batch

    def state_dict(self):
        return {"handed_out": self._handed_out}

    def load_state_dict(self, sd):
        n = int(sd["handed_out"])
        self._skip = n if n < len(self) else 0  # a finished epoch restarts at the next one


class Progress(pl.Callback):
    def __init__(self, out, slow):
        self.out, self.slow = out, slow

    def on_train_batch_end(self, trainer, *args):
        with open(os.path.join(self.out, f"progress_rank{trainer.global_rank}.txt"), "w") as f:
            f.write(str(trainer.global_step))
        if self.slow:
            time.sleep(self.slow)


class SlowFinalizeLogger(pl.loggers.logger.Logger):
    """A logger that logs nothing and takes 2 s to finalize on one rank (like one flushing to slow storage)."""

    def __init__(self, rank):
        super().__init__()
        self.slow_rank = rank

    name = "slow"
    version = 0

    def log_metrics(self, metrics, step=None):
        pass

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def finalize(self, status):
        if status == "finished" and int(os.environ.get("SLURM_PROCID", "-1")) == self.slow_rank:
            time.sleep(2.0)


class Restored(pl.Callback):
    """Records the compression state as restored, before the first exchange applies it."""

    def on_train_start(self, trainer, pl_module):
        st = getattr(trainer.strategy, "topk_state", None)
        self.state = st.state_dict() if st is not None else None


EXTRA = {}  # --bucket-cap-mb / --scope / --auto-model
DEFAULTS = []  # --defaults


def topk(**kw):
    # Default bucket cap: the model's gradients form one DDP bucket (see docs/faults.md on exactness);
    # with --bucket-cap-mb small and --scope parameter they span several buckets.
    if DEFAULTS:
        return TopKDDPStrategy(density=0.01, **EXTRA, **kw)
    return TopKDDPStrategy(density=0.01, min_sparse_numel=1024, momentum_correction=True, exchange="allgather",
                           **EXTRA, **kw)


def run(a, phase, strategy, max_epochs, ckpt_path=None, callbacks=(), root=None, seed=0, logger=False):
    pl.seed_everything(seed, workers=True)
    model = ImageClassifier(SmallCNN(width=16), lr=0.05)
    restored = Restored()
    trainer = pl.Trainer(
        accelerator="cpu", devices=a.devices, strategy=strategy, max_epochs=max_epochs,
        callbacks=[restored, Progress(a.out, a.slow), *callbacks], logger=logger,
        enable_checkpointing=any(isinstance(c, pl.callbacks.ModelCheckpoint) for c in callbacks),
        enable_progress_bar=False, enable_model_summary=False, deterministic=True, use_distributed_sampler=False,
        limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=root or a.out,
    )
    train, _ = digits()
    sampler = DistributedSampler(train, num_replicas=trainer.world_size, rank=trainer.global_rank, shuffle=True,
                                 seed=0)
    loader = ResumableLoader(train, batch_size=32, sampler=sampler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, loader, ckpt_path=ckpt_path)
    st = getattr(trainer.strategy, "topk_state", None)
    dump = {
        "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "residuals": {k: v.clone() for k, v in st.residuals().items()} if st else {},
        "velocities": {k: v.clone() for k, v in st.velocities().items()} if st else {},
        "step": st.step if st else None,
        "masking": st.config.momentum_masking if st and st.config.momentum_correction else None,
        "lookahead": st.config.momentum_lookahead if st else None,
        "auto": st.exchanges["auto"].state_dict() if st is not None and "auto" in st.exchanges else None,
        "buckets": st.totals.buckets if st else None,
        "global_step": trainer.global_step,
        "restored": restored.state,
        "ckpt_path": str(trainer.ckpt_path),
        "warnings": [str(w.message) for w in caught if "lightning_topk" in str(w.message)],
    }
    torch.save(dump, os.path.join(a.out, f"{phase}_rank{trainer.global_rank}.pt"))
    return trainer


def ckpt_cb(dirpath, top_k):
    return pl.callbacks.ModelCheckpoint(dirpath=dirpath, save_top_k=top_k, save_last=True,
                                        every_n_epochs=1, filename="{epoch}-{step}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--phases", default="straight,stop,ddp_from_topk,topk_from_ddp,resume")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--slow", type=float, default=0.0)
    ap.add_argument("--slow-finalize-rank", type=int, default=None)
    ap.add_argument("--bucket-cap-mb", type=float, default=None)
    ap.add_argument("--scope", default=None)
    ap.add_argument("--defaults", action="store_true")
    ap.add_argument("--auto-model", default=None)
    ap.add_argument("--exchange", default=None, help="with --defaults: pin this exchange (min_sparse_numel 0)")
    ap.add_argument("--local-steps", type=int, default=None, help="with --defaults: sparse local SGD, H steps per round")
    a = ap.parse_args()
    if a.defaults:
        DEFAULTS.append(True)
    if a.auto_model is not None:
        EXTRA["auto_model"] = a.auto_model
    if a.exchange is not None:
        EXTRA.update(exchange=a.exchange, min_sparse_numel=0)
    if a.local_steps is not None:
        EXTRA["local_steps"] = a.local_steps
    if a.bucket_cap_mb is not None:
        EXTRA["bucket_cap_mb"] = a.bucket_cap_mb
    if a.scope is not None:
        EXTRA["selection_scope"] = a.scope
    torch.set_num_threads(1)
    ck = os.path.join(a.out, "ckpt")
    # (Lightning 2.6's ModelCheckpoint turns a file:// dirpath into <cwd>/file:/..., so URLs are used here
    # through trainer.save_checkpoint and ckpt_path.)
    url = "file://" + os.path.join(os.path.abspath(a.out), "url", "e1.ckpt")
    for phase in a.phases.split(","):
        if phase == "straight":
            run(a, phase, topk(), 2)
        elif phase == "stop":
            run(a, phase, topk(), 1, callbacks=[ckpt_cb(ck, -1)])
        elif phase == "ddp_from_topk":
            first = sorted(f for f in os.listdir(ck) if f.startswith("epoch=0"))[0]
            run(a, phase, pl.strategies.DDPStrategy(), 2, ckpt_path=os.path.join(ck, first),
                callbacks=[ckpt_cb(os.path.join(a.out, "ddp"), 1)])
        elif phase == "topk_from_ddp":
            run(a, phase, topk(), 3, ckpt_path=os.path.join(a.out, "ddp", "last.ckpt"))
        elif phase == "resume":
            run(a, phase, topk(), 2, ckpt_path="last", callbacks=[ckpt_cb(ck, 1)], seed=1)
        elif phase == "url_stop":
            run(a, phase, topk(), 1).save_checkpoint(url)
        elif phase == "url_resume":
            run(a, phase, topk(), 2, ckpt_path=url)
        elif phase == "shrink":
            run(a, phase, topk(), 3, ckpt_path=os.path.join(ck, "last.ckpt"))
        elif phase == "lost_shard":
            from lightning_topk.lightning.checkpoint import shard_path

            last = os.path.join(ck, "last.ckpt")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                epochs = torch.load(last, weights_only=False)["epoch"] + 2
            try:  # every rank, before its own load: no rank can read the shard first
                os.remove(shard_path(last, 1))
            except FileNotFoundError:
                pass
            run(a, phase, topk(), epochs, ckpt_path=last)
        elif phase == "slurm":
            slow_logger = [] if a.slow_finalize_rank is None else [SlowFinalizeLogger(a.slow_finalize_rank)]
            run(a, phase, topk(), 2, root=os.path.join(a.out, "slurm"), logger=slow_logger or False)
        else:
            raise SystemExit(f"unknown phase {phase!r}")
    if int(os.environ.get("LOCAL_RANK", "0")) == 0 and "SLURM_PROCID" not in os.environ:
        with open(os.path.join(a.out, "done.json"), "w") as f:
            json.dump({"phases": a.phases}, f)


if __name__ == "__main__":
    main()
