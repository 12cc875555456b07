"""WebDataModule, shard writer, caches and bad-data handling on shards of scikit-learn digits (PNG + cls)."""
import io
import os
import pickle
import tarfile
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from lightning_topk.data import (
    BadSampleError,
    BatchAugment,
    DiskCache,
    WebDataModule,
    array_samples,
    ensure_digits_shards,
    load_arrays,
    write_shards,
)
from lightning_topk.data.split import epoch_order, num_batches, rank_segments, segments_len, worker_segments
from lightning_topk.data.writer import main as shards_main

N = 400  # digits used by most tests: enough for several batches per worker, quick to encode


@pytest.fixture(scope="module")
def digits():
    images, labels = load_arrays("digits", image_size=16)
    return images[:N], labels[:N]


@pytest.fixture(scope="module")
def shards7(tmp_path_factory, digits):
    out = tmp_path_factory.mktemp("s7")
    return write_shards(array_samples(*digits), str(out), prefix="d", num_shards=7, total=N, progress=False)


@pytest.fixture(scope="module")
def shards1(tmp_path_factory, digits):
    out = tmp_path_factory.mktemp("s1")
    return write_shards(array_samples(*digits), str(out), prefix="d", num_shards=1, total=N, progress=False)


def make_dm(shards, **kw):
    args = dict(keys=("png", "cls"), image_mode="L", batch_size=32, num_workers=0, seed=3, shuffle_buffer=50)
    args.update(kw)
    dm = WebDataModule(shards, **args)
    dm.setup("fit")
    return dm


def run_epoch(dm, loader):
    """One pass: returns ids in order, {id: (image bytes, label)} and the number of batches."""
    ids, seen, steps = [], {}, 0
    for batch in loader:
        steps += 1
        x, y = dm.finalize_batch(batch, train=True)  # no crop/flip configured: deterministic
        for i, gid in enumerate(batch["ids"].tolist()):
            ids.append(gid)
            seen[gid] = (x[i].numpy().tobytes(), int(y[i]))
    return ids, seen, steps


# ---------------------------------------------------------------------------------------------- writer
def test_write_shards_counts_index_and_roundtrip(shards7, digits, tmp_path):
    import json

    assert len(shards7) == 7
    index = json.load(open(os.path.join(os.path.dirname(shards7[0]), "index.json")))
    counts = [index["shards"][os.path.basename(p)]["samples"] for p in shards7]
    assert sum(counts) == N and max(counts) - min(counts) <= 58
    with tarfile.open(shards7[0]) as tf:
        names = tf.getnames()
        png = tf.extractfile("00000000.png").read()
    assert sorted(names[:2]) == ["00000000.cls", "00000000.png"]
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(png))), digits[0][0])
    # by size: every shard but the last stays under the limit
    paths = write_shards(array_samples(*digits), str(tmp_path / "bysize"), max_bytes=20_000, progress=False)
    assert len(paths) > 3 and all(os.path.getsize(p) <= 20_000 + 10240 for p in paths[:-1])
    assert not [n for n in os.listdir(tmp_path / "bysize") if n.startswith(".tmp")]


def test_cli_packs_folder_and_npz(tmp_path, digits):
    root = tmp_path / "imgs"
    for i in range(30):
        d = root / f"class_{digits[1][i]}"
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray(digits[0][i]).save(d / f"{i}.png")
    assert shards_main([str(root), str(tmp_path / "out"), "--max-count", "8", "--no-progress"]) == 0
    out = sorted(p for p in os.listdir(tmp_path / "out") if p.endswith(".tar"))
    assert len(out) == 4
    dm = make_dm(str(tmp_path / "out" / "shard-{000000..000003}.tar"), shuffle=False)
    _, seen, _ = run_epoch(dm, dm.train_dataloader())
    assert len(seen) == 30
    classes = sorted({f"class_{c}" for c in digits[1][:30]})
    assert sorted({lab for _, lab in seen.values()}) == list(range(len(classes)))
    np.savez(tmp_path / "a.npz", x=digits[0][:50], y=digits[1][:50])
    assert shards_main([str(tmp_path / "a.npz"), str(tmp_path / "npz"), "--num-shards", "3", "--no-progress"]) == 0
    assert len([p for p in os.listdir(tmp_path / "npz") if p.endswith(".tar")]) == 3
    with pytest.raises(SystemExit):
        shards_main([str(tmp_path / "nope"), str(tmp_path / "x")])


