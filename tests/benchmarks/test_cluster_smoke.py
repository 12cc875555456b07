"""CI smoke test of the simulated cluster (benchmarks/cluster.py): 2 namespaces, a few steps, clean teardown.

Namespace tests are skipped, with the reason, where namespaces cannot be created (not root, no iproute2,
`ip netns add` refused).
"""
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers.procs import ROOT as PROOT

ROOT = str(PROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import cluster  # noqa: E402

NS_OK, NS_REASON = cluster.namespaces_available()
needs_netns = pytest.mark.skipif(not NS_OK, reason=f"network namespaces not permitted: {NS_REASON}")
TINY = ["--hidden", "256", "--eval-every", "0", "--warmup-steps", "1", "--batch-size", "16"]


# This module's runs name their namespaces and links with a prefix of their own (cluster.NAME_PREFIX is what
# every run's random prefix starts with), so a cluster benchmark running beside the suite is not a leftover.
OWN = "ltt"


@pytest.fixture(autouse=True)
def own_prefix(monkeypatch):
    monkeypatch.setattr(cluster, "NAME_PREFIX", OWN)


def _leftovers(before):
    return (set(cluster.list_namespaces(OWN)) | set(cluster.list_links(OWN))) - before


def _snapshot():
    return set(cluster.list_namespaces(OWN)) | set(cluster.list_links(OWN))


def test_parse_rate_checks_input():
    assert cluster.parse_rate("100mbit") == 100e6
    assert cluster.parse_rate("1gbit") == 1e9
    assert cluster.parse_rate("none") is None
    with pytest.raises(ValueError, match="--rate"):
        cluster.parse_rate("100 MB/s")


@needs_netns
def test_two_namespaces_train_over_the_limited_link_and_leave_nothing(tmp_path):
    before = _snapshot()
    res = cluster.run_cluster(["--strategy", "ddp", "--steps", "3", *TINY], nodes=2, procs_per_node=1,
                              rate="100mbit", timeout=120, run_dir=str(tmp_path))
    assert res.mode == "netns"
    assert [r["lightning_global_rank"] for r in res.ranks] == [0, 1]
    assert all(r["lightning_world_size"] == 2 and len(r["step_end"]) == 3 for r in res.ranks)
    assert {r["ifname"] for r in res.ranks} == {f"{res.prefix}e0", f"{res.prefix}e1"}
    s = cluster.summarize(res)
    # Dense gradients (~0.9 MB of fp32 per step) crossed the veth links: gloo used the limited interface.
    n_bytes = 4 * res.ranks[0]["n_params"]
    assert s["inter_node_bytes_per_step"] > n_bytes
    assert cluster.list_namespaces(res.prefix) == [] and cluster.list_links(res.prefix) == []
    assert _leftovers(before) == set()


@needs_netns
def test_failing_worker_is_reported_and_torn_down(tmp_path):
    before = _snapshot()
    with pytest.raises(cluster.ClusterError, match="exited with code"):
        cluster.run_cluster(["--strategy", "ddp", "--density", "7"], nodes=2, procs_per_node=1, rate="1gbit",
                            timeout=60, run_dir=str(tmp_path))
    assert _leftovers(before) == set()


@needs_netns
def test_sigint_tears_down(tmp_path):
    before = _snapshot()
    argv = [os.path.join(ROOT, "benchmarks", "cluster.py"), "--nodes", "2", "--procs-per-node", "1", "--rate",
            "10mbit", "--run-dir", str(tmp_path), "--", "--strategy", "ddp", "--steps", "1000", *TINY]
    main = (f"import sys; sys.path.insert(0, {os.path.join(ROOT, 'benchmarks')!r}); sys.argv = {argv!r}; "
            f"import cluster; cluster.NAME_PREFIX = {OWN!r}; sys.exit(cluster.main())")
    proc = subprocess.Popen([sys.executable, "-c", main],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len(_leftovers(before)) < 3:  # hub + 2 nodes
        time.sleep(0.1)
    assert len(_leftovers(before)) == 3, "namespaces never appeared"
    time.sleep(1.0)  # let the workers start
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "torn down" in err
    assert _leftovers(before) == set()


@needs_netns
def test_cleanup_removes_leftovers_by_prefix():
    c = cluster.NetnsCluster(nodes=2, rate_bits=100e6)
    c.setup()  # no teardown: simulate a run killed with SIGKILL
    assert len(cluster.list_namespaces(c.prefix)) == 3
    tc = subprocess.run(c.exec_prefix(0) + ["tc", "qdisc", "show", "dev", c.ifname(0)], capture_output=True,
                        text=True).stdout
    assert "tbf" in tc and "100Mbit" in tc
    removed = cluster.cleanup(c.prefix)
    assert sorted(removed) == sorted([c.hub, c.ns(0), c.ns(1)])
    assert cluster.list_namespaces(c.prefix) == []


def test_loopback_fallback_runs(tmp_path):
    res = cluster.run_cluster(["--strategy", "ddp", "--steps", "2", *TINY], nodes=2, procs_per_node=1,
                              rate="100mbit", timeout=120, run_dir=str(tmp_path), force_loopback=True, quiet=True)
    assert res.mode == "loopback" and res.reason
    assert [r["lightning_global_rank"] for r in res.ranks] == [0, 1]
    assert cluster.summarize(res)["inter_node_bytes_per_step"] is None
