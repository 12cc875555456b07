"""The generated suite's cells: a pairwise sample of the support matrix (lightning_topk.support), the cells the
review of issue 41 found defects in, and per refusal rule the cells that show it; grouped into launches of
tests/scripts/cell_probe.py (one per strategy, API and layout)."""
import json
from collections import defaultdict
from pathlib import Path

import torch

from lightning_topk import support
from tests.helpers.procs import SCRIPTS, run_nodes, run_script

PROBE = SCRIPTS / "cell_probe.py"
RULE0 = support.Rule("", "supported", "")
DEFAULT = {"strategy": "topk_ddp", "api": "trainer", "mode": "per_step", "exchange": "auto", "fault_tolerance": "none",
           "layout": "2x2", "optimization": "automatic", "feature": "plain", "end": "max_steps"}


def cell(**kw):
    c = {**DEFAULT, **kw}
    c["id"] = support.cell_id(c)
    return c


# The cells issue 41's review found defects in (the gloo-run ones; the torchft ones run in tests/lightning).
DEFECTS = {
    "1 topk_fsdp x scatter deadlocked": cell(strategy="topk_fsdp", exchange="scatter"),
    "3 topk_fsdp local SGD resumed a mix of the replicas": cell(strategy="topk_fsdp", mode="local_sgd"),
    "4 resume right after the first sparse step (topk_ddp)": cell(exchange="allgather", layout="2x1"),
    "4 resume right after the first sparse step (topk_fsdp)": cell(strategy="topk_fsdp", exchange="allgather"),
    "5 manual optimization engaged the recipe early (topk_fsdp)": cell(strategy="topk_fsdp", exchange="allgather",
                                                                       optimization="manual"),
    "5 manual optimization engaged the recipe early (topk_ddp)": cell(exchange="allgather", optimization="manual",
                                                                      layout="1x2"),
    "8 world size 3, defaults": cell(layout="1x3"),
    "8 world size 3, dense": cell(layout="1x3", exchange="dense"),
    "8 world size 3, local SGD": cell(layout="1x3", mode="local_sgd"),
}
DEFECT_REFUSED = {"6 partial sharding": cell(strategy="topk_fsdp", feature="partial_shard")}


def launch_key(c):
    nodes, procs = c["layout"].split("x")
    if c["fault_tolerance"] == "torchft":
        nodes = "1"
    return c["strategy"], c["api"], int(nodes), int(procs)


def runnable(c):
    """Gloo-run here: no torchft (its cells run in tests/lightning/test_elastic*.py) and no process faults."""
    return c["fault_tolerance"] == "none" and c["end"] in ("max_steps", "max_epochs")


def _sample():
    pool = [c for c in support.cells() if support.status(c)[0] == "supported" and runnable(c)]
    chosen = support.pairwise(pool, must=[{k: v for k, v in c.items() if k != "id"} for c in DEFECTS.values()],
                              group=launch_key)
    return [cell(**c) for c in chosen]


SUPPORTED = _sample()


def _refused():
    """Per setup-time rule, per strategy and API: the first refused cell of the rule (gloo-runnable or not: a
    refusal comes before any process group, torchft's included)."""
    out, seen = list(DEFECT_REFUSED.values()), {}
    launched = {launch_key(c) for c in SUPPORTED}
    for c in support.cells():
        st, rule = support.status(c)
        if st != "refused" or rule.at == "first backward" or c["end"] not in ("max_steps", "max_epochs"):
            continue
        key = (rule.name, c["strategy"], c["api"])
        if key not in seen or (launch_key(c) in launched and launch_key(seen[key]) not in launched):
            seen[key] = c  # the first, or the first in a launch the supported cells make anyway
    return out + [cell(**c) for c in seen.values()]


REFUSED = _refused()


def groups(cells):
    g = defaultdict(list)
    for c in cells:
        g[launch_key(c)].append(c)
    return g


class Launches:
    """Runs each launch of ``cells`` once, on first use, and reads what its ranks wrote."""

    def __init__(self, cells, base: Path, reference=None):
        self.groups, self.base, self.reference, self.done = groups(cells), base, reference, {}

    def out(self, c):
        key = launch_key(c)
        if key not in self.done:
            # refusals first: they must come before any process group, and a launch's later cells reuse its group
            cells = sorted(self.groups[key], key=lambda c: (support.status(c)[0] != "refused",
                                                            (support.status(c)[1] or RULE0).at != "setup"))
            d = self.base / "-".join(map(str, key)) / (self.reference or "topk")
            d.mkdir(parents=True, exist_ok=True)
            (d / "cells.json").write_text(json.dumps(cells))
            args = [PROBE, "--cells", d / "cells.json", "--out", d]
            if self.reference:
                args += ["--reference", self.reference]
            try:
                if key[2] > 1:
                    run_nodes(args, num_nodes=key[2], timeout=600)
                else:
                    run_script(args, timeout=600)
                self.done[key] = (d, None)
            except Exception as e:  # the cells of a launch that failed fail with its log
                self.done[key] = (d, e)
        d, err = self.done[key]
        return d / c["id"], err