def test_ensure_digits_shards_idempotent(tmp_path):
    a = ensure_digits_shards(str(tmp_path), "digits", num_shards=4, val_fraction=0.25)
    mtime = os.path.getmtime(a["train"][0])
    b = ensure_digits_shards(str(tmp_path), "digits", num_shards=4, val_fraction=0.25)
    assert a == b and len(a["train"]) == 4 and len(a["val"]) == 1 and os.path.getmtime(b["train"][0]) == mtime
    dm = make_dm(a["train"], val_shards=a["val"])
    dm.setup("validate")
    assert dm.train_set.num_local + dm.val_set.num_local == 1797
    with pytest.raises(ValueError, match="dataset"):
        ensure_digits_shards(str(tmp_path), "cifar")


# ---------------------------------------------------------------------------------------------- split
@pytest.mark.parametrize("counts", [[400], [57] * 7, [3, 100, 1, 50, 0, 77, 9]])
@pytest.mark.parametrize("world,workers,bs", [(2, 2, 32), (3, 4, 7), (4, 1, 16)])
def test_split_exactly_once_and_equal_steps(counts, world, workers, bs):
    total = sum(counts)
    for epoch in range(2):
        seen, steps = [], set()
        for rank in range(world):
            segs = rank_segments(counts, rank, world, seed=5)
            order = epoch_order(segs, epoch, 5, rank, shuffle=True)
            steps.add(num_batches(segments_len(segs), bs, False))
            got = 0
            for w in range(workers):
                for s, a, b, _ in worker_segments(order, bs, False, w, workers):
                    seen += [(s, i) for i in range(a, b)]
                    got += b - a
            assert got == total // world
        assert len(steps) == 1  # every rank runs the same number of batches
        assert len(seen) == len(set(seen)) and total - len(seen) == total % world < world


# ---------------------------------------------------------------------------------------------- loading
@pytest.mark.parametrize("workers", [0, 2])
def test_epochs_shuffle_differently_and_repeat_for_seed(shards7, workers):
    dm = make_dm(shards7, num_workers=workers)
    loader = dm.train_dataloader()
    e0, s0, n0 = run_epoch(dm, loader)
    e1, s1, n1 = run_epoch(dm, loader)
    assert sorted(e0) == sorted(e1) == list(range(N)) and n0 == n1 == len(loader) == 13
    assert e0 != e1 and s0 == s1
    again = make_dm(shards7, num_workers=workers).train_dataloader()
    assert run_epoch(dm, again)[0] == e0
    other = make_dm(shards7, num_workers=workers, seed=4).train_dataloader()
    assert run_epoch(dm, other)[0] != e0


@pytest.mark.parametrize("level", ["encoded", "decoded", "gpu"])
def test_cache_levels_return_what_streaming_returns(shards7, level):
    stream = make_dm(shards7, num_workers=2)
    _, want, _ = run_epoch(stream, stream.train_dataloader())
    kw = dict(ram_cache=level) if level != "gpu" else dict(gpu_cache=True)
    dm = make_dm(shards7, num_workers=2, **kw)
    loader = dm.train_dataloader()
    e0, first, n0 = run_epoch(dm, loader)
    stats0 = dm.cache_stats()
    e1, second, n1 = run_epoch(dm, loader)
    stats1 = dm.cache_stats()
    assert first == want and second == want and n0 == n1 and e0 != e1
    if level == "gpu":
        assert stats0["gpu_misses"] == N and stats1["gpu_hits"] == N and stats1["gpu_bytes"] == N * (16 * 16 + 8)
    else:
        assert stats0["ram_misses"] == N and stats0["ram_hits"] == 0
        assert stats1["ram_hits"] == N and stats1["ram_misses"] == N and stats1["ram_bytes"] > 0
    if level == "decoded":
        assert dm.train_set.ram_servable()


