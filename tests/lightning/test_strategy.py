"""TopKDDPStrategy: registration, options, and real 2-process Trainer runs on sklearn digits."""
import json

import pytest
import pytorch_lightning as pl
import torch

import lightning_topk
from lightning_topk import TopKDDPStrategy
from tests.helpers.procs import run_nodes, run_script

PROBE = "tests/scripts/train_probe.py"


def test_registered_in_both_registries_idempotently():
    from pytorch_lightning.strategies import StrategyRegistry

    lightning_topk.register_strategies()  # a second registration (spawned child) is a no-op
    for name, method in (("topk_ddp", "popen"), ("topk_ddp_spawn", "spawn")):
        assert StrategyRegistry[name]["strategy"] is TopKDDPStrategy
        assert StrategyRegistry[name]["init_params"]["start_method"] == method
    t = pl.Trainer(strategy="topk_ddp", accelerator="cpu", devices=2, logger=False)
    assert isinstance(t.strategy, TopKDDPStrategy)
    from lightning.pytorch import Trainer as LTrainer
    from lightning.pytorch.strategies import DDPStrategy as LDDP

    lt = LTrainer(strategy="topk_ddp_spawn", accelerator="cpu", devices=2, logger=False)
    assert isinstance(lt.strategy, LDDP) and type(lt.strategy) is lightning_topk.UnifiedTopKDDPStrategy


def test_registered_in_fabric_registries_idempotently():
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy
    from lightning_fabric.strategies import STRATEGY_REGISTRY as STANDALONE

    from lightning_topk.lightning.fabric import fabric_strategy_class

    lightning_topk.register_strategies()
    for registry, package in ((STRATEGY_REGISTRY, "lightning.fabric"), (STANDALONE, "lightning_fabric")):
        for name, method in (("topk_ddp", "popen"), ("topk_ddp_spawn", "spawn")):
            assert registry[name]["strategy"] is fabric_strategy_class(package)
            assert registry[name]["init_params"]["start_method"] == method
    f = Fabric(strategy="topk_ddp", accelerator="cpu", devices=2)
    assert isinstance(f.strategy, DDPStrategy) and f.strategy.topk_config.density == 0.01
    with pytest.raises(ValueError, match="package must be one of"):
        fabric_strategy_class("lightning.pytorch")


def test_forkserver_start_method_warns_that_ranks_miss_the_parents_state(caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="lightning_topk"):
        pl.Trainer(strategy=TopKDDPStrategy(start_method="forkserver"), accelerator="cpu", devices=2, logger=False)
    assert "start_method='forkserver'" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lightning_topk"):
        pl.Trainer(strategy=TopKDDPStrategy(start_method="spawn"), accelerator="cpu", devices=2, logger=False)
    assert "forkserver" not in caplog.text


def test_ddp_kwargs_pass_through():
    s = TopKDDPStrategy(density=0.001, selector="mstopk", bucket_cap_mb=5, static_graph=True,
                        gradient_as_bucket_view=True, find_unused_parameters=True)
    assert s._ddp_kwargs == dict(bucket_cap_mb=5, static_graph=True, gradient_as_bucket_view=True,
                                 find_unused_parameters=True)
    assert s.topk_config.density == 0.001 and s.topk_config.selector == "mstopk"


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(density=0.0), "density"),
        (dict(density=1.5), "density"),
        (dict(density="a"), "density"),
        (dict(selector="sort"), "selector"),
        (dict(value_dtype="int8"), "value_dtype"),
        (dict(exchange="ring"), "exchange"),
        (dict(exchange="scatter", hierarchical=True), "contradicts"),
        (dict(exchange="hierarchical_scatter", selection_scope="parameter"), "exchange='hierarchical_scatter'"),
        (dict(hierarchical="yes"), "hierarchical"),
        (dict(nonfinite="ignore"), "nonfinite"),
        (dict(min_sparse_numel=-1), "min_sparse_numel"),
        (dict(warmup_steps=-3), "warmup_steps"),
        (dict(momentum=1.0), "momentum"),
        (dict(error_feedback=False, momentum_correction=True), "momentum_correction"),
        (dict(ddp_comm_hook=lambda s, b: None), "ddp_comm_hook"),
    ],
)
def test_bad_options_name_the_option(kw, match):
    with pytest.raises(ValueError, match=match):
        TopKDDPStrategy(**kw)


