"""Sparse local SGD (local_steps > 0, strategy topk_local) with a real Trainer, two simulated nodes of one
process each on gloo (tests/scripts/local_train.py): bit-exact resume inside an outer round (streaming on,
per-rank AdamW state), convergence on sklearn digits next to plain DDP, and bad options named."""
import os

import pytest
import torch

from lightning_topk import TopKConfig, TopKDDPStrategy
from tests.helpers.procs import run_nodes

SCRIPT = "tests/scripts/local_train.py"


def _run(tmp_path, tag, *args, world=2, nodes=2):
    run_nodes([SCRIPT, "--out", tmp_path, "--tag", tag, "--nodes", nodes, *args], num_nodes=nodes)
    return [torch.load(tmp_path / f"{tag}_rank{r}.pt") for r in range(world)]


def test_resume_inside_an_outer_round_is_bit_exact(tmp_path):
    # 6 steps per epoch, H=4: the checkpoint after epoch 1 is 2 steps into the second round, with a streamed
    # exchange in flight; each replica has its own weights and AdamW state there.
    common = ["--H", "4", "--density", "0.1", "--bits", "4", "--chunk", "512", "--outer-lr", "0.7",
              "--outer-momentum", "0.9", "--ef-decay", "0.95", "--streaming"]
    straight = _run(tmp_path, "straight", "--epochs", "3", *common)
    stop = _run(tmp_path, "stop", "--epochs", "1", "--save", str(tmp_path / "e1.ckpt"), *common)
    assert stop[0]["position"] == 2
    assert not torch.equal(stop[0]["flat"], stop[1]["flat"])  # inside a round the replicas differ
    resumed = _run(tmp_path, "resumed", "--epochs", "3", "--resume", str(tmp_path / "e1.ckpt"), *common)
    for r in range(2):
        assert resumed[r]["steps"] == straight[r]["steps"] == 18
        assert torch.equal(resumed[r]["flat"], straight[r]["flat"]), r
    assert straight[0]["rounds"] == 4 and straight[0]["metrics"]["topk/outer_bytes"] > 0


def test_four_nodes_take_the_scale_free_outer_exchange_and_resume_bit_exactly(tmp_path):
    # 4 nodes x 1: outer_exchange="auto" is the scale-free exchange. Saved 2 steps into the second round with the
    # owners' error feedback set; the resume equals the uninterrupted run bit for bit, and resuming the same
    # checkpoint under the all-gather folds the owners' buffers into the replicas' (a reshard) and trains on.
    common = ["--H", "4", "--density", "0.1", "--bits", "4", "--chunk", "512", "--outer-lr", "0.7",
              "--outer-momentum", "0.9", "--epochs", "4"]
    straight = _run(tmp_path, "straight", *common, world=4, nodes=4)
    ckpt = str(tmp_path / "e2.ckpt")
    stop = _run(tmp_path, "stop", *common[:-1], "2", "--save", ckpt, world=4, nodes=4)
    assert stop[0]["steps"] == 6 and stop[0]["position"] == 2  # 3 steps per epoch at 4 nodes; a round at step 4
    assert all(s["outer_exchange"] == "scatter" and float(s["owner_ef"].abs().sum()) > 0 for s in stop)
    resumed = _run(tmp_path, "resumed", *common, "--resume", ckpt, world=4, nodes=4)
    for r in range(4):
        assert resumed[r]["steps"] == straight[r]["steps"] == 12
        assert torch.equal(resumed[r]["flat"], straight[r]["flat"]), r
    switched = _run(tmp_path, "switched", *common, "--resume", ckpt, "--outer-exchange", "allgather", world=4, nodes=4)
    assert all(s["outer_exchange"] == "allgather" and s["steps"] == 12 for s in switched)
    assert all(torch.equal(s["flat"], switched[0]["flat"]) for s in switched)  # replicas agree after the last round
    # The same option string ("auto"), but 2-bit values: auto now takes the all-gather. Resharded too (it used to
    # be refused: the loader compared only the option strings).
    two_bit = [a if a != "4" or common[i - 1] != "--bits" else "2" for i, a in enumerate(common)]
    rebit = _run(tmp_path, "rebit", *two_bit, "--resume", ckpt, world=4, nodes=4)
    assert all(s["outer_exchange"] == "allgather" and s["steps"] == 12 for s in rebit)
    assert all(torch.equal(s["flat"], rebit[0]["flat"]) for s in rebit)