def test_ram_budget_smaller_than_data_streams_the_rest(shards7):
    per = 16 * 16 + 8
    dm = make_dm(shards7, num_workers=2, ram_cache="decoded", ram_cache_bytes=150 * per)
    loader = dm.train_dataloader()
    _, first, _ = run_epoch(dm, loader)
    _, second, _ = run_epoch(dm, loader)
    st = dm.cache_stats()
    assert first == second and len(second) == N
    assert st["ram_hits"] == 150 and st["ram_misses"] == 2 * N - 150 and st["ram_bytes"] == 150 * per
    assert not dm.train_set.ram_servable()
    enc = make_dm(shards7, num_workers=2, ram_cache="encoded", ram_cache_bytes=20_000)
    loader = enc.train_dataloader()
    _, a, _ = run_epoch(enc, loader)
    _, b, _ = run_epoch(enc, loader)
    st = enc.cache_stats()
    assert a == b == first and 0 < st["ram_hits"] < N and st["ram_bytes"] <= 20_000


def test_disk_cache_for_pipe_urls(shards7, tmp_path):
    urls = [f"pipe:cat {p}" for p in shards7]
    local = make_dm(shards7, shuffle=False)
    _, want, _ = run_epoch(local, local.train_dataloader())
    cache_dir = tmp_path / "cache"
    dm = make_dm(urls, shuffle=False, disk_cache_dir=str(cache_dir), num_workers=2)
    st0 = dm.cache_stats()  # setup fetched every shard to count it
    assert st0["disk_bytes"] == sum(os.path.getsize(p) for p in shards7)
    _, got, _ = run_epoch(dm, dm.train_dataloader())
    st = dm.cache_stats()
    assert got == want and st["disk_hits"] >= 7 and st["disk_misses"] == 0
    files = [n for n in os.listdir(cache_dir)]
    assert len(files) == 7 and not [n for n in files if n.startswith(".tmp")]
    # same basename from two places does not collide; the size limit evicts least recently used
    cache = DiskCache(str(tmp_path / "small"), max_bytes=os.path.getsize(shards7[0]) * 2 + 10)
    other = tmp_path / "other"
    other.mkdir()
    os.link(shards7[1], other / os.path.basename(shards7[0]))
    p1, kept1 = cache.fetch(f"pipe:cat {shards7[0]}")
    p2, kept2 = cache.fetch(f"pipe:cat {other / os.path.basename(shards7[0])}")
    assert kept1 and kept2 and p1 != p2 and open(p1, "rb").read() == open(shards7[0], "rb").read()
    cache.fetch(f"pipe:cat {shards7[2]}")
    assert not os.path.exists(p1) and os.path.exists(p2) and cache.held_bytes() <= cache.max_bytes
    with pytest.raises(ValueError, match="shard_sizes"):
        make_dm(urls)


def test_resampled_mode_fixed_length(shards7):
    dm = make_dm(shards7, samples_per_epoch=300, num_workers=2)
    loader = dm.train_dataloader()
    n = sum(len(b["ids"]) for b in loader)
    assert n == 300 and len(loader) == 10


# ---------------------------------------------------------------------------------------------- bad data
def _tar(path, samples):
    with tarfile.open(path, "w") as tf:
        for name, data in samples:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))


def _png(digits, i):
    buf = io.BytesIO()
    Image.fromarray(digits[0][i]).save(buf, format="PNG")
    return buf.getvalue()


