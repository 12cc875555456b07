"""The per-rank shard format and the restore rules, without processes (the strategy is a stand-in)."""
import os
import warnings

import torch
from torch import nn

from lightning_topk.comm.state import TopKConfig, TopKState
from lightning_topk.lightning import checkpoint as ck


class Stand:
    """What checkpoint.py reads from a strategy."""

    def __init__(self, rank, world, module, cfg=None, num_nodes=1):
        self.global_rank, self.world_size, self.num_nodes = rank, world, num_nodes
        self.num_processes = world // num_nodes
        self.is_global_zero = rank == 0
        self.lightning_module = module
        self.topk_config = cfg or TopKConfig(momentum_correction=True)
        self.topk_state = None


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))


def save_world(path, world, seed=0, step=7):
    """Each rank of a `world`-process job writes its shard; returns the main checkpoint dict and states."""
    torch.manual_seed(seed)
    m = model()
    checkpoint = {"epoch": 1, "global_step": step, "optimizer_states": [{}], "state_dict": {}}
    states = []
    for r in range(world):
        s = Stand(r, world, m)
        st = TopKState(s.topk_config)
        st.bind(m.named_parameters())
        buf = st.buffers(list(m.parameters()), torch.device("cpu"))
        buf.residual.copy_(torch.randn_like(buf.residual))
        buf.velocity.copy_(torch.randn_like(buf.velocity))
        st.step = step
        s.topk_state = st
        ck.save_rank_state(s, checkpoint, path)
        states.append(st)
    return checkpoint, states, m


def restore(path, checkpoint, rank, world, cfg=None, m=None):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = ck.restore_rank_state(Stand(rank, world, m or model(), cfg), path, checkpoint)
    return out, [str(x.message) for x in w if "lightning_topk" in str(x.message)]


def test_shards_are_atomic_weights_only_and_restore_exactly(tmp_path):
    path = tmp_path / "a.ckpt"
    checkpoint, states, _ = save_world(path, 2)
    assert sorted(os.listdir(ck.shard_dir(path))) == ["rank0.pt", "rank1.pt"]  # no temporary files left
    assert ck.shard_dir(path) == str(tmp_path / ".topk-shards" / "a.ckpt")
    meta = checkpoint["lightning_topk"]
    assert meta["world_size"] == 2 and meta["numels"] == {"0.weight": 12, "0.bias": 3, "1.weight": 6, "1.bias": 2}
    for r in range(2):
        out, notes = restore(path, checkpoint, r, 2)
        assert notes == [] and out["step"] == 7
        for name, t in states[r].residuals().items():
            assert torch.equal(out["residual"][name], t)
            assert torch.equal(out["velocity"][name], states[r].velocities()[name])


def test_pickled_objects_are_never_run(tmp_path):
    marker = tmp_path / "was_unpickled"

    class Evil:
        def __reduce__(self):
            return (os.mkdir, (str(marker),))

    path = tmp_path / "a.ckpt"
    checkpoint, _, _ = save_world(path, 1)
    torch.save({"format": ck.FORMAT, "version": 1, "evil": Evil()}, ck.shard_path(path, 0))
    out, notes = restore(path, checkpoint, 0, 1)
    assert not marker.exists()
    assert out["residual"] == {} and "rank 0: unreadable (UnpicklingError)" in notes[0]


def test_stale_corrupt_and_missing_shards_reset_only_those_ranks(tmp_path):
    path = tmp_path / "last.ckpt"
    old, _, _ = save_world(path, 3, step=5)
    os.replace(ck.shard_path(path, 1), tmp_path / "old_rank1.pt")
    checkpoint, states, _ = save_world(path, 3, seed=1, step=9)
    os.replace(tmp_path / "old_rank1.pt", ck.shard_path(path, 1))  # rank 1 died before overwriting
    with open(ck.shard_path(path, 2), "r+b") as f:
        f.truncate(100)
    out0, notes = restore(path, checkpoint, 0, 3)
    assert len(notes) == 1 and "rank 1: stale" in notes[0] and "rank 2: unreadable" in notes[0]
    assert torch.equal(out0["residual"]["0.weight"], states[0].residuals()["0.weight"])
    out1, _ = restore(path, checkpoint, 1, 3)
    assert out1["residual"] == {} and out1["step"] == 9
    os.remove(ck.shard_path(path, 1))
    _, notes = restore(path, checkpoint, 0, 3)
    assert "rank 1: missing" in notes[0]