def test_digits_accuracy_close_to_ddp_at_the_same_samples(tmp_path):
    ddp = _run(tmp_path, "ddp", "--strategy", "ddp", "--epochs", "10")
    local = _run(tmp_path, "local", "--epochs", "10", "--H", "8", "--density", "0.1", "--bits", "4",
                 "--outer-lr", "0.7", "--outer-momentum", "0.9")
    assert local[0]["steps"] == ddp[0]["steps"] == 60
    # DDP's buckets hold the gradients (no copy per step); plain DDP keeps its default
    assert local[0]["grad_views"] is True and ddp[0]["grad_views"] is False
    # no buffer broadcast at every forward under local SGD (a collective across the nodes every inner step)
    assert local[0]["buffer_sync"] is False and ddp[0]["buffer_sync"] is True
    assert torch.equal(local[0]["flat"], local[1]["flat"]) or local[0]["position"] != 0
    # local - ddp over seeds 0-2, here and under ATEN_CPU_CAPABILITY=default: -2 of the 360 test samples each
    # time (issue 41); 0.04 = 14 samples
    assert local[0]["acc"] >= ddp[0]["acc"] - 0.04, (local[0]["acc"], ddp[0]["acc"])
    m = local[0]["metrics"]
    # 10% of the entries at 4 bits + int16 indices + one scale per 1024 entries, every 8 steps, one peer
    assert 0.099 < m["topk/outer_density"] < 0.102
    assert m["topk/outer_bytes_per_step"] == pytest.approx(m["topk/outer_bytes"] / 8)


@pytest.mark.parametrize("kw, name", [
    ({"local_steps": -1}, "local_steps"),
    ({"local_steps": 4, "outer_density": 0.0}, "outer_density"),
    ({"local_steps": 4, "outer_value_bits": 3}, "outer_value_bits"),
    ({"local_steps": 4, "outer_momentum": 1.0}, "outer_momentum"),
    ({"local_steps": 4, "outer_lr": 0}, "outer_lr"),
    ({"local_steps": 4, "outer_ef_decay": 1.5}, "outer_ef_decay"),
    ({"local_steps": 4, "outer_chunk": -1}, "outer_chunk"),
    ({"local_steps": 4, "outer_streaming": "yes"}, "outer_streaming"),
    ({"local_steps": 4, "exchange": "allgather"}, "exchange='allgather'"),
    ({"local_steps": 4, "momentum_correction": True}, "momentum_correction"),
    ({"local_steps": 4, "dense_steps": -1}, "dense_steps"),
    ({"local_steps": 4, "dense_steps": 2.5}, "dense_steps"),
    ({"exchange": "local"}, "local_steps > 0"),
])
def test_bad_local_options_are_named(kw, name):
    with pytest.raises(ValueError, match=name):
        TopKConfig(**kw)
    with pytest.raises(ValueError, match=name):
        TopKDDPStrategy(**kw)


def test_skipped_inner_step_is_the_nodes_own_and_the_rounds_stay_aligned(tmp_path):
    # rank 0's loss is inf at step 5 (inside the second round). Each node decides its inner steps alone (no
    # collective between the nodes): node 0 skips it, node 1 does not. The position counts attempts, so both
    # nodes enter every round at the same step: 12 attempts, H=4, 3 rounds, and after the last one the
    # replicas agree again (node 0's pseudo-gradient of the second round is one step short).
    out = _run(tmp_path, "skip", "--epochs", "2", "--H", "4", "--inject-step", "5", "--nonfinite", "skip")
    assert [out[r]["skips"] for r in range(2)] == [1, 0]
    for r in range(2):
        assert out[r]["bypass"] is True  # one process per node: DDP's reducer is off, the flags come from the grads
        assert out[r]["steps"] == 12
        assert (out[r]["rounds"], out[r]["position"]) == (3, 0), r
        assert bool(torch.isfinite(out[r]["flat"]).all())
        assert out[r]["inner_collectives"] == [], (r, out[r]["inner_collectives"])
        assert out[r]["outer_collectives"] > 0
    assert torch.equal(out[0]["flat"], out[1]["flat"])


