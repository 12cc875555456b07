"""Mid-epoch resume of a WebDataModule under Lightning; every rank dumps its final parameters per phase.

Phases (run in order in one launch; Lightning's popen launcher re-runs this script for rank 1 and
later Trainers reuse the process group):

  straight  fit --epochs epochs, no checkpoint (the reference)
  stop      fit until the last of the global steps --stop-at (comma-separated), saving OUT/ckpt/stepK.ckpt
            after each of them (in on_train_batch_end, where ModelCheckpoint saves)
  resume    fit --epochs epochs from each OUT/ckpt/stepK.ckpt (dumps phase resumeK)
  replay    same from the first, without the loader state in the checkpoint (what older versions saved)
  slurm     fit --epochs epochs with default_root_dir OUT/slurm and ckpt_path=None (under SLURM
            Lightning resumes OUT/slurm/hpc_ckpt_N.ckpt); --slow sleeps after each step; the caller
            starts the ranks with SLURM variables

Each phase is a fresh DataModule (empty caches, new workers), as in a new job.
"""
import argparse
import json
import os
import time
import warnings

import pytorch_lightning as pl
import torch

from lightning_topk.data import WebDataModule


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 32), torch.nn.ReLU(),
                                       torch.nn.Linear(32, 10))

    def training_step(self, batch, i):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class SaveAt(pl.Callback):
    def __init__(self, dirpath, steps):
        self.dirpath, self.steps = dirpath, steps

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step in self.steps:
            trainer.save_checkpoint(os.path.join(self.dirpath, f"step{trainer.global_step}.ckpt"))


class Progress(pl.Callback):
    def __init__(self, out, slow):
        self.out, self.slow = out, slow

    def on_train_batch_end(self, trainer, *args):
        with open(os.path.join(self.out, f"progress_rank{trainer.global_rank}.txt"), "w") as f:
            f.write(str(trainer.global_step))
        if self.slow:
            time.sleep(self.slow)


def strategy(a):
    if a.strategy == "ddp":
        return pl.strategies.DDPStrategy()
    from lightning_topk import TopKDDPStrategy

    # per-parameter selection: bit-exact across DDP's bucket rebuild after a resume
    return TopKDDPStrategy(density=0.05, min_sparse_numel=256, selection_scope="parameter", exchange="allgather")


def run(a, phase, max_epochs=None, max_steps=-1, ckpt_path=None, callbacks=(), root=None):
    pl.seed_everything(0)
    dm = WebDataModule(a.shards, keys=("png", "cls"), image_mode="L", batch_size=16, num_workers=a.workers,
                       worker_start=a.worker_start, seed=5, shuffle_buffer=40, ram_cache=a.ram_cache,
                       gpu_cache=a.gpu_cache, crop_padding=1, flip=True, mean=[0.3], std=[0.35])
    model = Net()
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy(a), max_epochs=max_epochs or a.epochs, max_steps=max_steps,
        callbacks=[Progress(a.out, a.slow), *callbacks], logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        default_root_dir=root or a.out)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    dump = {"params": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "global_step": trainer.global_step, "ckpt_path": str(trainer.ckpt_path),
            "warnings": [str(w.message) for w in caught if "resum" in str(w.message)]}
    torch.save(dump, os.path.join(a.out, f"{phase}_rank{trainer.global_rank}.pt"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shards", required=True, nargs="+")
    ap.add_argument("--phases", default="straight,stop,resume,replay")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--worker-start", default="auto")  # the default of WebDataModule
    ap.add_argument("--ram-cache", default="off")
    ap.add_argument("--gpu-cache", action="store_true")
    ap.add_argument("--strategy", default="ddp", choices=["ddp", "topk"])
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--stop-at", default="7")
    ap.add_argument("--slow", type=float, default=0.0)
    a = ap.parse_args()
    torch.set_num_threads(1)
    ck = os.path.join(a.out, "ckpt")
    stops = [int(k) for k in a.stop_at.split(",")]
    for phase in a.phases.split(","):
        if phase == "straight":
            run(a, phase)
        elif phase == "stop":
            run(a, phase, max_epochs=-1, max_steps=max(stops), callbacks=[SaveAt(ck, stops)])
        elif phase == "resume":
            for k in stops:
                run(a, f"resume{k}", ckpt_path=os.path.join(ck, f"step{k}.ckpt"))
        elif phase == "replay":
            old = os.path.join(ck, "no_loader_state.ckpt")
            if int(os.environ.get("LOCAL_RANK", "0")) == 0:
                ckpt = torch.load(os.path.join(ck, f"step{stops[0]}.ckpt"), weights_only=False)
                ckpt["loops"]["fit_loop"]["state_dict"].pop("combined_loader")
                torch.save(ckpt, old)
            if torch.distributed.is_initialized():  # rank 1 waits for the file
                torch.distributed.barrier()
            run(a, phase, ckpt_path=old)
        elif phase == "slurm":
            run(a, phase, root=os.path.join(a.out, "slurm"))
        else:
            raise SystemExit(f"unknown phase {phase!r}")
    if int(os.environ.get("LOCAL_RANK", "0")) == 0 and "SLURM_PROCID" not in os.environ:
        with open(os.path.join(a.out, "done.json"), "w") as f:
            json.dump({"phases": a.phases}, f)


if __name__ == "__main__":
    main()