def ranks(c):
    n, p = (int(v) for v in c["layout"].split("x"))
    return n * p


def load(d, phase, world):
    return [torch.load(d / f"{phase}.rank{r}.pt", weights_only=False) for r in range(world)]


def agreeing(c, params):
    """The parameters every rank must hold alike: all, but under topk_ddp not the ones BackboneFinetuning unfroze
    (outside DDP's buckets: Lightning's own ddp leaves them unsynchronised too)."""
    if c["feature"] == "unfreeze" and c["strategy"] == "topk_ddp":
        return {k: v for k, v in params.items() if not k.startswith("blocks")}
    return params


def max_diff(a, b):
    return max((x - b[k]).abs().max().item() for k, x in a.items())


DDP_REBUILD_BOUND = 1e-4


def resume_bound(c, own):
    """How far a resumed run may end from the straight one: nowhere (bit for bit), except where torch's DDP itself
    sums in another order after a resume. DDP rebuilds its buckets after a process's first iteration, so a resumed
    process's first step reduces with the initial layout; with 3 or more ranks gloo's ring then adds in another order
    (Lightning's own ddp, resumed the same way, ends 7e-9 to 1.5e-8 off), and a lossy wire (``dense_bf16``, which
    ``auto`` may pick) can round that last bit the other way (5e-5 here)."""
    if c["strategy"] == "topk_ddp" and ranks(c) >= 3 and (own > 0 or c["api"] == "fabric"):
        return DDP_REBUILD_BOUND
    return own


def check_supported(c, launches, reference=None):
    """A supported cell finishes in time on every rank, its ranks agree bit for bit, every checkpoint resumes bit
    for bit, and where it sends dense its parameters are Lightning ddp's."""
    d, err = launches.out(c)
    assert err is None, f"{c['id']}: the launch failed: {err}"
    assert not list(d.glob("refused.*")), f"{c['id']} is supported but was refused: {list(d.glob('refused.*'))}"
    world = ranks(c)
    full = load(d, "full", world)
    steps = {f["step"] for f in full}
    assert steps == {6}, f"{c['id']}: ranks ended at steps {steps}, not 6"
    for r, f in enumerate(full[1:], 1):
        a, b = agreeing(c, full[0]["params"]), agreeing(c, f["params"])
        assert max_diff(a, b) == 0.0, f"{c['id']}: rank {r} differs from rank 0 by {max_diff(a, b):.3g}"
    import importlib.util

    spec = importlib.util.spec_from_file_location("cell_probe", PROBE)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    ref = None
    if reference is not None:
        rd, rerr = reference.out(c)
        assert rerr is None, f"{c['id']}: the ddp reference failed: {rerr}"
        ref = load(rd, "ddp_full", world)
        if dense_reference(c):
            for r in range(world):
                diff = max_diff(ref[r]["params"], full[r]["params"])
                assert diff == 0.0, f"{c['id']}: rank {r} is {diff:.3g} off Lightning's ddp"
    for k in probe.resume_points(c):
        again = load(d, f"resume{k}", world)
        # Lightning's own ddp, resumed the same way: what a resume of the same loop gives without this project
        own = [0.0] * world if ref is None else [
            max_diff(a["params"], b["params"]) for a, b in zip(ref, load(rd, f"ddp_resume{k}", world))]
        for r in range(world):
            diff = max_diff(full[r]["params"], again[r]["params"])
            assert diff <= resume_bound(c, own[r]), (
                f"{c['id']}: resumed after step {k}, rank {r} ends {diff:.3g} off the straight run"
                + ("" if ref is None else f" (Lightning's ddp resumed the same way: {own[r]:.3g})"))


def check_refused(c, launches):
    """A refused cell fails at setup, before any process group, with the matrix's message on every rank that ran."""
    d, err = launches.out(c)
    assert err is None, f"{c['id']}: the launch failed: {err}"
    files = sorted(d.glob("refused.rank*.json"))
    assert files, f"{c['id']} is refused by the matrix but ran: {sorted(p.name for p in d.iterdir())}"
    want = support.status(c)[1].render({**c, "layout": f"1x{c['layout'].split('x')[1]}"}
                                       if c["fault_tolerance"] == "torchft" else c)
    for f in files:
        got = json.loads(f.read_text())
        # the matrix's message, then (for some rules) what the raise site found, in parentheses
        assert got["error"] == want or got["error"].startswith(want + " ("), (
            f"{c['id']}: {f.name} says\n{got['error']}\nthe matrix says\n{want}")
        if support.status(c)[1].at == "setup":
            assert got["pg"] is False, f"{c['id']}: the refusal came after the process group was made"