def test_no_inter_node_collective_between_outer_rounds_two_by_two(tmp_path):
    # 2 nodes x 2 processes, rank 0's loss inf at step 2: the node's dense all-reduce spreads it to rank 1, so
    # node 0 (ranks 0, 1) skips that step, decided over the node's group; node 1 (ranks 2, 3) does not. Inside
    # the batches, only the outer rounds' collectives span the nodes (none from the controller or telemetry).
    out = _run(tmp_path, "skip22", "--epochs", "3", "--devices", "2", "--H", "3", "--inject-step", "2",
               "--nonfinite", "skip", world=4)
    assert [out[r]["skips"] for r in range(4)] == [1, 1, 0, 0]
    for r in range(4):
        assert out[r]["bypass"] is False  # the node's processes reduce through DDP's buckets
        assert out[r]["steps"] == 9
        assert (out[r]["rounds"], out[r]["position"]) == (3, 0), r
        assert out[r]["inner_collectives"] == [], (r, out[r]["inner_collectives"])
        assert out[r]["outer_collectives"] > 0
        assert torch.equal(out[r]["flat"], out[0]["flat"]), r


def test_fabric_equals_the_trainer(tmp_path):
    trainer = _run(tmp_path, "trainer", "--epochs", "2", "--H", "4")
    fabric = _run(tmp_path, "fabric", "--fabric", "--epochs", "2", "--H", "4")
    for r in range(2):
        assert fabric[r]["rounds"] == trainer[r]["rounds"] == 3
        assert torch.equal(fabric[r]["flat"], trainer[r]["flat"]), r
    assert fabric[0]["metrics"]["topk/outer_bytes"] == trainer[0]["metrics"]["topk/outer_bytes"] > 0


def test_fabric_applies_the_streamed_last_round_as_the_trainer(tmp_path):
    # streaming, 12 steps, H=4: the Trainer applies the last round at on_train_end, the Fabric loop by calling
    # fabric.strategy.on_train_end() after it: the same final weights
    common = ["--epochs", "2", "--H", "4", "--streaming"]
    trainer = _run(tmp_path, "trainer", *common)
    fabric = _run(tmp_path, "fabric", "--fabric", *common)
    for r in range(2):
        assert fabric[r]["rounds"] == trainer[r]["rounds"] == 3 and fabric[r]["position"] == 0
        assert torch.equal(fabric[r]["flat"], trainer[r]["flat"]), r
    assert torch.equal(trainer[0]["flat"], trainer[1]["flat"])
    n = trainer[0]["flat"].numel()
    assert torch.equal(trainer[0]["theta_outer"][:n], trainer[0]["flat"])  # the last round is in θ_outer ...
    before = torch.cat([t.reshape(-1) for t in trainer[0]["section"]["theta_outer"].values()])
    assert "pending" in trainer[0]["section"] and not torch.equal(before, trainer[0]["flat"])  # ... and moved it


def test_fabric_teardown_waits_for_a_streamed_round_in_flight(tmp_path):
    # streaming, 12 steps, H=4: the round of step 12 is in flight when the loop ends, and this loop does not
    # call on_train_end. teardown() waits for it on every rank and keeps its result (pending: applied at the next
    # round end, as after a checkpoint); every rank exits with code 0 (run_nodes checks).
    out = _run(tmp_path, "fab", "--fabric", "--no-train-end", "--epochs", "2", "--H", "4", "--streaming")
    for r in range(2):
        assert out[r]["rounds"] == 3 and out[r]["in_flight_at_end"] is True, r
        assert out[r]["after"] == {"in_flight": False, "process_groups": 1, "threads": []}, r
        assert out[r]["pending"] is True, r


def test_gradient_accumulation_counts_optimizer_steps(tmp_path):
    # 6 batches per epoch, 2 per optimizer step: 6 optimizer steps in 2 epochs, H=4: 1 round and 2 steps
    out = _run(tmp_path, "acc", "--epochs", "2", "--H", "4", "--accumulate", "2")
    for r in range(2):
        assert out[r]["steps"] == 6
        assert (out[r]["rounds"], out[r]["position"]) == (1, 2), r
    assert not torch.equal(out[0]["flat"], out[1]["flat"])  # inside the second round the replicas differ