def test_missing_shard_names_path(shards7, tmp_path):
    with pytest.raises(FileNotFoundError, match="nope-000001.tar"):
        make_dm(shards7 + [str(tmp_path / "nope-000001.tar")])
    with pytest.raises(FileNotFoundError, match="nope-000000.tar"):
        make_dm(str(tmp_path / "nope-{000000..000002}.tar"))


def test_truncated_shard(shards7, tmp_path):
    bad = tmp_path / "trunc.tar"
    data = open(shards7[0], "rb").read()
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(RuntimeError, match="trunc.tar"):
        make_dm([str(bad)] + shards7[1:])
    with pytest.warns(RuntimeWarning, match="trunc.tar"):
        dm = make_dm([str(bad)] + shards7[1:], on_bad_sample="skip")
    _, seen, steps = run_epoch(dm, dm.train_dataloader())
    assert steps == len(dm.train_dataloader()) and len(seen) > 0


@pytest.mark.parametrize("what", ["missing_key", "bad_image", "truncated_member"])
def test_bad_samples_raise_or_skip(digits, tmp_path, what):
    samples = []
    for i in range(40):
        png, cls = _png(digits, i), str(int(digits[1][i])).encode()
        if i == 17 and what == "missing_key":
            samples.append((f"{i:04d}.png", png))
            continue
        if i == 17 and what == "bad_image":
            png = b"not a png at all"
        samples += [(f"{i:04d}.png", png), (f"{i:04d}.cls", cls)]
    path = tmp_path / "bad.tar"
    _tar(path, samples)
    sizes = [40]
    if what == "truncated_member":  # cut inside member 17's data, so the header scan is skipped via shard_sizes
        blob = path.read_bytes()
        with tarfile.open(path) as tf:
            m = [x for x in tf.getmembers() if x.name == "0017.png"][0]
        path.write_bytes(blob[: m.offset_data + 10])
    dm = make_dm([str(path)], batch_size=8, shard_sizes=sizes, shuffle=False)
    with pytest.raises(BadSampleError) as err:
        run_epoch(dm, dm.train_dataloader())
    assert "bad.tar" in str(err.value) and ("0017" in str(err.value))
    dm = make_dm([str(path)], batch_size=8, shard_sizes=sizes, shuffle=False, on_bad_sample="skip", num_workers=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ids, seen, steps = run_epoch(dm, dm.train_dataloader())
    bad = 1 if what != "truncated_member" else 40 - 17
    assert steps == 5 and len(ids) == 40 and len(seen) == 40 - bad and 17 not in seen
    assert dm.cache_stats()["bad_skipped"] == bad


def test_wrong_keys_fail_at_setup(shards7):
    with pytest.raises(BadSampleError, match="jpg"):
        make_dm(shards7, keys=("jpg", "cls"))


# ---------------------------------------------------------------------------------------------- options
def test_bad_options_are_named(shards7):
    for kw, msg in [(dict(ram_cache="ssd"), "ram_cache"), (dict(on_bad_sample="ignore"), "on_bad_sample"),
                    (dict(batch_size=0), "batch_size"), (dict(worker_start="thread"), "worker_start"),
                    (dict(transform="no.such.module:fn"), "transform"),
                    (dict(transform=lambda s: s, num_workers=2), "pickled"),
                    (dict(transform="lightning_topk.data.transforms:ToFloat", ram_cache="decoded"), "transform"),
                    (dict(samples_per_epoch=10, gpu_cache=True), "samples_per_epoch")]:
        with pytest.raises(ValueError, match=msg):
            make_dm(shards7, **kw)


def test_transform_from_import_path_and_target(shards7):
    dm = make_dm(shards7, transform={"_target_": "lightning_topk.data.ToFloat", "mean": [0.5], "std": [0.25]},
                 num_workers=2, shuffle=False)
    batch = next(iter(dm.train_dataloader()))
    x, y = dm.finalize_batch(batch)
    ref = make_dm(shards7, shuffle=False, mean=[0.5], std=[0.25])
    rx, ry = ref.finalize_batch(next(iter(ref.train_dataloader())), train=False)
    assert x.dtype == torch.float32 and torch.allclose(x, rx) and torch.equal(y, ry)
    assert pickle.loads(pickle.dumps(dm.transform)) is not None


def test_batch_augment_crop_flip_normalise():
    x = torch.arange(2 * 3 * 4 * 4, dtype=torch.uint8).view(2, 3, 4, 4)
    aug = BatchAugment(crop_padding=1, flip=True, mean=[0.5] * 3, std=[0.5] * 3, seed=1)
    a = aug(x)
    b = BatchAugment(crop_padding=1, flip=True, mean=[0.5] * 3, std=[0.5] * 3, seed=1)(x)
    assert a.shape == (2, 3, 4, 4) and a.dtype == torch.float32 and torch.equal(a, b)
    assert torch.allclose(aug(x, train=False), (x.float() / 255 - 0.5) / 0.5)
    # every crop is a shifted window of the zero-padded image: values are either 0-padding or in the image
    raw = BatchAugment(crop_padding=2, seed=0)(x) * 255
    assert set(raw.round().unique().tolist()) <= set(range(96))
    flips = [BatchAugment(flip=True, seed=s)(x) for s in range(8)]
    assert any(torch.equal(f[0], x[0].flip(-1).float() / 255) for f in flips)


def test_worker_start_auto_avoids_fork_where_cpython_can_deadlock(shards1):
    """gh-112275: CPython < 3.11.10 (and older lines before their fixes) can deadlock in a child forked while
    another thread runs; training always runs threads, so the default starts workers with forkserver there."""
    from lightning_topk.data.datamodule import fork_can_deadlock, resolve_worker_start

    assert fork_can_deadlock((3, 11, 7), "cpython") and fork_can_deadlock((3, 10, 14), "cpython")
    assert not fork_can_deadlock((3, 11, 10), "cpython") and not fork_can_deadlock((3, 12, 0), "cpython")
    assert not fork_can_deadlock((3, 10, 15), "cpython") and not fork_can_deadlock((3, 11, 7), "pypy")
    assert resolve_worker_start("spawn") == "spawn" and resolve_worker_start(None) is None
    dm = make_dm(shards1, num_workers=1, rank=0, world_size=1)
    assert dm.worker_start == "auto"
    loader = dm.train_dataloader()
    ctx = loader.multiprocessing_context
    want = "forkserver" if fork_can_deadlock() else None
    assert (ctx.get_start_method() if ctx is not None else None) == want
    ids, _, _ = run_epoch(dm, loader)  # the workers start and deliver the same epoch as the main process
    ref = make_dm(shards1, num_workers=0, rank=0, world_size=1)
    assert ids == run_epoch(ref, ref.train_dataloader())[0]


def test_worker_start_auto_keeps_fork_for_an_unguarded_main_script(tmp_path):
    """Forkserver (and spawn) workers import the main script: an unguarded training script would run again
    in every worker (it hung: the popen-launched Trainer script of test_data_ddp). "auto" keeps fork there."""
    from lightning_topk.data.datamodule import main_is_guarded

    guarded, bare = tmp_path / "guarded.py", tmp_path / "bare.py"
    guarded.write_text("import torch\n\ndef main():\n    pass\n\n\nif __name__ == '__main__':\n    main()\n")
    bare.write_text("import torch\ntrainer = None  # trainer.fit(...) at the top level\n")
    assert main_is_guarded(str(guarded)) and not main_is_guarded(str(bare))
    assert not main_is_guarded(str(tmp_path / "missing.py"))
    assert main_is_guarded()  # pytest's own __main__ is guarded
