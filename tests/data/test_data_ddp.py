"""WebDataModule across real processes: 2 ranks x 2 DataLoader workers on gloo, and Lightning fits
under plain ``ddp`` and ``topk_ddp`` (popen launchers, so they run as a script in a subprocess)."""
import json
import os
import subprocess
import textwrap

import pytest
import torch.distributed as dist

from lightning_topk.data import WebDataModule, array_samples, load_arrays, write_shards
from tests.helpers.dist import run_distributed
from tests.helpers.procs import python_for

N, WORLD, BATCH, EPOCHS = 400, 2, 32, 2


@pytest.fixture(scope="module")
def shard_sets(tmp_path_factory):
    images, labels = load_arrays("digits", image_size=16)
    out = {}
    for n in (7, 1):
        d = tmp_path_factory.mktemp(f"ddp{n}")
        out[n] = write_shards(array_samples(images[:N], labels[:N]), str(d), prefix="d", num_shards=n, total=N,
                              progress=False)
    return out


CONFIGS = [(7, "fork", "encoded"), (1, "spawn", "decoded")]  # (shard count, worker start method, RAM level)


def _rank_main(rank, world, shard_sets, out_dir):
    """Every configuration in one process group: one launch of 2 ranks serves both parametrised checks."""
    os.environ.pop("RANK", None)  # prove nothing reads it
    for nshards, worker_start, ram_cache in CONFIGS:
        dm = WebDataModule(shard_sets[nshards], keys=("png", "cls"), image_mode="L", batch_size=BATCH,
                           num_workers=2, seed=11, shuffle_buffer=64, worker_start=worker_start,
                           persistent_workers=worker_start == "spawn", ram_cache=ram_cache)
        dm.setup("fit")  # rank and world size come from torch.distributed here
        loader = dm.train_dataloader()
        epochs = []
        for _ in range(EPOCHS):
            ids, steps = [], 0
            for batch in loader:
                ids += batch["ids"].tolist()
                steps += 1
                dist.barrier()  # a rank with fewer batches would leave the other one waiting here
            epochs.append({"ids": ids, "steps": steps, "len": len(loader)})
        del loader  # persistent workers end here, before the next configuration
        with open(os.path.join(out_dir, f"{nshards}_{worker_start}_{ram_cache}_rank{rank}.json"), "w") as f:
            json.dump({"epochs": epochs, "stats": dm.cache_stats()}, f)
        dist.barrier()


@pytest.fixture(scope="module")
def two_rank_results(shard_sets, tmp_path_factory):
    out = tmp_path_factory.mktemp("two_ranks")
    run_distributed(_rank_main, WORLD, (shard_sets, str(out)))
    return out


@pytest.mark.parametrize("nshards,worker_start,ram_cache", CONFIGS)
def test_two_ranks_two_workers_see_every_sample_once(two_rank_results, nshards, worker_start, ram_cache):
    res = [json.load(open(two_rank_results / f"{nshards}_{worker_start}_{ram_cache}_rank{r}.json"))
           for r in range(WORLD)]
    for e in range(EPOCHS):
        per_rank = [r["epochs"][e] for r in res]
        # same step count on both ranks, whatever the shard count: ceil(200 / 32) = 7
        assert [p["steps"] for p in per_rank] == [7, 7] and [p["len"] for p in per_rank] == [7, 7]
        all_ids = per_rank[0]["ids"] + per_rank[1]["ids"]
        assert sorted(all_ids) == list(range(N))  # N is even: nothing dropped, nothing repeated
        assert set(per_rank[0]["ids"]) == set(res[0]["epochs"][0]["ids"])  # a rank's partition is fixed
    for r in res:
        assert r["epochs"][0]["ids"] != r["epochs"][1]["ids"]  # reshuffled per epoch
        # epoch 1 came from the RAM level the workers filled on epoch 0 (spawn case: persistent workers)
        assert r["stats"]["ram_misses"] == r["stats"]["ram_hits"] == N // WORLD


SCRIPT = textwrap.dedent('''
    import json, os, sys, warnings
    warnings.simplefilter("ignore")  # (was PYTHONWARNINGS=ignore, which needs a fresh interpreter)
    import pytorch_lightning as pl
    import torch
    import lightning_topk  # registers topk_ddp
    from lightning_topk.data import WebDataModule

    strategy, out_dir, shards = sys.argv[1], sys.argv[2], sys.argv[3:]

    class Recording(WebDataModule):
        def on_after_batch_transfer(self, batch, idx):
            if self.trainer.training:
                self.seen.setdefault(self.trainer.current_epoch, []).extend(batch["ids"].tolist())
            return super().on_after_batch_transfer(batch, idx)

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(256, 10))
        def training_step(self, batch, i):
            x, y = batch
            assert x.dtype == torch.float32 and x.shape[1:] == (1, 16, 16)
            loss = torch.nn.functional.cross_entropy(self.net(x), y)
            self.log("loss", loss)
            return loss
        def validation_step(self, batch, i):
            x, y = batch
            self.log("val_loss", torch.nn.functional.cross_entropy(self.net(x), y), sync_dist=True)
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    dm = Recording(shards[:-1], val_shards=shards[-1:], keys=("png", "cls"), image_mode="L", batch_size=16,
                   num_workers=2, seed=1, ram_cache="decoded", gpu_cache=True, crop_padding=2, flip=True,
                   mean=[0.3], std=[0.3])
    dm.seen = {}
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=3, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Tiny(), datamodule=dm)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    with open(os.path.join(out_dir, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump({"seen": dm.seen, "metrics": metrics, "batches": trainer.num_training_batches,
                   "rank": dm.train_set.rank}, f)
''')


@pytest.mark.parametrize("strategy", ["ddp", "topk_ddp"])
def test_lightning_fit_under_ddp_strategies(shard_sets, tmp_path, strategy):
    from pytorch_lightning.strategies import StrategyRegistry

    import lightning_topk  # noqa: F401

    if strategy not in StrategyRegistry:
        pytest.skip(f"{strategy} is not registered")
    script = tmp_path / "fit.py"
    script.write_text(SCRIPT)
    # From the test zygote (torch and Lightning imported once; Lightning's popen child too): OMP_NUM_THREADS=1
    # (what Lightning's DDP sets on 2 cores anyway; threads do not change the sample ids and counts checked).
    exe, env = python_for(dict(os.environ, OMP_NUM_THREADS="1"))
    proc = subprocess.run([exe, str(script), strategy, str(tmp_path)] + shard_sets[7], env=env,
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    assert sorted(r["rank"] for r in res) == [0, 1]
    index = json.load(open(os.path.join(os.path.dirname(shard_sets[7][0]), "index.json")))["shards"]
    n_train = sum(index[os.path.basename(p)]["samples"] for p in shard_sets[7][:-1])  # last shard is validation
    assert n_train == 348
    for e in ("0", "1", "2"):
        ids = res[0]["seen"][e] + res[1]["seen"][e]
        assert sorted(ids) == sorted(set(ids)) and len(ids) == n_train  # each training sample once per epoch
    assert res[0]["batches"] == res[1]["batches"] == 11  # ceil(174 / 16)
    m = res[0]["metrics"]
    # epoch 0 filled the device level, epochs 1-2 were served from it (sums over both ranks)
    assert m["data/gpu_hits"] == 2 * 2 * (n_train // 2) and m["data/gpu_misses"] == 2 * (n_train // 2)
    assert m["data/ram_misses"] == 2 * (n_train // 2) and "val_loss" in m
