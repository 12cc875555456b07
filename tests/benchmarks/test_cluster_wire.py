"""Wire telemetry against the veth counters: 4 namespaces x 1 process over 1 Gbit/s links, a few steps per
exchange. ``bytes_wire`` (what a rank's algorithm puts on the wire) must match what left its node's
interface within 10% (the counters also hold TCP/IP headers and ACKs).

Skipped, with the reason, where network namespaces are not permitted.
"""
import os
import sys

import pytest

from tests.helpers.procs import ROOT

sys.path.insert(0, os.path.join(str(ROOT), "benchmarks"))
import cluster

NS_OK, NS_REASON = cluster.namespaces_available()
needs_netns = pytest.mark.skipif(not NS_OK, reason=f"network namespaces not permitted: {NS_REASON}")
SMALL = ["--hidden", "512", "--eval-every", "0", "--warmup-steps", "3", "--steps", "9", "--batch-size", "16"]


def _run(tmp_path, exchange, nodes=4, density="0.01"):
    res = cluster.run_cluster(["--strategy", "topk_ddp", "--exchange", exchange, "--density", density, *SMALL],
                              nodes=nodes, procs_per_node=1, rate="1gbit", timeout=300,
                              run_dir=str(tmp_path / exchange))
    assert res.mode == "netns"
    return cluster.summarize(res), res


@needs_netns
@pytest.mark.slow
@pytest.mark.parametrize("exchange", ["dense", "allgather", "scatter", "auto"])
def test_wire_bytes_match_the_veth_counters(tmp_path, exchange):
    s, res = _run(tmp_path, exchange)
    veth, wire = s["inter_node_bytes_per_node"], s["wire_bytes_per_rank"]
    assert len(veth) == len(wire) == 4
    for node, (v, w) in enumerate(zip(veth, wire)):
        assert w > 0 and abs(v - w) <= 0.10 * w, (exchange, node, v, w)
    last = res.ranks[0]["telemetry_steps"][-1]
    if exchange == "scatter":
        assert last["buckets_by"].get("scatter", 0) > 0
    if exchange == "auto":
        assert s["plan"]  # the choices made, per bucket


@needs_netns
@pytest.mark.slow
def test_hierarchical_inter_node_wire_matches_the_veth_counters(tmp_path):
    """2 nodes x 2 processes: the intra-node tier stays on each node's loopback, so a node's veth carries
    its L ranks' inter-node all-gathers: L x (N-1) x the inter-node payload (``bytes_inter``) per step.

    Within 20%: with DDP's bucket layout kept at its initial one (``find_unused_parameters``, so that the exchange
    resumes bit for bit; issue 41) the veth carried 16% more than ``bytes_inter`` (81.1 KB against 69.9 KB per node
    and step; 1.5% with the rebuilt layout, 109.7 against 108.1 KB). Not explained yet: see CHANGELOG."""
    res = cluster.run_cluster(["--strategy", "topk_ddp", "--exchange", "hierarchical", "--density", "0.01", *SMALL],
                              nodes=2, procs_per_node=2, rate="1gbit", timeout=300, run_dir=str(tmp_path / "hier"))
    assert res.mode == "netns"
    s = cluster.summarize(res)
    warm = res.ranks[0]["warmup_steps"]
    inter = [sum(t["bytes_inter"] for t in r["telemetry_steps"][warm:]) / (len(r["telemetry_steps"]) - warm)
             for r in res.ranks]
    assert all(t["buckets_by"].get("hierarchical", 0) > 0 for t in (r["telemetry_steps"][-1] for r in res.ranks))
    for node, v in enumerate(s["inter_node_bytes_per_node"]):
        w = sum(inter[r["rank"]] for r in res.ranks if r["node_rank"] == node) * (2 - 1)
        assert w > 0 and abs(v - w) <= 0.20 * w, (node, v, w)