@pytest.mark.parametrize("name", ["topk_local", "topk_local_wan"])
def test_topk_local_registered_everywhere_with_its_defaults(name):
    import pytorch_lightning as pl
    from lightning.fabric import Fabric
    from lightning.pytorch import Trainer as LTrainer

    import lightning_topk
    from lightning_topk.lightning.registry import PRESETS

    preset = PRESETS[name]
    lightning_topk.register_strategies()
    for make in (lambda: pl.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False).strategy,
                 lambda: LTrainer(strategy=name, accelerator="cpu", devices=2, logger=False).strategy,
                 lambda: Fabric(strategy=name, accelerator="cpu", devices=2).strategy):
        cfg = make().topk_config
        assert {k: getattr(cfg, k) for k in preset} == preset
    assert preset["local_steps"] > 0
    # the Hydra group mirrors them
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from tests.helpers.procs import ROOT

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        conf = OmegaConf.to_container(compose(config_name="config", overrides=[f"strategy={name}"]).strategy)
    assert {k: conf[k] for k in preset} == preset


def test_two_nodes_of_two_processes_one_replica_per_node_and_exact_resume(tmp_path):
    # 4 ranks, 3 steps per epoch, H=4: the node's two processes all-reduce every step and hold one replica
    # (the outer round is sharded over them); the checkpoint after epoch 1 is 3 steps into the first round.
    # With a BatchNorm1d: each process keeps its own running statistics between rounds (the node's processes
    # too: DDP's reducer does not touch buffers), averaged over all four at the round end.
    common = ["--bn", "--devices", "2", "--H", "4", "--density", "0.1", "--bits", "4", "--chunk", "512",
              "--outer-lr", "0.7", "--outer-momentum", "0.9", "--streaming"]
    straight = _run(tmp_path, "s", "--epochs", "3", *common, world=4)
    stop = _run(tmp_path, "p", "--epochs", "1", "--save", str(tmp_path / "e1.ckpt"), *common, world=4)
    resumed = _run(tmp_path, "r", "--epochs", "3", "--resume", str(tmp_path / "e1.ckpt"), *common, world=4)
    assert stop[0]["position"] == 3
    assert torch.equal(stop[0]["flat"], stop[1]["flat"]) and torch.equal(stop[2]["flat"], stop[3]["flat"])
    assert not torch.equal(stop[0]["flat"], stop[2]["flat"])
    mean = "net.1.running_mean"
    assert not torch.equal(stop[0]["buffers"][mean], stop[1]["buffers"][mean])  # per process, inside a node too
    rounds = [straight[r]["round_buffers"] for r in range(4)]
    for i in range(2):  # at each round end: the average over the four ranks, identical on every rank
        avg = sum(rounds[r][i][0] for r in range(4)) / 4
        for r in range(4):
            assert torch.equal(rounds[r][i][1], rounds[0][i][1]), (i, r)
            assert torch.allclose(rounds[r][i][1], avg, rtol=0, atol=1e-6), (i, r)
    for r in range(4):
        assert straight[r]["steps"] == 9 and straight[r]["rounds"] == 2
        assert torch.equal(resumed[r]["flat"], straight[r]["flat"]), r
        # after fit (teardown): nothing in flight, the intra-/inter-node groups destroyed (only Lightning's
        # world group is left), no heartbeat thread
        assert straight[r]["after"] == {"in_flight": False, "process_groups": 1, "threads": []}, r
        for name, b in straight[r]["buffers"].items():
            assert torch.equal(resumed[r]["buffers"][name], b), (r, name)


def test_cli_run_summary_names_the_mode(tmp_path):
    """The Hydra CLI with local_steps (2 processes on one node: one replica, intra-node all-reduce every step,
    the default SGD with momentum left to the inner optimizer by recipe='auto'); the summary names the mode."""
    import json

    from tests.app.test_cli import FAST, cli, ok

    run = tmp_path / "run"
    p = ok(cli(["trainer.max_epochs=2", f"hydra.run.dir={run}", "++strategy.local_steps=8", "++strategy.exchange=local",
                *FAST], tmp_path))
    s = json.loads((run / "summary.json").read_text())
    assert s["mode"].startswith("sparse local SGD: 8 local steps") and "mode" in p.stdout
    assert "auto_would" not in s.get("exchange", {}), "no per-bucket 'auto would' advice for local SGD"
    assert s["metrics"]["test/acc"] > 0.5