def test_hierarchical_true_needs_several_processes_per_node():
    s = TopKDDPStrategy(hierarchical=True)
    s._num_nodes = 2
    s.parallel_devices = [torch.device("cpu")]
    with pytest.raises(ValueError, match="more than one process per node"):
        s._use_hierarchical()


@pytest.fixture(scope="module")
def digits_runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("digits")
    runs = {
        # also dumps its parameters after epoch 2: what a 2-epoch ddp run ends with (test_density_one_...)
        "ddp": ["--strategy", "ddp", "--epochs", "6", "--dump-epoch", "2"],
        "topk": ["--strategy", "topk_ddp", "--epochs", "6"],  # by registered name, density 0.01, flat all-gather (train_probe default)
        # the sync-free path (default on CUDA), forced on CPU by the environment
        "topk_sync_free": (["--strategy", "topk_ddp", "--epochs", "6"], {"LIGHTNING_TOPK_SYNC_FREE": "1"}),
        "dense": ["--strategy", "topk", "--density", "1.0", "--epochs", "2"],
        # static_graph + accumulate_grad_batches trips a torch reducer assert under plain `ddp` too,
        # so the four features are paired the other way round.
        "accum_unused": ["--strategy", "topk", "--density", "0.01", "--max-steps", "8", "--accumulate", "2",
                         "--unused"],
        "manual_static": ["--strategy", "topk", "--density", "0.01", "--max-steps", "8", "--manual", "--static-graph"],
    }
    out = {}
    for name, args in runs.items():
        args, env = args if isinstance(args, tuple) else (args, None)
        d = base / name
        run_script([PROBE, *args, "--out", d], env=env)
        out[name] = {
            "result": json.loads((d / "result.json").read_text()),
            "ranks": [torch.load(d / f"rank{r}.pt") for r in range(2)],
            "epoch2": [torch.load(p) for p in sorted(d.glob("rank*_epoch2.pt"))],
            "dir": d,
        }
    return out


def test_topk_reaches_dense_accuracy_on_digits(digits_runs):
    ddp = digits_runs["ddp"]["result"]["val_acc"]
    topk = digits_runs["topk"]["result"]["val_acc"]
    assert digits_runs["topk"]["result"]["strategy"] == "TopKDDPStrategy"
    # Float reductions differ between CPUs (kernel sets), and 6 epochs amplify them: topk - ddp over seeds 0-4,
    # here and under ATEN_CPU_CAPABILITY=default, spans -8..+1 of the 398 samples (an Intel Xeon: -8); ddp itself
    # 389..394 (issue 41). The margin, 20 samples, leaves 12 beyond the worst gap seen.
    assert ddp > 0.9
    assert topk >= ddp - 0.05, (topk, ddp)
    totals = digits_runs["topk"]["ranks"][0]["totals"]
    assert totals["numel_sent"] < 0.05 * totals["numel"]  # it really was sparse
    assert totals["bytes_sent"] < 0.1 * totals["bytes_dense"]


def test_sync_free_path_trains_like_the_cpu_fast_path(digits_runs):
    fast = digits_runs["topk"]["result"]["val_acc"]
    sync_free = digits_runs["topk_sync_free"]["result"]["val_acc"]
    # over seeds 0-2, native and ATEN_CPU_CAPABILITY=default: sync_free - fast 0..+3 of the 398 samples (issue 41)
    assert abs(sync_free - fast) <= 0.03, (sync_free, fast)
    assert digits_runs["topk_sync_free"]["ranks"][0]["totals"]["numel_sent"] < 0.05 * \
        digits_runs["topk_sync_free"]["ranks"][0]["totals"]["numel"]