def test_world_size_change_gives_every_rank_the_average(tmp_path):
    path = tmp_path / "a.ckpt"
    checkpoint, states, _ = save_world(path, 2)
    outs = [restore(path, checkpoint, r, 3) for r in range(3)]
    assert "world size changed from 2 to 3" in outs[0][1][0] and len(outs[0][1]) == 1
    for name in checkpoint["lightning_topk"]["numels"]:
        mean = (states[0].residuals()[name].double() + states[1].residuals()[name].double()) / 2
        for out, _ in outs:
            assert torch.equal(out["residual"][name], mean.float())
        # the pending update (1/W) * sum(residuals) is the same before and after
        before = (states[0].residuals()[name] + states[1].residuals()[name]) / 2
        after = sum(o["residual"][name] for o, _ in outs) / 3
        assert torch.allclose(before, after, atol=1e-6, rtol=0)
    os.remove(ck.shard_path(path, 1))
    out, notes = restore(path, checkpoint, 0, 1)
    assert out["residual"] == {} and "reset to zero" in notes[0] and "rank 1: missing" in notes[0]


def test_config_and_model_changes_drop_state_with_one_warning(tmp_path):
    path = tmp_path / "a.ckpt"
    checkpoint, _, _ = save_world(path, 1)
    out, notes = restore(path, checkpoint, 0, 1, cfg=TopKConfig(momentum_correction=False, recipe="none"))
    assert out["velocity"] == {} and out["residual"] and "momentum_correction is off" in notes[0]
    # recipe="auto" decides once the optimizer is known (after the load): the velocities wait for it
    out, notes = restore(path, checkpoint, 0, 1, cfg=TopKConfig(momentum_correction=False))
    assert out["velocity"] and out["residual"] and not notes
    out, notes = restore(path, checkpoint, 0, 1, cfg=TopKConfig(error_feedback=False))
    assert out["residual"] == {} and "error_feedback is off" in notes[0]
    bigger = nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 2))
    out, notes = restore(path, checkpoint, 0, 1, m=bigger)
    assert "0.weight" not in out["residual"] and "1.weight" in out["residual"]
    assert len(notes) == 1 and "'0.weight'" in notes[0]


def test_checkpoint_without_topk_state(tmp_path):
    out, notes = restore(tmp_path / "x.ckpt", {"global_step": 12, "state_dict": {}}, 0, 2)
    assert out == {"step": 12, "residual": {}, "velocity": {}, "exchanges": {}, "last_sparse": False}
    assert len(notes) == 1 and "no top-k state" in notes[0]


def test_saved_name_cannot_leave_the_directory(tmp_path):
    (tmp_path / "ckpts").mkdir()
    path = tmp_path / "ckpts" / "renamed.ckpt"
    checkpoint, _, _ = save_world(tmp_path / "elsewhere.ckpt", 1)
    checkpoint["lightning_topk"]["name"] = "../elsewhere.ckpt"
    assert ck.find_shard_dir(path, checkpoint["lightning_topk"]) is None
    out, notes = restore(path, checkpoint, 0, 1)
    assert out["residual"] == {} and "not found" in notes[0]
    checkpoint["lightning_topk"]["name"] = "elsewhere.ckpt"  # a sibling, by its saved name: allowed
    os.renames(ck.shard_dir(tmp_path / "elsewhere.ckpt"), ck.shard_dir(tmp_path / "ckpts" / "elsewhere.ckpt"))
    assert ck.find_shard_dir(path, checkpoint["lightning_topk"]) == ck.shard_dir(tmp_path / "ckpts" / "elsewhere.ckpt")