def test_world_size_change_reshards_the_outer_state(tmp_path):
    # Saved at 2 nodes x 1, 2 steps into the second round (H=4), with outer momentum and error feedback set.
    common = ["--H", "4", "--density", "0.1", "--bits", "4", "--chunk", "512", "--outer-lr", "0.7",
              "--outer-momentum", "0.9"]
    ckpt = str(tmp_path / "e1.ckpt")
    stop = _run(tmp_path, "stop", "--epochs", "1", "--save", ckpt, *common)
    assert stop[0]["position"] == 2 and float(stop[0]["momentum"].abs().sum()) > 0
    assert torch.equal(stop[0]["theta_outer"], stop[1]["theta_outer"])
    ef_avg = (stop[0]["ef"] + stop[1]["ef"]) / 2
    assert float(ef_avg.abs().sum()) > 0

    # 4 nodes x 1: θ_outer and momentum carried, each replica's EF the average, θ_local from replica r mod 2
    four = _run(tmp_path, "four", "--epochs", "3", "--resume", ckpt, *common, world=4, nodes=4)
    for r in range(4):
        st = four[r]["start"]
        assert st["position"] == 2 and st["rounds"] == 1 and st["steps"] == 6, r
        assert torch.equal(st["theta_outer"], stop[0]["theta_outer"]), r
        assert torch.equal(st["momentum"], stop[0]["momentum"]), r
        assert torch.allclose(st["ef"], ef_avg, rtol=0, atol=1e-7), r
        assert torch.equal(st["flat"], stop[r % 2]["flat"]), r
        # training went on: 1 epoch of 6 steps at world 2, 2 epochs of 3 at world 4; rounds at 4 and 8
        assert four[r]["steps"] == 12 and (four[r]["rounds"], four[r]["position"]) == (3, 0), r
        assert bool(torch.isfinite(four[r]["flat"]).all())
        assert torch.equal(four[r]["flat"], four[0]["flat"]), r

    # 1 node x 2 (same world size, another layout): the outer state is sharded over the node's two processes
    one = _run(tmp_path, "one", "--epochs", "2", "--resume", ckpt, "--devices", "2", *common, nodes=1)
    for r in range(2):
        st = one[r]["start"]
        lo, n = st["lo"], st["shard"]
        full = stop[0]["flat"].numel()  # the flat vectors are zero-padded to whole chunks (per layout)
        assert n < full and st["position"] == 2
        assert torch.equal(st["theta_outer"][:full], stop[0]["theta_outer"][:full]), r
        hi = min(lo + n, stop[0]["momentum"].numel())
        assert torch.equal(st["momentum"][:hi - lo], stop[0]["momentum"][lo:hi]), r
        assert torch.allclose(st["ef"][:hi - lo], ef_avg[lo:hi], rtol=0, atol=1e-7), r
        assert torch.equal(st["flat"], stop[0]["flat"]), r
        assert one[r]["steps"] == 12 and bool(torch.isfinite(one[r]["flat"]).all())

    # a saved rank's shard is missing: resharding cannot be done, and says so
    from lightning_topk.lightning.checkpoint import shard_path

    os.remove(shard_path(ckpt, 1))
    with pytest.raises(AssertionError, match=r"cannot reshard the outer state.*rank 1: missing"):
        _run(tmp_path, "bad", "--epochs", "3", "--resume", ckpt, *common, world=4, nodes=4)


def test_streamed_last_round_is_applied_at_the_end_of_training(tmp_path):
    # 12 steps, H=3, streaming: the round of step 12 is still in flight when fit ends. The strategy applies it
    # at on_train_end on every rank: the final weights are θ_outer after that round's outer step, identical on
    # both replicas; the state saved after fit is the one before it (a resume goes on as a run never stopped).
    from lightning_topk.comm.local import outer_sgd_

    common = ["--H", "3", "--density", "0.1", "--bits", "4", "--chunk", "512", "--outer-lr", "0.7",
              "--outer-momentum", "0.5", "--streaming"]
    out = _run(tmp_path, "end", "--epochs", "2", *common)
    for r in range(2):
        assert (out[r]["steps"], out[r]["rounds"], out[r]["position"]) == (12, 4, 0), r
    assert torch.equal(out[0]["flat"], out[1]["flat"])
    sec = out[0]["section"]
    assert "pending" in sec and float(torch.cat([t.reshape(-1) for t in sec["pending"].values()]).abs().sum()) > 0
    flat = lambda d: torch.cat([d[k].reshape(-1) for k in d])  # per-name dicts, in parameter order
    theta, mom, g = flat(sec["theta_outer"]), flat(sec["momentum"]), flat(sec["pending"])
    assert torch.equal(flat(sec["theta_local"]), theta)  # at a round end the replicas sit at θ_outer
    assert not torch.equal(out[0]["flat"], theta)  # the last round moved the final weights
    outer_sgd_(theta, mom, g, 0.7, 0.5, True)
    assert torch.equal(out[0]["flat"], theta)
    n = theta.numel()
    assert torch.equal(out[0]["theta_outer"][:n], theta)