def dense_reference(c):
    """Cells whose every step is dense under topk_ddp with the Trainer: Lightning ddp's, bit for bit."""
    return (c["strategy"] == "topk_ddp" and c["api"] == "trainer" and c["mode"] == "per_step"
            and c["exchange"] == "dense")


def ft(test, **kw):
    return cell(fault_tolerance="torchft", exchange=kw.pop("exchange", "allgather"), **kw), test


E, F = "tests/lightning/test_elastic.py::", "tests/lightning/test_fsdp_elastic.py::"
# The torchft cells and the test of its own harness (lighthouse, replica groups started, killed, stopped) that runs
# each; tests/matrix/test_ft_cells.py checks that every test named here exists and that the matrix supports the cell.
FT_CELLS = [
    ft(E + "test_kill_one_of_three_replica_groups_heal_and_rejoin", layout="3x1", end="kill"),
    ft(E + "test_kill_one_of_three_replica_groups_heal_and_rejoin", layout="3x1", end="kill", exchange="scatter"),
    ft(E + "test_kill_mid_step_survivors_roll_back_and_go_on", layout="3x1", end="kill"),
    ft(E + "test_two_groups_of_two_processes_kill_heal_rejoin", layout="2x2", end="kill"),
    ft(E + "test_local_sgd_kill_one_of_three_heal_and_rejoin", layout="3x1", mode="local_sgd", exchange="auto",
       end="kill"),
    ft(E + "test_local_sgd_kill_inside_a_round_rolls_back_on_survivors", layout="3x1", mode="local_sgd",
       exchange="auto", end="kill"),
    ft(E + "test_local_sgd_dense_matches_torch_averaging", layout="2x1", mode="local_sgd", exchange="auto"),
    ft(E + "test_fabric_kill_one_of_three_heal_and_rejoin", api="fabric", layout="3x1", end="kill"),
    ft(E + "test_fabric_two_groups_of_two_processes_heal_and_agree", api="fabric", layout="2x2", end="kill"),
    ft(E + "test_fabric_local_sgd_kill_one_of_three_heal_and_rejoin", api="fabric", layout="3x1", mode="local_sgd",
       exchange="auto", end="kill"),
    ft(E + "test_fabric_dense_matches_fabric_ddp", api="fabric", layout="2x1", exchange="dense"),
    ft(F + "test_two_groups_at_density_one_equal_torch_hsdp", strategy="topk_fsdp", layout="2x2"),
    ft(F + "test_two_groups_at_density_one_equal_torch_hsdp", strategy="topk_fsdp", api="fabric", layout="2x2"),
    ft(F + "test_kill_a_group_heal_its_shards_and_rejoin", strategy="topk_fsdp", layout="2x2", end="kill"),
    ft(F + "test_fabric_kill_a_group_heal_its_shards_and_rejoin", strategy="topk_fsdp", api="fabric", layout="2x2",
       end="kill"),
    ft(F + "test_local_sgd_dense_equals_per_shard_averaging", strategy="topk_fsdp", layout="2x2", mode="local_sgd",
       exchange="auto"),
    ft(F + "test_local_sgd_kill_a_group_heal_its_shards_and_rejoin", strategy="topk_fsdp", layout="2x2",
       mode="local_sgd", exchange="auto", end="kill"),
    ft(F + "test_fabric_local_sgd_kill_a_group_heal_its_shards_and_rejoin", strategy="topk_fsdp", api="fabric",
       layout="2x2", mode="local_sgd", exchange="auto", end="kill"),
]


def needs_ddp_run(c):
    """Lightning's own ddp runs beside a topk_ddp Trainer cell where it is the reference (``exchange="dense"``) or
    where its own resume may be inexact (3 or more ranks); with 2 ranks every resume must be bit for bit anyway."""
    return c["api"] == "trainer" and c["strategy"] == "topk_ddp" and (dense_reference(c) or ranks(c) >= 3)


def module_tests(strategy):
    """The fixture and the two tests of one strategy's module (one module per strategy, so that pytest-xdist's
    loadscope runs the two on different workers): ``launches, test_supported_cell, test_refused_cell``."""
    import pytest

    ours = [c for c in SUPPORTED if c["strategy"] == strategy]
    refused = [c for c in REFUSED if c["strategy"] == strategy]

    @pytest.fixture(scope="module")
    def launches(tmp_path_factory):
        base = tmp_path_factory.mktemp(f"matrix_{strategy}")
        return Launches(ours + refused, base), Launches([c for c in ours if needs_ddp_run(c)], base, "ddp")

    @pytest.mark.timeout(900)
    @pytest.mark.parametrize("c", ours, ids=[c["id"] for c in ours])
    def test_supported_cell(c, launches):
        mine, ddp = launches
        check_supported(c, mine, ddp if needs_ddp_run(c) else None)

    @pytest.mark.timeout(900)
    @pytest.mark.parametrize("c", refused, ids=[c["id"] for c in refused])
    def test_refused_cell(c, launches):
        check_refused(c, launches[0])

    return launches, test_supported_cell, test_refused_cell
