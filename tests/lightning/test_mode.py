"""mode="auto" (issue 42) on real gloo processes: one decision on every rank, reproducible under deterministic
algorithms, explicit options win, and a Trainer run says what it chose."""
import logging

import pytest
import torch

from lightning_topk.comm.config import TopKConfig
from tests.helpers.dist import run_distributed

NUMEL = 11_326_410  # the namespace cluster's model


def _decide_with(rank, world, per_rank, cfg_kw, deterministic=False):
    from lightning_topk.lightning.mode import decide

    if deterministic:
        torch.use_deterministic_algorithms(True)
    calls = []

    def measure_fn(device):  # each rank measures something else (a slower host, a busier link)
        calls.append(rank)
        return per_rank[rank]

    c = decide(TopKConfig(**cfg_kw), world, 1, NUMEL, torch.device("cpu"), measure_fn=measure_fn, loopback=False)
    return c.mode, c.preset, c.inputs, bool(calls)


def test_one_decision_on_every_rank_when_their_measurements_differ():
    # rank 0 sees 0.05 Gbit/s and a slow pass, rank 1 5 Gbit/s, rank 2 0.5: the slowest link and pass decide
    per_rank = {0: (0.05, 1e-9), 1: (5.0, 0.4e-9), 2: (0.5, 0.6e-9)}
    out = run_distributed(_decide_with, 3, (per_rank, dict(auto_model="probe")))
    assert all(o[3] for o in out)  # every rank measured
    assert len({(o[0], o[1]) for o in out}) == 1 and len({tuple(sorted(o[2].items())) for o in out}) == 1
    assert out[0][2]["link_gbps"] == pytest.approx(0.05) and out[0][0] == "local"
    # the same figures everywhere, but the fast ones: per step on every rank
    fast = {r: (5.0, 0.5e-9) for r in range(3)}
    assert {o[:2] for o in run_distributed(_decide_with, 3, (fast, dict(auto_model="probe")))} == {("per_step", None)}


def test_reproducible_under_deterministic_algorithms():
    # auto_model="auto" under deterministic algorithms: the constants and auto_link_gbps, nothing timed, so two runs
    # (with ranks that would measure differently) choose alike
    per_rank = {0: (0.01, 1e-9), 1: (9.0, 1e-10)}
    runs = [run_distributed(_decide_with, 2, (per_rank, dict(auto_link_gbps=0.1), True)) for _ in range(2)]
    assert runs[0] == runs[1]
    assert {o[:2] for o in runs[0]} == {("local", "topk_local")} and not any(o[3] for o in runs[0])


def test_explicit_options_win_on_every_rank():
    per_rank = {0: (0.01, 1e-9), 1: (0.01, 1e-9)}
    out = run_distributed(_decide_with, 2, (per_rank, dict(auto_model="probe", density=0.05)))
    assert [o[:2] for o in out] == [("per_step", None)] * 2 and not any(o[3] for o in out)  # nothing measured
    out = run_distributed(_decide_with, 2, (per_rank, dict(auto_model="probe", local_steps=4)))
    assert [o[:2] for o in out] == [("local", None)] * 2


def _measured(rank, world):
    from lightning_topk.lightning.mode import decide

    c = decide(TopKConfig(auto_model="probe"), world, 1, NUMEL, torch.device("cpu"), loopback=False)
    return c.mode, c.preset, c.inputs


def test_real_measurement_agrees_on_every_rank():
    out = run_distributed(_measured, 2)
    assert out[0] == out[1]
    assert out[0][2]["link_gbps"] > 0 and out[0][2]["compute_ms"] > 0


def test_trainer_one_node_says_why_and_explicit_local_steps_win(tmp_path, caplog):
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_topk import TopKDDPStrategy
    from lightning_topk.app.summary import ThroughputMonitor, collect, exchange_mode, fit_stats

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(4, 2)

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = DataLoader(TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,))), batch_size=4)
    for kw, mode, why in ((dict(), "per_step", "one node"), (dict(local_steps=2), "local", "local_steps")):
        strategy = TopKDDPStrategy(process_group_backend="gloo", **kw)
        trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=2, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             callbacks=[ThroughputMonitor()], default_root_dir=str(tmp_path))
        with caplog.at_level(logging.INFO, logger="lightning_topk.lightning.strategy"):
            trainer.fit(Tiny(), data)
        assert trainer.strategy.topk_mode.mode == mode and why in trainer.strategy.topk_mode.reason
        assert f"mode={mode!r}" in caplog.text
        summary = collect(trainer, {}, fit_stats(trainer), str(tmp_path), "topk_ddp")
        assert why in summary["mode_choice"]
        assert "chosen by mode='auto'" not in (exchange_mode(fit_stats(trainer)) or "")


def test_summary_mode_row_says_it_was_chosen():
    from lightning_topk.app.summary import exchange_mode

    base = {"local_steps": 16.0, "outer_density": 0.1, "outer_value_bits": 4.0}
    chosen = {**base, "mode_auto": 1.0, "mode_link_gbps": 0.1, "mode_compute_ms": 118.3}
    assert exchange_mode(chosen) == (exchange_mode(base) + " (chosen by mode='auto' from 0.1 Gbit/s between nodes and "
                                     "118.3 ms compute per step; set mode, local_steps or a preset to override)")
    assert exchange_mode({**chosen, "local_steps": 0.0}).startswith("per-step exchange (chosen by mode='auto'")