def test_dense_steps_are_synchronous_then_local_and_resume_bit_exact(tmp_path):
    # Post-local SGD: the first 7 of 18 steps all-reduce the gradients over both nodes (as DDP), then local
    # SGD starts from the identical replicas (θ_outer re-anchored at step 7), H=4: rounds at steps 11 and 15.
    # Checkpoints at step 6 (inside the synchronous steps) and step 12 (one step into the second round).
    common = ["--H", "4", "--density", "0.1", "--bits", "4", "--chunk", "512", "--outer-lr", "0.7",
              "--outer-momentum", "0.9", "--dense-steps", "7"]
    ddp = _run(tmp_path, "ddp", "--strategy", "ddp", "--epochs", "1")
    straight = _run(tmp_path, "straight", "--epochs", "3", *common)
    e1 = _run(tmp_path, "e1", "--epochs", "1", "--save", str(tmp_path / "e1.ckpt"), *common)
    assert e1[0]["inner_collectives"], "the synchronous steps all-reduce over both nodes"
    assert torch.equal(e1[0]["flat"], e1[1]["flat"])  # the replicas are one
    assert torch.allclose(e1[0]["flat"], ddp[0]["flat"], rtol=0, atol=1e-5)  # ... and train as DDP
    assert (e1[0]["rounds"], e1[0]["section"]["steps"], e1[0]["position"]) == (0, 6, 0)
    e2 = _run(tmp_path, "e2", "--epochs", "2", "--resume", str(tmp_path / "e1.ckpt"),
              "--save", str(tmp_path / "e2.ckpt"), *common)
    assert (e2[0]["rounds"], e2[0]["section"]["steps"], e2[0]["position"]) == (1, 12, 1)
    assert not torch.equal(e2[0]["flat"], e2[1]["flat"])  # local steps: the replicas differ inside a round
    resumed = _run(tmp_path, "resumed", "--epochs", "3", "--resume", str(tmp_path / "e2.ckpt"), *common)
    for r in range(2):
        assert (straight[r]["steps"], straight[r]["rounds"], straight[r]["position"]) == (18, 2, 3), r
        assert torch.equal(resumed[r]["flat"], straight[r]["flat"]), r
    assert not torch.equal(straight[0]["flat"], straight[1]["flat"])


def test_dense_steps_two_nodes_of_two_processes_resume_at_the_boundary(tmp_path):
    # 2 nodes x 2 processes, 3 steps per epoch, dense_steps=3, H=3: the checkpoint after epoch 1 is exactly at the
    # end of the synchronous steps (θ_outer just re-anchored, the BatchNorm statistics averaged over the four
    # ranks); rounds at steps 6 and 9 (sharded over each node's two processes). Resumed = straight, bit for bit,
    # parameters and buffers, on all four ranks.
    common = ["--bn", "--devices", "2", "--H", "3", "--density", "0.1", "--bits", "4", "--chunk", "512", "--outer-lr", "0.7",
              "--outer-momentum", "0.9", "--dense-steps", "3"]
    straight = _run(tmp_path, "s", "--epochs", "3", *common, world=4)
    stop = _run(tmp_path, "p", "--epochs", "1", "--save", str(tmp_path / "e1.ckpt"), *common, world=4)
    resumed = _run(tmp_path, "r", "--epochs", "3", "--resume", str(tmp_path / "e1.ckpt"), *common, world=4)
    for r in range(4):
        assert (stop[r]["section"]["steps"], stop[r]["rounds"], stop[r]["position"]) == (3, 0, 0), r
        assert torch.equal(stop[r]["flat"], stop[0]["flat"]), r  # synchronous: one replica over both nodes
        assert torch.equal(stop[r]["theta_outer"], stop[0]["theta_outer"]), r
        for name, b in stop[0]["buffers"].items():  # averaged when local SGD started
            assert torch.equal(stop[r]["buffers"][name], b), (r, name)
        assert (straight[r]["steps"], straight[r]["rounds"], straight[r]["position"]) == (9, 2, 0), r
        assert torch.equal(resumed[r]["flat"], straight[r]["flat"]), r
        for name, b in straight[r]["buffers"].items():
            assert torch.equal(resumed[r]["buffers"][name], b), (r, name)
    n = stop[0]["flat"].numel()
    assert torch.equal(stop[0]["theta_outer"][:n], stop[0]["flat"])  # re-anchored at the weights


