"""``topk_fsdp`` with ``fault_tolerance="torchft"`` on real processes (gloo on loopback, a real torchft lighthouse):
replica groups of 2 processes, each a Trainer with the model sharded over its processes (FSDP2), each rank
exchanging its gradient shard with the same rank of the other groups on its torchft process group. Without a
failure it is torch's own HSDP; a killed group heals shard by shard from a peer and rejoins; an uncommitted step
changes nothing."""
import pytest
import torch

from tests.helpers.procs import ROOT
from tests.lightning.test_elastic import Cluster, _logs, kill_and_restart_group

FSDP_SCRIPT = ROOT / "tests" / "scripts" / "fsdp_train.py"
FSDP_FABRIC = ROOT / "tests" / "scripts" / "fsdp_fabric.py"
pytestmark = pytest.mark.timeout(420)


def max_diff(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def two_groups(tmp_path, script, *opts):
    """Replica groups 0 and 1 of 2 processes each run ``script`` with ``opts`` to the end (min_replicas 2); returns
    each group's final parameters and each process's record (``ft<r>.pt.rank<k>``)."""
    c = Cluster(tmp_path, min_replicas=2)
    try:
        procs = [c.start(r, "--out", tmp_path / f"ft{r}.pt", "--torchft", r, *opts, script=script) for r in (0, 1)]
        for p in procs:
            assert p.wait(timeout=300) == 0, _logs(tmp_path)
    finally:
        c.close()
    groups = [torch.load(tmp_path / f"ft{r}.pt") for r in (0, 1)]
    return groups, [torch.load(tmp_path / f"ft{r}.pt.rank{k}", weights_only=False) for r in (0, 1) for k in (0, 1)]


@pytest.mark.parametrize("script, extra, quorums", [(FSDP_SCRIPT, ("--nodes", "1"), 8), (FSDP_FABRIC, (), 9)],
                         ids=["trainer", "fabric"])
def test_two_groups_at_density_one_equal_torch_hsdp(tmp_path, script, extra, quorums):
    """2 replica groups x 2 processes under torchft (Trainer; Fabric's topk_fsdp with its own loop), no failure,
    density 1 with fp32 values: the same 8 steps as torch's HSDP (fully_shard on the 2-D mesh (replicate=2,
    shard=2)) on the same data and initial weights. Fabric forms each step's quorum at the end of the previous
    optimizer.step(): 8 steps and the quorum after the last."""
    pytest.importorskip("torchft")
    from tests.lightning.test_fsdp import train

    ref, _ = train(tmp_path, "hsdp", "--strategy", "hsdp", "--steps", "8")
    groups, ranks = two_groups(tmp_path, script, "--density", "1", "--value-dtype", "fp32", "--exchange", "allgather",
                               "--steps", "8", *extra)
    assert all(r["exchange_step"] == 8 and r["step"] == 8 and r["ft"]["ft/step"] == 8 for r in ranks), ranks
    assert all(r["quorum_sizes"] == [2] * quorums for r in ranks), [r["quorum_sizes"] for r in ranks]
    assert max_diff(groups[0], groups[1]) == 0.0
    diff = max_diff(ref, groups[0])
    assert diff <= 1e-6, diff
    print("FSDP_FT_HSDP", script.name, diff)


def test_two_groups_with_the_scale_free_exchange_equal_topk_fsdp_without_torchft(tmp_path):
    """exchange="scatter" under torchft at density 0.05, every FSDP group sparse (min_sparse_numel=0), so the blocks'
    groups are reduced before the last one: each completes in its own hook (the first backward hung), and the 4 steps
    are those of the same exchange on 2 nodes x 2 without torchft (torch's process groups, not torchft's)."""
    pytest.importorskip("torchft")
    from tests.lightning.test_fsdp import train

    opts = ("--density", "0.05", "--exchange", "scatter", "--steps", "4")
    ref, plain = train(tmp_path, "plain", *opts)
    groups, ranks = two_groups(tmp_path, FSDP_SCRIPT, *opts, "--nodes", "1")
    assert all(r["exchange_step"] == 4 and r["ft"]["ft/step"] == 4 and r["residual_abs"] > 0 for r in ranks), ranks
    assert max_diff(groups[0], groups[1]) == 0.0
    diff = max_diff(ref, groups[0])
    assert diff == 0.0, diff
    assert [r["residual_sum"] for r in ranks] == [r["residual_sum"] for r in plain]
    print("FSDP_FT_SCATTER", diff)


RANKS = (".rank0", ".rank1")


FABRIC = ROOT / "tests" / "scripts" / "fabric_elastic.py"


def test_fabric_kill_a_group_heal_its_shards_and_rejoin(tmp_path):
    """Fabric's topk_fsdp under torchft, 2 replica groups x 2 processes: SIGKILL both processes of one group; the
    other keeps committing steps alone; the restarted group's ranks each heal their own shards (parameters, AdamW
    state, torchft's step) from the same rank of the live group inside fabric.setup_optimizers, in place, and the
    group rejoins at the peers' position; at the end every rank's shards and optimizer state equal its
    counterpart's bitwise."""


    pytest.importorskip("torchft")
    stop = tmp_path / "stop_at"
    c = Cluster(tmp_path, script=FABRIC)
    args = ("--steps", 100000, "--delay", 0.1, "--init-differs", "--stop-file", stop, "--devices", 2, "--fsdp")
    try:
        killed_at, during = kill_and_restart_group(c, args, stop, lambda row: row["ft_step"] >= 4, 4, 4,
                                                   rejoined=bool)
    finally:
        c.close()
    peer = {x["step"]: x["data_pos"] for x in c.rows(0, ".rank0")}
    for k in RANKS:  # healed inside fabric.setup_optimizers, in place, at the peers' step
        b = c.rows(1, k)
        assert b[0]["heals"] == 1 and b[0]["heal_time_s"] > 0 and b[0]["step"] >= during, b[0]
        assert all(x["ptrs_kept"] for x in b) and any(x["quorum"] == 2 for x in b), b[:3]
        assert all(x["step"] in peer for x in b)
    alone = [x for x in c.rows(0, ".rank0") if x["quorum"] == 1 and x["ft_step"] > killed_at]
    assert len(alone) >= 4, "the survivor did not commit steps alone"
    for k in RANKS:
        live, healed = (torch.load(tmp_path / f"replica{r}{k}.pt") for r in (0, 1))
        assert live["metrics"]["ft/step"] == healed["metrics"]["ft/step"]
        assert live["params"].keys() == healed["params"].keys() and len(live["opt"]) == len(healed["opt"]) > 0
        for name, v in live["params"].items():
            assert torch.equal(v, healed["params"][name]), (k, name)
        for s0, s1 in zip(live["opt"], healed["opt"]):
            assert s0.keys() == s1.keys() and all(torch.equal(v, s1[key]) for key, v in s0.items()), k
    shards = [torch.load(tmp_path / f"replica0{k}.pt")["params"] for k in RANKS]
    assert any(shards[0][n].shape != shards[1][n].shape or not torch.equal(shards[0][n], shards[1][n])
               for n in shards[0])  # the ranks hold different shards
    print("FSDP_FABRIC_FT_KILL", {"killed_at": killed_at, "steps_alone": during - killed_at,
                                  "heal_time_s": [c.rows(1, k)[0]["heal_time_s"] for k in RANKS],
                                  "healed_at_step": c.rows(1, ".rank0")[0]["step"]})


def test_fabric_local_sgd_kill_a_group_heal_its_shards_and_rejoin(tmp_path):
    """Fabric's topk_fsdp with local SGD under torchft (H = 4), 2 replica groups x 2 processes: SIGKILL one group; the
    other's rounds go on committing alone; the restarted group's ranks heal their shards of the model and of the
    outer state inside fabric.setup_optimizers (the join round) and continue at the peers' inner step; at the end
    every rank's parameters and outer state equal its counterpart's bitwise."""


    pytest.importorskip("torchft")
    stop = tmp_path / "stop_at"
    c = Cluster(tmp_path, script=FABRIC)
    args = ("--steps", 100000, "--delay", 0.05, "--init-differs", "--stop-file", stop, "--devices", 2, "--fsdp",
            "--local-steps", 4)
    try:
        killed_at, _ = kill_and_restart_group(c, args, stop, lambda row: row["ft_step"] >= 2 and row["quorum"] == 2,
                                              2, 2, solo=False, rejoined=bool)
    finally:
        c.close()
    alone = [x for x in c.rows(0, ".rank0") if x["ft_step"] > killed_at and x["position"] == 0 and x["quorum"] == 1]
    assert alone and all(x["contributors"] == 1 for x in alone), alone
    for k in RANKS:
        b, peer = c.rows(1, k), {x["step"]: x for x in c.rows(0, k)}
        assert b[0]["heals"] == 1 and b[0]["step"] > 0 and b[0]["step"] % 4 == 0, b[0]  # at a round start
        assert all(x["step"] in peer and x["rounds"] == peer[x["step"]]["rounds"] for x in b), b[:3]
        assert all(x["ptrs_kept"] for x in b)
        live, healed = (torch.load(tmp_path / f"replica{r}{k}.pt") for r in (0, 1))
        for name, v in live["params"].items():
            assert torch.equal(v, healed["params"][name]), (k, name)
        for key in ("theta", "mom"):
            assert torch.equal(live["outer"][key], healed["outer"][key]), (k, key)
        assert all(live["outer"][key] == healed["outer"][key] for key in ("rounds", "position", "steps"))
        assert live["outer"]["theta"].numel() > 0 and live["outer"]["rounds"] > killed_at + 2
    print("FSDP_FABRIC_FT_LOCAL_KILL", {"killed_at_round": killed_at,
                                        "heal_time_s": [c.rows(1, k)[0]["heal_time_s"] for k in RANKS],
                                        "joined_at_step": c.rows(1, ".rank0")[0]["step"]})


def test_uncommitted_step_changes_nothing(tmp_path):
    """One group of 2 processes; at committed step 3 both report an error to torchft after the backward, so
    should_commit says no: each rank's parameter shards, sharded optimizer state and shard residuals are bitwise
    what they were before the batch."""
    pytest.importorskip("torchft")
    c = Cluster(tmp_path)
    try:
        p = c.start(0, "--steps", 6, "--refuse-at", 3, "--fsdp", "--devices", 2)
        assert p.wait(timeout=240) == 0, _logs(tmp_path)
    finally:
        c.close()
    for k in RANKS:
        rows = c.rows(0, k)
        refused = [r for r in rows if "unchanged" in r]
        assert len(refused) == 1, rows
        assert refused[0]["unchanged"] and refused[0]["residuals_checked"] > 0, refused
        assert refused[0]["ft_step"] == 3 and refused[0]["uncommitted"] == 1 and refused[0]["skipped"] == 1
        assert rows[-1]["ft_step"] == 6 and rows[-1]["global_step"] == 7  # 7 attempts, 6 committed


def test_kill_a_group_heal_its_shards_and_rejoin(tmp_path):
    """2 replica groups of 2 processes (the model sharded over each group's processes): SIGKILL both processes of
    one group; the other keeps committing steps alone; the killed group is restarted, each of its ranks heals its
    own shards (parameters, sharded optimizer state, step counts, data position) from the same rank of the live
    group, and it rejoins; at the end every rank's shards and optimizer state equal its counterpart's bitwise."""


    pytest.importorskip("torchft")
    stop = tmp_path / "stop_at"
    c = Cluster(tmp_path)
    delay = 0.1
    args = ("--steps", 100000, "--delay", delay, "--init-differs", "--stop-file", stop, "--devices", 2, "--fsdp",
            "--positioned-data")
    try:
        killed_at, during = kill_and_restart_group(c, args, stop, lambda row: row["ft_step"] >= 6, 5, 6)
    finally:
        c.close()
    back = [c.rows(1, k) for k in RANKS]
    for b in back:  # healed at the peers' step counts, and in the quorum of 2 from its first step on
        assert b[0]["heals"] == 1 and b[0]["heal_time_s"] > 0 and b[0]["ft_step"] >= during, b[0]
        assert b[0]["quorum"] == 2 and b[0]["global_step"] > 1 and b[0]["data_position"]["batch"] > 0, b[0]
    peer = {x["global_step"]: x["data_pos"] for x in c.rows(0, ".rank0")}
    assert all(x["data_pos"] == peer[x["global_step"]] for b in back for x in b if x["global_step"] in peer)
    outage = [x for x in c.rows(0, ".rank0") if x["quorum"] == 1 and x["ft_step"] > killed_at]
    assert len(outage) >= 5, "the survivor did not commit steps alone"
    assert c.rows(0, ".rank0")[-1]["quorum"] == 2
    for k in RANKS:
        live, healed = (torch.load(tmp_path / f"replica{r}{k}.pt") for r in (0, 1))
        assert live["metrics"]["ft/step"] == healed["metrics"]["ft/step"]
        for name, v in live["params"].items():
            assert torch.equal(v, healed["params"][name]), (k, name)
        assert live["opt"].keys() == healed["opt"].keys() and live["opt"]
        for i, st in live["opt"].items():
            assert all(torch.equal(v, healed["opt"][i][key]) for key, v in st.items()), (k, i)
        assert healed["metrics"]["ft/residual_mass"] > 0  # its own error feedback, started at zero
    shards = [torch.load(tmp_path / f"replica0{k}.pt")["params"] for k in RANKS]
    assert any(not torch.equal(shards[0][n], shards[1][n]) for n in shards[0])  # the ranks hold different shards
    live = [torch.load(tmp_path / f"replica0{k}.pt")["metrics"] for k in RANKS]
    assert all(m["ft/uncommitted_steps"] <= 1 for m in live), live  # at most the step the kill interrupted
    print("FSDP_FT_KILL", {"delay": delay, "killed_at": killed_at, "steps_alone": during - killed_at,
                           "heal_time_s": [b[-1]["heal_time_s"] for b in back],
                           "uncommitted": [m["ft/uncommitted_steps"] for m in live],
                           "failed_collectives": [m["ft/failed_collectives"] for m in live]})


def test_groups_started_with_different_weights_agree_from_step_zero(tmp_path):
    """2 groups of 2 processes whose models start from different random weights, in one quorum from step 0
    (min_replicas=2): torchft's init_sync heals rank r of every group from the quorum's replica r, so every
    group's rank r holds the same shard at the first forward, and all stay identical."""
    pytest.importorskip("torchft")
    c = Cluster(tmp_path, min_replicas=2)
    args = ("--steps", 4, "--init-differs", "--devices", 2, "--fsdp", "--min-replicas", 2)
    try:
        procs = [c.start(r, *args) for r in (0, 1)]
        for p in procs:
            assert p.wait(timeout=240) == 0, _logs(tmp_path)
    finally:
        c.close()
    for k in RANKS:
        rows = [c.rows(r, k) for r in (0, 1)]
        assert all(x["quorum"] == 2 for rr in rows for x in rr)
        assert [x["psum_fwd"] for x in rows[0]] == [x["psum_fwd"] for x in rows[1]], k
        finals = [torch.load(tmp_path / f"replica{r}{k}.pt")["params"] for r in (0, 1)]
        assert all(torch.equal(v, finals[1][n]) for n, v in finals[0].items()), k
    assert sum(c.rows(r, k)[0]["heals"] for r in (0, 1) for k in RANKS) == 2  # one rank per group healed


def test_a_group_spanning_nodes_is_refused():
    from lightning_topk.lightning.fsdp import TopKFSDPStrategy

    s = TopKFSDPStrategy(fault_tolerance="torchft", lighthouse="http://127.0.0.1:1")
    s.num_nodes = 2
    with pytest.raises(ValueError, match=r"topk_fsdp: fault_tolerance='torchft' runs one Trainer \(or Fabric\) per replica group "
                                         r"\(num_nodes=1, got num_nodes=2"):
        s.setup_environment()


def test_local_sgd_dense_equals_per_shard_averaging(tmp_path):
    """Local SGD under torchft on sharded models, 2 groups x 2 processes, no failure, dense fp32 outer values: the
    same as FSDP inside each group and every 4 steps each parameter shard averaged over the groups with
    torch.distributed.all_reduce (Lightning's ModelParallelStrategy, 2 nodes x 2)."""
    pytest.importorskip("torchft")
    from tests.lightning.test_fsdp import train

    ref, _ = train(tmp_path, "avg", "--strategy", "avg", "--local-steps", "4", "--steps", "8")
    groups, ranks = two_groups(tmp_path, FSDP_SCRIPT, "--local-steps", "4", "--outer-value-bits", "32",
                               "--outer-density", "1", "--steps", "8", "--nodes", "1")
    # the join round (nothing sent), then 2 rounds
    assert all(r["rounds"] == 3 and r["ft"]["ft/step"] == 3 and r["quorum_sizes"] == [2, 2, 2] for r in ranks), ranks
    assert max_diff(groups[0], groups[1]) == 0.0
    diff = max_diff(ref, groups[0])
    print("FSDP_FT_LOCAL_DIFF", diff)
    assert diff <= 2e-6, diff


def test_local_sgd_kill_a_group_heal_its_shards_and_rejoin(tmp_path):
    """Local SGD under torchft on sharded models (H = 4, 5% at 8 bits, DiLoCo's outer step), 2 groups x 2
    processes: SIGKILL one group; the other's rounds go on committing alone; the restarted group's ranks heal their
    shards of the outer state (θ_outer, outer momentum, counts) and of the model from the live group at its next
    round end and rejoin; at the end every rank's parameters and outer state equal its counterpart's bitwise."""


    pytest.importorskip("torchft")
    stop = tmp_path / "stop_at"
    c = Cluster(tmp_path)
    args = ("--steps", 100000, "--delay", 0.05, "--init-differs", "--stop-file", stop, "--devices", 2, "--fsdp",
            "--positioned-data", "--local-steps", 4)
    try:
        killed_at, during = kill_and_restart_group(c, args, stop, lambda row: row["ft_step"] >= 2 and row["quorum"] == 2,
                                                   2, 1, solo=False)
    finally:
        c.close()
    alone = [x for x in c.rows(0, ".rank0") if x["ft_step"] > killed_at and x["position"] == 0 and x["quorum"] == 1]
    assert alone and all(x["contributors"] == 1 for x in alone), alone
    together = [x for x in c.rows(0, ".rank0") if x["position"] == 0 and x["quorum"] == 2]
    assert together and all(x["contributors"] in (1, 2) for x in together)
    assert any(x["contributors"] == 2 for x in together)  # counted per replica group, not per process
    for k in RANKS:
        b = c.rows(1, k)
        assert b[0]["heals"] == 1 and b[0]["ft_step"] >= during and b[0]["data_position"]["batch"] > 0, b[0]
        live, healed = (torch.load(tmp_path / f"replica{r}{k}.pt") for r in (0, 1))
        for name, v in live["params"].items():
            assert torch.equal(v, healed["params"][name]), (k, name)
        for key in ("theta", "mom"):
            assert torch.equal(live["outer"][key], healed["outer"][key]), (k, key)
        assert live["outer"]["rounds"] == healed["outer"]["rounds"]
        assert live["outer"]["mom"].abs().sum() > 0
    print("FSDP_FT_LOCAL_KILL", {"killed_at_round": killed_at, "rounds_alone": during - killed_at,
                                 "heal_time_s": [c.rows(1, k)[-1]["heal_time_s"] for k in RANKS]})


def test_local_sgd_uncommitted_round_rolls_back_then_heals(tmp_path):
    """Local SGD under torchft on sharded models, 2 groups x 2 processes: both ranks of group 0 report an error in
    the round that would commit round 4, so its should_commit says no: each rank's shard of θ_outer, outer
    momentum and error feedback, the round count and its parameter shards are bitwise what they were before the
    round. Group 1 commits it; at the next round group 0 heals from it, and every rank ends equal to its
    counterpart."""
    pytest.importorskip("torchft")
    from tests.lightning.test_elastic import _local_args

    c = Cluster(tmp_path, min_replicas=2)
    stop = tmp_path / "stop_at"
    stop.write_text("7")
    fsdp = ("--fsdp", "--devices", 2)
    try:
        procs = [c.start(0, *_local_args(stop, "--refuse-round", 4, *fsdp)), c.start(1, *_local_args(stop, *fsdp))]
        for p in procs:
            assert p.wait(timeout=240) == 0, _logs(tmp_path)
    finally:
        c.close()
    for k in RANKS:
        rows0, rows1 = c.rows(0, k), c.rows(1, k)
        refused = [x for x in rows0 if "round_unchanged" in x]
        assert len(refused) == 1 and refused[0]["round_unchanged"], refused
        assert refused[0]["round_uncommitted"] == 1 and refused[0]["ft_step"] == 3, refused
        assert rows1[-1]["round_uncommitted"] == 0
        assert rows0[-1]["heals"] == rows0[rows0.index(refused[0])]["heals"] + 1  # healed from group 1 next round
        finals = [torch.load(tmp_path / f"replica{r}{k}.pt") for r in (0, 1)]
        for name, v in finals[0]["params"].items():
            assert torch.equal(v, finals[1]["params"][name]), (k, name)
        for key in ("theta", "mom"):
            assert torch.equal(finals[0]["outer"][key], finals[1]["outer"][key]), (k, key)
