"""WebLoader state round trip without a Trainer: the batches before a checkpoint plus the batches after a
resume (a new DataModule: empty caches, new workers) equal the uninterrupted sequence, tensor for tensor."""
import io
import tarfile
import warnings

import pytest
import torch
from PIL import Image

from lightning_topk.data import WebDataModule, array_samples, load_arrays, write_shards
from lightning_topk.data.split import resume_split, worker_batch_range

N, BATCH = 400, 32  # 13 batches per epoch


@pytest.fixture(scope="module")
def digits():
    images, labels = load_arrays("digits", image_size=16)
    return images[:N], labels[:N]


@pytest.fixture(scope="module")
def shards(tmp_path_factory, digits):
    out = tmp_path_factory.mktemp("resume7")
    return write_shards(array_samples(*digits), str(out), prefix="d", num_shards=7, total=N, progress=False)


def make_dm(shards, **kw):
    args = dict(keys=("png", "cls"), image_mode="L", batch_size=BATCH, num_workers=2, seed=3, shuffle_buffer=50,
                crop_padding=2, flip=True, mean=[0.3], std=[0.3])
    args.update(kw)
    dm = WebDataModule(shards, **args)
    dm.setup("fit")
    return dm


def final(dm, batch):
    """What a training step sees: ids plus the augmented tensors."""
    x, y = dm.finalize_batch(batch, train=True)
    return batch["ids"].tolist(), x, y


def run(dm, loader, epochs, stop=None):
    """Batches of ``epochs`` passes, or up to ``stop`` batches (then the loader's state)."""
    out = []
    for _ in range(epochs):
        for batch in loader:
            out.append(final(dm, batch))
            if len(out) == stop:
                return out, loader.state_dict()
    return out, None


def assert_same(got, want):
    assert len(got) == len(want)
    for i, ((gi, gx, gy), (wi, wx, wy)) in enumerate(zip(got, want)):
        assert gi == wi and torch.equal(gx, wx) and torch.equal(gy, wy), f"batch {i}"


def check_resume(shards, stops, epochs=2, resume_kw=None, **kw):
    """Stop after each of ``stops`` batches, resume in a new DataModule (options ``kw`` updated by
    ``resume_kw``) and compare with the uninterrupted run; returns the last resumed DataModule."""
    dm = make_dm(shards, **kw)
    want, _ = run(dm, dm.train_dataloader(), epochs)
    steps = len(dm.train_dataloader())
    for stop in stops:
        dm = make_dm(shards, **kw)
        before, state = run(dm, dm.train_dataloader(), epochs, stop=stop)
        assert state["epoch"] == (stop - 1) // steps and state["consumed"] == stop - steps * state["epoch"]
        del dm
        dm = make_dm(shards, **{**kw, **(resume_kw or {})})  # a new job: empty caches, new workers
        loader = dm.train_dataloader()
        loader.load_state_dict(state)
        after, _ = run(dm, loader, epochs - state["epoch"] - (state["consumed"] == steps))
        assert_same(before + after, want)
    return dm


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_streaming(shards, workers):
    check_resume(shards, [1, 6, 13, 20], num_workers=workers)


@pytest.mark.parametrize("level", ["disk", "encoded", "decoded", "gpu", "decoded+gpu"])
def test_resume_every_cache_level(shards, tmp_path, level):
    kw = {"disk": dict(disk_cache_dir=str(tmp_path / "disk")), "encoded": dict(ram_cache="encoded"),
          "decoded": dict(ram_cache="decoded"), "gpu": dict(gpu_cache=True),
          "decoded+gpu": dict(ram_cache="decoded", gpu_cache=True)}[level]
    urls = [f"pipe:cat {p}" for p in shards] if level == "disk" else shards
    # epoch 0 streams and fills; epoch 1 is served by the decoded RAM / device level where there is one,
    # so the job resumed at batch 20 (batch 7 of epoch 1) first decodes the partition, then serves from it
    stats = check_resume(urls, [6, 13, 20], **kw).cache_stats()
    rest = N - 7 * BATCH
    assert stats["gpu_hits"] == (rest if "gpu" in level else 0)
    assert stats["ram_hits"] == (rest if level == "decoded" else 0)
    if "decoded" in level:
        assert stats["ram_misses"] == N