def test_run_summary_mode_names_the_synchronous_steps():
    from lightning_topk.app.summary import exchange_mode

    base = {"local_steps": 4.0, "outer_density": 1.0, "outer_value_bits": 4.0, "outer_streaming": 0.0}
    assert exchange_mode(base) == "sparse local SGD: 4 local steps per outer round, outer density 1, 4-bit values"
    assert exchange_mode({**base, "dense_steps": 160.0}).endswith(", first 160 steps synchronous")
    assert exchange_mode({**base, "outer_scatter": 1.0}).endswith("4-bit values, scale-free outer exchange")


def test_buffers_are_averaged_over_every_rank_at_each_outer_round(tmp_path):
    # A BatchNorm1d, 12 steps, H=4: rounds at steps 4, 8 and 12. Between rounds each process keeps its own
    # running statistics (no per-forward sync under local SGD); at each round end they are averaged over both
    # ranks, and the all-reduce's bytes are in topk/outer_bytes.
    from lightning_topk.comm.local import PacketLayout, chunk_k

    out = _run(tmp_path, "bn", "--epochs", "2", "--H", "4", "--bn", "--outer-lr", "0.7", "--outer-momentum", "0.9")
    r0, r1 = out[0]["round_buffers"], out[1]["round_buffers"]
    assert len(r0) == len(r1) == 3 and r0[0][0].numel() == 2 * 128  # running_mean, running_var
    for (b0, a0), (b1, a1) in zip(r0, r1):
        assert not torch.equal(b0, b1)  # each rank's statistics of its own batches
        assert torch.equal(a0, a1)
        assert torch.allclose(a0, (b0 + b1) / 2, rtol=0, atol=1e-6)
    assert out[0]["position"] == 0
    for name, b in out[0]["buffers"].items():
        assert torch.equal(b, out[1]["buffers"][name]), name
    assert int(out[0]["buffers"]["net.1.num_batches_tracked"]) == 12
    n = out[0]["flat"].numel()
    lay = PacketLayout(-(-n // 1024), 1024, chunk_k(1024, 0.05), 8)
    # one other replica's packet, plus the ring all-reduce of 256 fp32 buffers over 2 ranks
    assert out[0]["metrics"]["topk/outer_bytes"] == lay.nbytes + 2 * 1 * 4 * 256 // 2


def test_resume_inside_an_outer_round_with_batchnorm_is_bit_exact(tmp_path):
    # As test_resume_inside_an_outer_round_is_bit_exact, with a BatchNorm1d: the checkpoint after epoch 1 is at
    # step 6 (H + 2), where each rank has its own running statistics (Lightning's file holds rank 0's). Resumed =
    # straight, parameters and buffers, on both ranks.
    common = ["--bn", "--H", "4", "--density", "0.1", "--bits", "4", "--chunk", "512", "--outer-lr", "0.7",
              "--outer-momentum", "0.9", "--ef-decay", "0.95", "--streaming"]
    straight = _run(tmp_path, "straight", "--epochs", "3", *common)
    stop = _run(tmp_path, "stop", "--epochs", "1", "--save", str(tmp_path / "e1.ckpt"), *common)
    assert stop[0]["position"] == 2
    assert not torch.equal(stop[0]["buffers"]["net.1.running_mean"], stop[1]["buffers"]["net.1.running_mean"])
    resumed = _run(tmp_path, "resumed", "--epochs", "3", "--resume", str(tmp_path / "e1.ckpt"), *common)
    for r in range(2):
        assert resumed[r]["steps"] == straight[r]["steps"] == 18 and resumed[r]["position"] == 2
        assert torch.equal(resumed[r]["flat"], straight[r]["flat"]), r
        for name, b in straight[r]["buffers"].items():
            assert torch.equal(resumed[r]["buffers"][name], b), (r, name)
        assert torch.equal(resumed[r]["start"]["buffers"]["net.1.running_var"], stop[r]["buffers"]["net.1.running_var"])
    assert not torch.equal(straight[0]["buffers"]["net.1.running_var"], straight[1]["buffers"]["net.1.running_var"])


def test_world_size_change_gives_every_rank_the_average_of_the_saved_buffers(tmp_path):
    # Saved at 2 nodes x 1 inside a round (step 6, H=4) with a BatchNorm1d, resumed at 4 nodes x 1: every new rank
    # starts from the average of the two saved ranks' running statistics (what the round end would make of
    # them), num_batches_tracked and the round's buffer anchor carried; after the next round all four agree.
    common = ["--bn", "--H", "4", "--density", "0.1", "--bits", "4", "--chunk", "512", "--outer-lr", "0.7",
              "--outer-momentum", "0.9"]
    ckpt = str(tmp_path / "e1.ckpt")
    stop = _run(tmp_path, "stop", "--epochs", "1", "--save", ckpt, *common)
    assert stop[0]["position"] == 2
    anchor = torch.cat([stop[0]["section"]["buffer_anchor"][k] for k in ("net.1.running_mean", "net.1.running_var")])
    assert torch.equal(anchor, torch.cat([stop[1]["section"]["buffer_anchor"][k]
                                          for k in ("net.1.running_mean", "net.1.running_var")]))
    four = _run(tmp_path, "four", "--epochs", "3", "--resume", ckpt, *common, world=4, nodes=4)
    for r in range(4):
        st = four[r]["start"]
        for name in ("net.1.running_mean", "net.1.running_var"):
            avg = (stop[0]["buffers"][name] + stop[1]["buffers"][name]) / 2
            assert not torch.equal(stop[0]["buffers"][name], stop[1]["buffers"][name])
            assert torch.allclose(st["buffers"][name], avg, rtol=0, atol=1e-7), (r, name)
        assert int(st["buffers"]["net.1.num_batches_tracked"]) == 6
        assert torch.equal(st["buffer_anchor"], anchor), r  # the statistics of the round's start, carried
        assert (four[r]["steps"], four[r]["rounds"], four[r]["position"]) == (12, 3, 0), r
        for name, b in four[0]["buffers"].items():
            assert torch.equal(four[r]["buffers"][name], b), (r, name)


def test_missing_or_stale_shard_at_the_same_world_size_fails_fast_naming_the_rank(tmp_path):
    # 2 x 1 saved 2 steps into the second round; resumed at the same world size with rank 1's shard missing, then
    # stale (another save's). Every rank fails at load with one error naming the rank and its file. It used to
    # start rank 1's outer rounds afresh at position 0 while rank 0 went on at 2: misaligned rounds (a gloo
    # timeout that the heartbeat reported as "no rank was lost", or replicas drifting apart).
    from lightning_topk.lightning.checkpoint import shard_path

    common = ["--H", "4", "--density", "0.1", "--bits", "4", "--chunk", "512"]
    ckpt = str(tmp_path / "e1.ckpt")
    _run(tmp_path, "stop", "--epochs", "1", "--save", ckpt, *common)
    path = shard_path(ckpt, 1)
    stale = dict(torch.load(path, weights_only=True), save_key="epoch0-gs3-ex3")

    def resume(tag):
        run_nodes([SCRIPT, "--out", tmp_path, "--tag", tag, "--nodes", 2, "--epochs", "2", "--resume", ckpt, *common],
                  num_nodes=2, timeout=240)

    os.remove(path)
    with pytest.raises(AssertionError) as missing:
        resume("missing")
    torch.save(stale, path)
    with pytest.raises(AssertionError) as old:
        resume("stale")
    for err, why in ((missing, "missing"), (old, "stale")):
        text = str(err.value)
        assert text.count("cannot resume local SGD") >= 2, text[-3000:]  # on both nodes
        assert f"rank 1 ({path}: {why}" in text, text[-3000:]