def test_symlinked_last_finds_the_target_shards(tmp_path):
    path = tmp_path / "epoch=1.ckpt"
    checkpoint, states, _ = save_world(path, 1)
    os.symlink(path.name, tmp_path / "last.ckpt")
    out, notes = restore(tmp_path / "last.ckpt", checkpoint, 0, 1)
    assert notes == [] and torch.equal(out["residual"]["1.bias"], states[0].residuals()["1.bias"])


def test_remove_and_weights_only(tmp_path):
    path = tmp_path / "a.ckpt"
    save_world(path, 2)
    m = model()
    ck.remove_rank_state(Stand(1, 2, m), path)
    assert os.listdir(ck.shard_dir(path)) == ["rank0.pt"]
    ck.remove_rank_state(Stand(0, 2, m), path)
    assert not os.path.exists(ck.shard_dir(path))
    s = Stand(0, 1, m)
    s.topk_state = TopKState(s.topk_config)
    weights_only = {"epoch": 0, "global_step": 1, "state_dict": {}}
    ck.save_rank_state(s, weights_only, path)
    assert "lightning_topk" not in weights_only and not os.path.exists(ck.shard_dir(path))


def test_remote_shards_through_fsspec_save_restore_stale_and_remove():
    import fsspec

    fs = fsspec.filesystem("memory")
    path = "memory://bucket/run/last.ckpt"
    try:
        checkpoint, states, m = save_world(path, 2)
        assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls("memory://bucket/run/.topk-shards/last.ckpt", detail=False)) \
            == ["rank0.pt", "rank1.pt"]
        for r in range(2):
            out, notes = restore(path, checkpoint, r, 2, m=m)
            assert notes == []
            for name, t in states[r].residuals().items():
                assert torch.equal(out["residual"][name], t)
        # A stale rank-1 shard (saved at another step) is detected on the remote copy too.
        newer, _, _ = save_world("memory://bucket/run/other.ckpt", 2, step=9)
        fs.copy(ck.shard_path("memory://bucket/run/other.ckpt", 1), ck.shard_path(path, 1))
        out, notes = restore(path, checkpoint, 1, 2, m=m)
        assert out["residual"] == {} and any("rank 1: stale" in n for n in notes)
        for r in (1, 0):  # rank 0 removes the directory after its own shard
            ck.remove_rank_state(Stand(r, 2, m), path)
        assert not fs.exists("memory://bucket/run/.topk-shards/last.ckpt")
    finally:
        fs.rm("memory://bucket", recursive=True)