def test_resume_no_workers_cache_served_epoch(shards):
    check_resume(shards, [17], num_workers=0, ram_cache="decoded", gpu_cache=True)


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_resampled(shards, workers):
    check_resume(shards, [3, 12], num_workers=workers, samples_per_epoch=2 * N // 3)


def test_resume_on_a_spawned_persistent_worker(shards):
    # the order does not depend on the start method: only the resumed job uses spawn (a spawned worker
    # imports lightning_topk, seconds on this machine); its persistent worker runs both epochs
    check_resume(shards, [6], num_workers=1, resume_kw=dict(worker_start="spawn", persistent_workers=True))


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
def test_resume_uneven_workers_and_drop_last(shards):
    # 400 // 24 = 16 batches over 3 workers (5, 5, 6): every stop leaves the workers at different places
    check_resume(shards, [1, 2, 5, 10, 14, 16], epochs=1, num_workers=3, batch_size=24, drop_last=True)


@pytest.mark.parametrize("n_batches,workers", [(13, 2), (16, 3), (7, 4), (3, 4)])
def test_resume_split_follows_the_dataloader_order(n_batches, workers):
    counts = [b - a for a, b in (worker_batch_range(n_batches, w, workers) for w in range(workers))]
    order = []
    for r in range(max(counts)):  # a DataLoader takes one batch from each worker in turn
        order += [w for w in range(workers) if counts[w] > r]
    for start in range(n_batches + 1):
        got, first = resume_split(n_batches, workers, start)
        assert got == [order[:start].count(w) for w in range(workers)]
        rest = [w for r in range(max(counts)) for w in [(first + p) % workers for p in range(workers)]
                if counts[w] - got[w] > r]
        assert rest == order[start:]


def _tar(path, samples):
    with tarfile.open(path, "w") as tf:
        for name, data in samples:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_right_before_a_bad_sample(digits, tmp_path, workers):
    """on_bad_sample='skip' repeats the previous good sample; after a resume that is one the new job never
    yielded."""
    samples = []
    for i in range(64):
        buf = io.BytesIO()
        Image.fromarray(digits[0][i]).save(buf, format="PNG")
        png = b"broken" if i in (16, 17, 40) else buf.getvalue()
        samples += [(f"{i:04d}.png", png), (f"{i:04d}.cls", str(int(digits[1][i])).encode())]
    _tar(tmp_path / "bad.tar", samples)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_resume([str(tmp_path / "bad.tar")], range(1, 8), epochs=1, batch_size=8, num_workers=workers,
                     shuffle=False, on_bad_sample="skip", crop_padding=0, flip=False)


def test_changed_options_are_refused_or_replayed(shards):
    dm = make_dm(shards)
    _, state = run(dm, dm.train_dataloader(), 1, stop=5)
    for data, kw, name in [(shards, dict(batch_size=16), "batch_size"), (shards, dict(seed=4), "seed"),
                           (shards, dict(rank=0, world_size=2), "world_size"), (shards[:6], {}, "train_shards"),
                           (shards, dict(num_workers=1), "num_workers")]:
        loader = make_dm(data, **kw).train_dataloader()
        loader.load_state_dict(state)
        with pytest.raises(ValueError, match=name):
            next(iter(loader))
    # a cache level that changes which path serves the epoch is refused too (epoch 1 from the RAM level)
    dm = make_dm(shards, ram_cache="decoded")
    _, state1 = run(dm, dm.train_dataloader(), 2, stop=17)
    loader = make_dm(shards).train_dataloader()
    loader.load_state_dict(state1)
    with pytest.raises(ValueError, match="ram_cache"):
        next(iter(loader))
    # mid_epoch_resume='restart_epoch': a warning, and the epoch replays from its start
    dm = make_dm(shards, batch_size=16, mid_epoch_resume="restart_epoch")
    loader = dm.train_dataloader()
    loader.load_state_dict(state)
    with pytest.warns(UserWarning, match="batch_size.*restart"):
        got, _ = run(dm, loader, 1)
    ref = make_dm(shards, batch_size=16)
    assert_same(got, run(ref, ref.train_dataloader(), 1)[0])
    with pytest.raises(ValueError, match="mid_epoch_resume"):
        make_dm(shards, mid_epoch_resume="never")
    with pytest.raises(ValueError, match="not a WebLoader state"):
        make_dm(shards).train_dataloader().load_state_dict({"handed_out": 3})


def test_the_trainers_batch_index_wins(shards):
    """A checkpoint written inside a step (a signal) counts that step's batch; Lightning repeats the step, and
    the loader follows the trainer's position (here standing in for a Trainer)."""
    dm = make_dm(shards)
    want, _ = run(dm, dm.train_dataloader(), 1)
    dm = make_dm(shards)
    _, state = run(dm, dm.train_dataloader(), 1, stop=6)
    dm = make_dm(shards)
    loader = dm.train_dataloader()
    loader.load_state_dict(state)
    loader.position_fn = lambda: (0, 5)
    with pytest.warns(UserWarning, match="following the trainer"):
        got, _ = run(dm, loader, 1)
    assert_same(got, want[5:])