def _host_address():
    """A non-loopback IPv4 address of this host (no packet is sent), or None."""
    import ipaddress
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))
            addr = s.getsockname()[0]
        except OSError:
            return None
    return None if ipaddress.ip_address(addr).is_loopback else addr


@pytest.mark.parametrize("link,options,opt,expected", [
    (0.01, [], "sgd", ("local", "topk_local")),  # chosen from the link: local SGD runs, the same on both nodes
    (0.01, ["density=0.05"], "sgd", ("per_step", None)),  # an explicit option wins
    (10.0, [], "sgd", ("per_step", None)),  # the constants' default rate
    # AdamW: local SGD's penalty 1 and the recipe's dense steps; the first choice, before the optimizer is known, is
    # per step there (test_the_first_choice_is_made_without_the_optimizer)
    (0.3, [], "adamw", ("local", "topk_local")),
])
def test_trainer_two_nodes_runs_what_it_chose(tmp_path, link, options, opt, expected):
    import json

    from tests.helpers.procs import run_nodes

    addr = _host_address()
    if addr is None:
        pytest.skip("no non-loopback address on this host (the rule keeps loopback runs per step)")
    args = ["tests/scripts/mode_train.py", "--out", tmp_path, "--link-gbps", link, "--opt", opt]
    for o in options:
        args += ["--option", o]
    run_nodes(args, env={"MASTER_ADDR": addr})
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0] == ranks[1], ranks  # one decision; local SGD's replicas identical after the outer round
    r = ranks[0]
    assert (r["mode"], r["preset"]) == expected and r["local_sgd"] == (expected[0] == "local")
    if expected[0] == "local":
        assert (r["local_steps"], r["outer_density"], r["outer_value_bits"]) == (16, 0.1, 4)
    if opt == "adamw":  # chosen again once the optimizer was known, over the run's 16 steps
        assert "AdamW's penalties" in r["reason"] and "over 16 steps (max_steps)" in r["reason"], r["reason"]


def test_the_first_choice_is_made_without_the_optimizer():
    from lightning_topk.lightning.mode import decide

    numel = 64 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10 + 10  # tests/scripts/mode_train.py's model
    cfg = TopKConfig(auto_link_gbps=0.3, auto_model="constants")
    assert decide(cfg, 2, 1, numel, torch.device("cpu"), loopback=False).mode == "per_step"


def test_resume_keeps_the_checkpoints_mode_when_the_link_now_chooses_another(tmp_path):
    # A preempted run resumes on other machines, or its link measures otherwise: mode="auto" would now choose per
    # step, but the checkpoint holds local SGD's outer state. The resumed run goes on in the checkpoint's mode and
    # ends where the run that was never stopped ends, bit for bit (rank by rank: mid-round the replicas differ).
    import json

    from tests.helpers.procs import run_nodes

    addr = _host_address()
    if addr is None:
        pytest.skip("no non-loopback address on this host (the rule keeps loopback runs per step)")

    def run(out, link, steps, *extra):  # 8 steps an epoch: the checkpoints are at epochs' ends
        run_nodes(["tests/scripts/mode_train.py", "--batch-size", 8, "--out", out, "--link-gbps", link,
                   "--max-steps", steps, *extra], env={"MASTER_ADDR": addr})
        return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]

    # 10 Mbit/s: local SGD (topk_local, 16 local steps); its checkpoint at step 8 is mid-round
    straight = run(tmp_path / "straight", 0.01, 24, "--ckpt-every", 8, "--ckpt-dir", tmp_path / "local")
    assert straight[0]["mode"] == "local"
    resumed = run(tmp_path / "resumed", 10.0, 24, "--resume", tmp_path / "local" / "epoch=0-step=8.ckpt")
    for r in range(2):  # 10 Gbit/s alone would choose per step
        assert (resumed[r]["mode"], resumed[r]["preset"], resumed[r]["local_sgd"]) == ("local", "topk_local", True)
        assert "checkpoint" in resumed[r]["reason"] and "per_step" in resumed[r]["reason"], resumed[r]["reason"]
        assert resumed[r]["weights"] == straight[r]["weights"], (r, resumed[r]["weights"], straight[r]["weights"])
    # and the other way: a per-step checkpoint resumed where the link would choose local SGD stays per step
    ps_straight = run(tmp_path / "ps_straight", 10.0, 16, "--ckpt-every", 8, "--ckpt-dir", tmp_path / "ps")
    ps = run(tmp_path / "ps_resumed", 0.01, 16, "--resume", tmp_path / "ps" / "epoch=0-step=8.ckpt")
    assert [(r["mode"], r["local_sgd"]) for r in ps] == [("per_step", False)] * 2
    assert [r["weights"] for r in ps] == [r["weights"] for r in ps_straight]