class _Tiny(nn.Module):
    """The parameters of tests/scripts/make_v1_checkpoint.py's model."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 96), nn.ReLU(), nn.Linear(96, 4))


def test_a_v1_checkpoint_still_loads_into_per_exchange_sections():
    """tests/lightning/fixtures/v1: written by the v1 code (6cbf092) with the scale-free exchange, 2 ranks.
    Format 2 keeps one section per exchange; the v1 owner residuals land in the scatter section, bit for
    bit, and a TopKState built now hands them to its scatter exchange."""
    fixture = os.path.join(os.path.dirname(__file__), "fixtures", "v1")
    path = os.path.join(fixture, "v1.ckpt")
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    assert checkpoint["lightning_topk"]["version"] == 1
    cfg = TopKConfig(density=0.05, min_sparse_numel=0, exchange="scatter")
    for rank in range(2):
        want = torch.load(os.path.join(fixture, f"expected_rank{rank}.pt"))
        out, warns = restore(path, checkpoint, rank, 2, cfg, _Tiny())
        assert warns == [] and out["step"] == want["step"] == 3
        assert out["residual"].keys() == want["residual"].keys()
        assert all(torch.equal(out["residual"][k], want["residual"][k]) for k in want["residual"])
        owner = out["exchanges"]["scatter"]["owner_residual"]
        assert owner.keys() == want["owner_residual"].keys() and owner
        assert all(torch.equal(owner[k], want["owner_residual"][k]) for k in owner)
        st = TopKState(cfg)
        st.load_state_dict(out)
        loaded = st.exchange_for("scatter").owners.loaded
        assert all(torch.equal(loaded[k], want["owner_residual"][k]) for k in owner)
        # and saved again, it is a version-2 state with the section in place
        assert st.state_dict()["version"] == 2 and st.state_dict()["exchanges"]["scatter"]["owner_residual"].keys() == owner.keys()
    # one process now: the average of the ranks' residuals with their owner residuals folded in
    out, warns = restore(path, checkpoint, 0, 1, cfg, _Tiny())
    assert any("world size changed from 2 to 1" in w for w in warns) and out["exchanges"] == {}
    wants = [torch.load(os.path.join(fixture, f"expected_rank{r}.pt")) for r in range(2)]
    from lightning_topk.comm.exchanges.scatter import fold_owner_residual

    total = {k: sum(w["residual"][k] for w in wants) for k in wants[0]["residual"]}
    for w in wants:
        for key, t in w["owner_residual"].items():
            for name, v in fold_owner_residual(key, t).items():
                total[name] = total[name] + v
    assert all(torch.allclose(out["residual"][k], total[k] / 2, atol=1e-6) for k in total)


def _to_legacy_layout(path):
    """Move the shards of ``path`` to where versions before the .topk-shards folder wrote them."""
    os.rename(ck.shard_dir(path), f"{path}.topk")


def test_old_layout_is_still_read_and_removed(tmp_path):
    path = tmp_path / "hpc_ckpt_1.ckpt"
    checkpoint, states, m = save_world(path, 2)
    _to_legacy_layout(path)
    assert ck.find_shard_dir(path, checkpoint["lightning_topk"]) == f"{path}.topk"
    for r in range(2):
        out, notes = restore(path, checkpoint, r, 2, m=m)
        assert notes == []
        for name, t in states[r].residuals().items():
            assert torch.equal(out["residual"][name], t)
    os.symlink(path.name, tmp_path / "last.ckpt")  # a symlinked last.ckpt finds the old layout too
    out, notes = restore(tmp_path / "last.ckpt", checkpoint, 1, 2, m=m)
    assert notes == [] and torch.equal(out["residual"]["1.bias"], states[1].residuals()["1.bias"])
    for r in (1, 0):
        ck.remove_rank_state(Stand(r, 2, m), path)
    assert not os.path.exists(f"{path}.topk")


def test_new_layout_wins_over_old_and_is_invisible_to_lightnings_hpc_scan(tmp_path):
    from pytorch_lightning.trainer.connectors.checkpoint_connector import _CheckpointConnector

    path = tmp_path / "hpc_ckpt_1.ckpt"
    stale, _, _ = save_world(tmp_path / "hpc_ckpt_1.ckpt", 1, seed=1, step=3)
    _to_legacy_layout(path)
    checkpoint, states, m = save_world(path, 1, seed=2, step=5)
    out, notes = restore(path, checkpoint, 0, 1, m=m)
    assert notes == [] and torch.equal(out["residual"]["1.bias"], states[0].residuals()["1.bias"])
    os.remove(f"{path}.topk/rank0.pt")
    os.rmdir(f"{path}.topk")
    path.write_bytes(b"")  # the main file rank 0 writes after the shards
    # Lightning names the next requeue checkpoint after the highest hpc_ckpt_<N> entry of the folder;
    # the shards (one hidden folder) do not count: the next one is hpc_ckpt_2, not hpc_ckpt_3 or beyond.
    assert os.path.basename(_CheckpointConnector.hpc_save_path(str(tmp_path))) == "hpc_ckpt_2.ckpt"
    save_world(tmp_path / "hpc_ckpt_9.ckpt", 1)  # shards only (rank 0 died before the main file)
    assert os.path.basename(_CheckpointConnector.hpc_save_path(str(tmp_path))) == "hpc_ckpt_2.ckpt"