def test_telemetry_through_lightning_logging_on_every_rank(digits_runs):
    run = digits_runs["topk"]
    r0, r1 = run["ranks"]
    for r in (r0, r1):  # reduced over the ranks: the same values everywhere, not only on rank 0
        cm = r["callback_metrics"]
        assert {"topk/compression", "topk/density", "topk/bytes_sent", "topk/comm_ms"} <= set(cm)
        assert cm["topk/compression"] > 5 and 0 < cm["topk/density"] < 0.1
        # compression is on the wire: a dense fp32 ring all-reduce's bytes over the bytes that left the rank
        assert cm["topk/compression"] == pytest.approx(cm["topk/bytes_dense_wire"] / cm["topk/bytes_wire"], rel=1e-4)
        assert cm["topk/buckets_allgather"] >= 1 and cm["topk/buckets_scatter"] == 0
        assert {"topk/compression", "topk/density"} <= set(r["progress_bar"])
        assert "topk/bytes_sent" not in r["progress_bar"]
    assert {k: v for k, v in r0["callback_metrics"].items() if k.startswith("topk/")} == \
        {k: v for k, v in r1["callback_metrics"].items() if k.startswith("topk/")}
    header = (run["dir"] / "logs" / "version_0" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert "topk/compression" in header and "topk/select_ms" in header  # through Lightning's loggers
    for key in ("select_time_s", "comm_time_s"):  # totals include the hooks' timings
        assert r0["totals"][key] > 0, key
    assert "topk/compression" not in digits_runs["ddp"]["ranks"][0]["callback_metrics"]


def test_fabric_matches_trainer_and_restores_residuals_exactly(digits_runs, tmp_path):
    """Same seed, data, model, optimizer, batches and epochs as the Trainer's "topk" run, through Fabric."""
    run_script(["tests/scripts/fabric_train.py", "--epochs", "6", "--out", tmp_path])
    fabric_acc = json.loads((tmp_path / "result.json").read_text())["val_acc"]
    trainer_acc = digits_runs["topk"]["result"]["val_acc"]
    assert abs(fabric_acc - trainer_acc) <= 0.01, (fabric_acc, trainer_acc)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for r in ranks:
        assert r["strategy"] == "lightning_topk.lightning.fabric.TopKDDPStrategy"
        assert r["shard_exists"] and r["changed"] and r["saved"]
        assert r["saved"].keys() == r["loaded"].keys()
        assert all(torch.equal(r["saved"][k], r["loaded"][k]) for k in r["saved"])
        assert r["rest"] == ["step"]  # the top-k metadata is not handed back to the user
        assert r["metrics"]["topk/compression"] > 5
    assert any(not torch.equal(ranks[0]["saved"][k], ranks[1]["saved"][k]) for k in ranks[0]["saved"])


def test_fabric_nonfinite_skip_and_raise_on_every_rank(tmp_path):
    """Rank 0's loss is NaN at one step: `skip` leaves the weights untouched on both ranks and trains on;
    `raise` raises FloatingPointError on both ranks (the Trainer's step controller, reused)."""
    for mode, step in (("skip", 3), ("raise", 2)):
        d = tmp_path / mode
        d.mkdir()
        run_script(["tests/scripts/fabric_train.py", "--epochs", "1", "--nonfinite", mode, "--inject-step", step,
                    "--out", d])
        r0, r1 = (torch.load(d / f"nonfinite_rank{r}.pt") for r in range(2))
        for r in (r0, r1):
            if mode == "skip":  # rolled back; "raise" keeps no undo log (the run ends)
                assert r["residuals_finite"]
                assert r["unchanged"] is True and "raised" not in r and r["acc"] > 0.8
            else:
                assert "non-finite gradient at exchange step" in r["raised"] and r["steps"] == step
        assert all(torch.equal(r0["params"][k], r1["params"][k]) for k in r0["params"])


def test_fabric_load_keeps_the_step_counter_and_folds_stranded_owner_residuals(tmp_path):
    """A scale-free run's checkpoint loaded by Fabric with a pinned exchange="allgather" (whose hook never
    folds): the owner residuals go into the rank residuals at the load; a step skipped right after goes
    back to the loaded exchange step (the density schedule's), not to 0, and keeps the fold."""
    from lightning_topk.comm.exchanges.scatter import fold_owner_residual

    for phase in ("save", "resume"):
        run_script(["tests/scripts/fabric_resume.py", "--phase", phase, "--out", tmp_path])
    for r in range(2):
        saved = torch.load(tmp_path / f"save_rank{r}.pt")["saved"]
        got = torch.load(tmp_path / f"resume_rank{r}.pt")
        assert saved["step"] == 5 and any(t.any() for t in saved["owner_residual"].values())
        want = dict(saved["residual"])
        for key, t in saved["owner_residual"].items():
            for n, v in fold_owner_residual(key, t).items():
                want[n] = want[n] + v
        loaded, skipped = got["loaded"], got["skipped"]
        assert loaded["step"] == 5 and loaded["owner_residual"] == {}
        assert loaded["residual"].keys() == want.keys()
        assert all(torch.allclose(loaded["residual"][n], want[n], atol=1e-7) for n in want)
        assert skipped["step"] == 5 and skipped["owner_residual"] == {}
        assert all(torch.equal(skipped["residual"][n], loaded["residual"][n]) for n in want)
        assert got["trained"]["step"] == 6 and got["trained"]["owner_residual"] == {}


def test_density_one_matches_ddp_through_trainer(digits_runs):
    """density=1.0 for 2 epochs against plain ddp after the same 2 epochs (of its 6-epoch run)."""
    a = digits_runs["dense"]["ranks"][0]["params"]
    ddp = digits_runs["ddp"]["epoch2"][0]
    assert ddp["global_step"] == digits_runs["dense"]["result"]["global_step"]
    b = ddp["params"]
    for k in a:
        assert torch.allclose(a[k].float(), b[k].float(), atol=1e-6, rtol=0), k


@pytest.mark.parametrize("run", ["topk", "accum_unused", "manual_static"])
def test_ranks_stay_identical_and_keep_own_residuals(digits_runs, run):
    r0, r1 = digits_runs[run]["ranks"]
    for k in r0["params"]:
        assert torch.equal(r0["params"][k], r1["params"][k]), k
    assert r0["steps"] > 1 and r0["residuals"]
    assert any(not torch.equal(r0["residuals"][k], r1["residuals"][k]) for k in r0["residuals"])


def test_accumulation_exchanges_once_per_optimizer_step_and_unused_params(digits_runs):
    run = digits_runs["accum_unused"]
    assert run["result"]["global_step"] == 8
    assert run["ranks"][0]["steps"] == 8  # 16 micro-batches, 8 exchanges
    res = run["ranks"][0]["residuals"]
    assert "unused.weight" in res and res["unused.weight"].abs().sum() == 0


def test_manual_optimization_with_static_graph(digits_runs):
    run = digits_runs["manual_static"]
    assert run["result"]["global_step"] == 8
    assert run["ranks"][0]["steps"] == 8


def test_plot_command_draws_runs_side_by_side(digits_runs, tmp_path_factory):
    from lightning_topk.app.plots import find_metrics, main, read_series

    base = digits_runs["topk"]["dir"].parent
    topk = read_series(find_metrics(str(base / "topk")))
    ddp = read_series(find_metrics(str(base / "ddp")))
    assert "topk/bytes_sent" in topk and "topk/bytes_sent" not in ddp  # telemetry reached the CSV logger
    assert topk["topk/bytes_sent"][-1][1] < 0.1 * topk["topk/bytes_dense"][-1][1]
    out = tmp_path_factory.mktemp("plot") / "cmp.png"
    assert main([str(base / "topk"), str(base / "ddp"), "--labels", "topk", "ddp", "--out", str(out)]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert main([str(base / "nope"), "--out", str(out)]) == 2
    assert main([str(base / "topk"), "--labels", "a", "b", "--out", str(out)]) == 2


@pytest.mark.parametrize("user_cap", [None, 25])
def test_bucket_rule_sets_ddp_buckets_unless_the_user_did(tmp_path, user_cap):
    """Unset bucket_cap_mb: the strategy's bucket rule picks it (same plan on both ranks; on this model at
    0.1 Gbit/s a cap that splits DDP's last bucket) and DDP's rebuilt buckets are the plan's. Set by the user:
    DDP keeps it and the rule stays out."""
    from lightning_topk.comm.cost import DDP_DEFAULT_BUCKET_CAP_MB

    script = "tests/scripts/bucket_probe.py"
    args = [script, "--out", tmp_path] + ([] if user_cap is None else ["--bucket-cap-mb", user_cap])
    run_nodes(args, num_nodes=2, timeout=300)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["rebuilt"] == 1 for r in ranks)
    if user_cap is not None:
        assert all(r["plan"] is None for r in ranks)
        assert all(r["ddp_cap_bytes"] == user_cap << 20 for r in ranks)
        return
    plan = ranks[0]["plan"]
    assert ranks[1]["plan"] == plan
    assert plan["cap_mb"] < DDP_DEFAULT_BUCKET_CAP_MB
    assert all(r["ddp_cap_bytes"] == plan["cap_mb"] << 20 for r in ranks)
    # exchange="auto" planned for DDP's rebuilt sparse buckets (the 40-entry one goes dense, unplanned)
    assert all(set(plan["buckets"][:-1]) <= set(r["planned_sizes"]) for r in ranks)
    assert plan["buckets"][-1] == 40  # the conv (36 + 4 entries) alone in the last bucket
    assert len(plan["buckets"]) >= 3  # DDP's default cap would give 2 (the 8.4M entries and the conv)
    assert all(r["buckets_exchanged_last_step"] == len(plan["buckets"]) for r in ranks)
