"""``fault_tolerance="torchft"`` on real processes (gloo on loopback, a real torchft lighthouse): replica groups of
one process keep training while one is killed with SIGKILL, the killed one restarts, heals from a live peer and
rejoins, and at the end every replica holds the same parameters; an uncommitted step changes nothing; a missing
or unreachable lighthouse is a clear error within the connect timeout. The options' checks need no torchft."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from lightning_topk.comm.config import TopKConfig
from tests.helpers.dist import free_port
from tests.helpers.procs import ROOT, python_for

SCRIPT = ROOT / "tests" / "scripts" / "elastic_replica.py"


def test_options_are_checked():
    cfg = TopKConfig(fault_tolerance="torchft", lighthouse="http://h:1", min_replicas=2)
    assert cfg.elastic and cfg.min_replicas == 2 and isinstance(cfg.ft_timeout, float)
    assert not TopKConfig().elastic
    for bad, match in [(dict(fault_tolerance="yes"), "fault_tolerance"), (dict(min_replicas=0), "min_replicas"),
                       (dict(ft_timeout=0), "ft_timeout"), (dict(lighthouse=""), "lighthouse"),
                       (dict(ft_timeout=30, ft_quorum_timeout=10), "ft_quorum_timeout"),
                       (dict(fault_tolerance="torchft", exchange="hierarchical"), "exchange='hierarchical'"),
                       (dict(fault_tolerance="torchft", local_steps=4, outer_streaming=True), "outer_streaming=false"),
                       (dict(fault_tolerance="torchft", local_steps=4, outer_exchange="scatter"),
                        "outer_exchange='allgather'"),
                       (dict(fault_tolerance="torchft", local_steps=4, dense_steps=2), "dense_steps=0")]:
        with pytest.raises(ValueError, match=match):
            TopKConfig(**bad)
    assert TopKConfig(fault_tolerance="torchft", local_steps=4).local_steps == 4  # local SGD under torchft


def test_missing_or_unreachable_lighthouse_is_a_clear_error(monkeypatch):
    from lightning_topk.lightning.elastic import check_lighthouse, lighthouse_address

    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(ValueError, match="needs a torchft lighthouse.*TORCHFT_LIGHTHOUSE"):
        lighthouse_address(TopKConfig(fault_tolerance="torchft"))
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "127.0.0.1:29999")
    assert lighthouse_address(TopKConfig(fault_tolerance="torchft")) == "http://127.0.0.1:29999"
    port = free_port()  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match=f"no torchft lighthouse answers at http://127.0.0.1:{port}"):
        check_lighthouse(f"http://127.0.0.1:{port}", timeout=2.0)
    assert time.monotonic() - t0 < 2.5
    # a listener that accepts and never answers (a hung host, a half-open proxy): bounded by the timeout
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match="ft_connect_timeout=1"):
        check_lighthouse(f"http://127.0.0.1:{srv.getsockname()[1]}", timeout=1.0)
    assert time.monotonic() - t0 < 2.0
    srv.close()


def test_without_torchft_the_error_names_the_extra(monkeypatch):
    from lightning_topk.lightning.elastic import TorchFTReplica
    from lightning_topk.optional import MissingDependency

    monkeypatch.setitem(sys.modules, "torchft", None)  # as if not installed
    replica = TorchFTReplica(TopKConfig(fault_tolerance="torchft", lighthouse="http://127.0.0.1:1"), dict, print)
    with pytest.raises(MissingDependency, match=r"pip install 'lightning-topk\[ft\]'"):
        replica.check()


def test_trainer_without_lighthouse_fails_fast(tmp_path):
    pytest.importorskip("torchft")
    port = free_port()
    code = (
        "import pytorch_lightning as pl, torch, lightning_topk\n"
        "from tests.helpers.digits import DigitsNet\n"
        f"s = lightning_topk.TopKDDPStrategy(fault_tolerance='torchft', lighthouse='http://127.0.0.1:{port}', "
        "ft_connect_timeout=2)\n"
        "pl.Trainer(accelerator='cpu', devices=1, strategy=s, max_steps=1, logger=False, enable_checkpointing=False"
        ").fit(DigitsNet())\n")
    t0 = time.monotonic()
    script = tmp_path / "fit.py"
    script.write_text(f"import sys\nsys.path.insert(0, {str(ROOT)!r})\n" + code)
    exe, env = python_for(_env())
    p = subprocess.run([exe, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode != 0
    assert f"no torchft lighthouse answers at http://127.0.0.1:{port}" in p.stderr, p.stderr[-3000:]
    assert time.monotonic() - t0 < 60


def _env(**kw):
    e = dict(os.environ, OMP_NUM_THREADS="1", **kw)
    for k in ("LOCAL_RANK", "NODE_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR", "GROUP_RANK",
              "LOCAL_WORLD_SIZE", "PL_GLOBAL_SEED"):
        e.pop(k, None)
    return e


class Cluster:
    """A lighthouse from the documented launcher, and replica processes of tests/scripts/elastic_replica.py."""

    def __init__(self, tmp_path, min_replicas=1, script=SCRIPT):
        self.tmp, self.port, self.script = tmp_path, free_port(), script
        self.addr = f"http://127.0.0.1:{self.port}"
        exe, env = python_for(_env())
        self.lighthouse = subprocess.Popen(
            [exe, "-m", "lightning_topk.app.elastic_launch", "--bind", f"127.0.0.1:{self.port}",
             "--min_replicas", str(min_replicas), "--join_timeout_ms", "500", "--heartbeat_timeout_ms", "1500"],
            cwd=ROOT, env=env, stdout=open(tmp_path / "lighthouse.log", "w"), stderr=subprocess.STDOUT)
        self.procs = {}
        try:
            _wait(lambda: _listening(self.port), 90, "the lighthouse")
        except AssertionError:
            self.close()  # no Cluster object reaches the test's finally: stop the launcher here
            raise

    def start(self, r, *args, script=None):
        """Replica group ``r``: ``script`` with ``args``, or by default the cluster's script (tests/scripts/
        elastic_replica.py unless given) with ``--replica r --out DIR`` and ``args``."""
        log = open(self.tmp / f"replica{r}.{len([k for k in self.procs if k[0] == r])}.log", "w")
        # from a test zygote (torch and Lightning imported once: a replica starts in ~1 s, not ~15 s on 2 cores);
        # SIGKILL of the returned process kills the replica too (tests/helpers/zygote.py)
        exe, env = python_for(_env(TORCHFT_LIGHTHOUSE=self.addr, REPLICA_GROUP_ID=f"replica{r}"))
        cmd = ([str(self.script), "--replica", str(r), "--out", str(self.tmp)] if script is None else [str(script)])
        p = subprocess.Popen([exe, *cmd, *map(str, args)], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.procs[(r, p.pid)] = p
        return p

    def rows(self, r, suffix=""):
        path = self.tmp / f"replica{r}{suffix}.jsonl"
        if not path.exists():
            return []
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        rows = []
        for i, line in enumerate(lines):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                if i < len(lines) - 1:  # only the last line may be one the replica is still writing
                    raise
        return rows

    def close(self):
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        self.lighthouse.terminate()
        self.lighthouse.wait(timeout=10)


def _listening(port):
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


def _wait(cond, timeout, what):
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _logs(tmp_path):
    return "\n".join(f"--- {p.name}\n{p.read_text()[-2500:]}" for p in sorted(tmp_path.glob("*.log")))


def kill_and_restart_group(c, args, stop, ready, alone, extra, ranks=(".rank0", ".rank1"), solo=True,
                           rejoined=lambda rows: any(r["quorum"] == 2 for r in rows)):
    """Replica groups 0 and 1 of ``len(ranks)`` processes (``args``, with ``--stop-file stop``): once every process's
    last row passes ``ready``, SIGKILL every process of group 1; once group 0 has committed ``alone`` more steps
    (``solo``: its last quorum alone), restart group 1 (its earlier rows kept as ``*.before.jsonl``); once each of its
    processes' rows pass ``rejoined``, stop all ``extra`` steps later. Returns group 0's committed step at the kill
    and at the restart."""
    c.start(0, *args)
    victim = c.start(1, *args)
    _wait(lambda: all(c.rows(r, k) and ready(c.rows(r, k)[-1]) for r in (0, 1) for k in ranks), 240,
          "every process of both groups")
    for k in ranks:  # the whole group: all of its processes
        os.kill(int((c.tmp / f"replica1{k}.pid").read_text()), signal.SIGKILL)
    victim.wait(timeout=60)
    head = ranks[0]
    killed_at = c.rows(0, head)[-1]["ft_step"]
    _wait(lambda: c.rows(0, head)[-1]["ft_step"] >= killed_at + alone and (not solo or c.rows(0, head)[-1]["quorum"] == 1),
          120, "the survivor to step on alone")
    during = c.rows(0, head)[-1]["ft_step"]
    for k in ranks:
        os.rename(c.tmp / f"replica1{k}.jsonl", c.tmp / f"replica1{k}.before.jsonl")
    restarted = c.start(1, *args)
    _wait(lambda: all(rejoined(c.rows(1, k)) for k in ranks), 240, "the group to rejoin")
    stop.write_text(str(max(c.rows(r, k)[-1]["ft_step"] for r in (0, 1) for k in ranks) + extra))
    for p in (c.procs[next(k for k in c.procs if k[0] == 0)], restarted):
        assert p.wait(timeout=180) == 0, _logs(c.tmp)
    return killed_at, during


@pytest.mark.timeout(240)
def test_uncommitted_step_changes_nothing(tmp_path):
    pytest.importorskip("torchft")
    c = Cluster(tmp_path)
    try:
        p = c.start(0, "--steps", "6", "--refuse-at", "3")
        assert p.wait(timeout=180) == 0, _logs(tmp_path)
    finally:
        c.close()
    rows = c.rows(0)
    refused = [r for r in rows if "unchanged" in r]
    assert len(refused) == 1, rows
    assert refused[0]["unchanged"] and refused[0]["residuals_checked"] > 0, refused
    assert refused[0]["ft_step"] == 3 and refused[0]["uncommitted"] == 1
    assert rows[-1]["ft_step"] == 6 and rows[-1]["global_step"] == 7  # 7 attempts, 6 committed


@pytest.mark.timeout(240)
def test_quorum_below_min_replicas_waits_then_fails_clearly(tmp_path):
    pytest.importorskip("torchft")
    c = Cluster(tmp_path, min_replicas=2)
    try:  # the strategy's min_replicas is the default 1: the lighthouse's 2 is what the quorum waits for
        p = c.start(0, "--steps", "3", "--quorum-timeout", "5")
        assert p.wait(timeout=180) != 0
    finally:
        c.close()
    log = (tmp_path / "replica0.0.log").read_text()
    assert ("torchft quorum failed for replica group 'replica0' at step 0" in log
            and "fewer replica groups joined the lighthouse http://127.0.0.1:" in log
            and "within ft_quorum_timeout=5 s" in log
            and "the strategy's min_replicas=1 and the lighthouse's own --min_replicas" in log), log[-3000:]
    assert not c.rows(0)  # no step ran


@pytest.mark.timeout(240)
def test_heal_that_does_not_fit_names_the_mismatch(tmp_path):
    """Two replica groups started with different model widths: the group that heals at step 0 receives a state that
    does not fit; its error names the entries and their shapes (before: 'fewer than min_replicas joined ... or the
    lighthouse is gone')."""
    pytest.importorskip("torchft")
    c = Cluster(tmp_path, min_replicas=2)  # both in the first quorum: one of them heals from the other at step 0
    try:
        procs = [c.start(r, "--steps", 3, "--width", 256 if r == 0 else 128, "--min-replicas", 2,
                         "--quorum-timeout", 10) for r in (0, 1)]
        codes = [p.wait(timeout=180) for p in procs]
    finally:
        c.close()
    logs = [(tmp_path / f"replica{r}.0.log").read_text() for r in (0, 1)]
    healed = [r for r in (0, 1) if "could not apply it" in logs[r]]
    assert len(healed) == 1 and codes[healed[0]] != 0, (codes, _logs(tmp_path))
    log = logs[healed[0]]
    assert "the peer's module state does not fit this model (net.0.weight: (" in log, log[-3000:]
    assert "another model width or configuration" in log and "fewer replica groups joined" not in log


@pytest.mark.timeout(300)
@pytest.mark.parametrize("exchange,optimizer", [("allgather", "adamw"), ("scatter", "adamw"), ("allgather", "sgd")])
def test_kill_one_of_three_replica_groups_heal_and_rejoin(tmp_path, exchange, optimizer):
    """3 replica groups of 1 process: SIGKILL one mid-run; the two others keep committing steps during the outage;
    the killed one is restarted, heals from a live peer (nothing read from disk; its data position included) and
    rejoins; at the end all three hold identical parameters. The scale-free exchange too: its owners' layout follows
    the quorum (3, 2, 3). And SGD with momentum and weight decay, where recipe="auto" has moved the momentum into
    the hook: the healed group takes that over from its first step (else its weight decay differs from its peers')."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchft")
    delay, stop = 0.1, tmp_path / "stop_at"
    c = Cluster(tmp_path, min_replicas=2)
    args = ("--steps", 100000, "--delay", delay, "--init-differs", "--stop-file", stop, "--positioned-data",
            "--exchange", exchange, "--optimizer", optimizer)
    try:
        procs = [c.start(r, *args) for r in range(3)]
        _wait(lambda: all(c.rows(r) and c.rows(r)[-1]["ft_step"] >= 10 for r in range(3)), 150, "10 steps on all")
        os.kill(procs[1].pid, signal.SIGKILL)
        procs[1].wait()
        killed_at = max(c.rows(0)[-1]["ft_step"], c.rows(2)[-1]["ft_step"])
        t_kill = time.time()
        time.sleep(3.0)  # the outage: the survivors step on without it
        during = min(c.rows(0)[-1]["ft_step"], c.rows(2)[-1]["ft_step"])
        os.rename(tmp_path / "replica1.jsonl", tmp_path / "replica1.before.jsonl")
        restarted = c.start(1, *args)
        _wait(lambda: any(r["quorum"] == 3 for r in c.rows(1)), 150, "the restarted replica to rejoin")
        end = max(c.rows(r)[-1]["ft_step"] for r in range(3)) + 10
        stop.write_text(str(end))
        for p in (procs[0], procs[2], restarted):
            assert p.wait(timeout=120) == 0, _logs(tmp_path)
    finally:
        c.close()
    logs = _logs(tmp_path)
    assert during > killed_at + 3, (killed_at, during, logs)  # the survivors advanced during the outage
    outage = [r for r in c.rows(0) if r["t"] > t_kill and r["quorum"] == 2]
    assert outage, "no step ran with the quorum of 2"
    back = c.rows(1)
    assert back[-1]["heals"] == 1 and back[-1]["heal_time_s"] > 0, back[-3:]
    first = back[0]
    assert first["ft_step"] >= during, (first, during)  # it took the peers' step count: healed, not restarted at 0
    assert first["global_step"] > 1 and back[-1]["global_step"] == c.rows(0)[-1]["global_step"]  # Lightning's too
    # the data position came with the heal: it trains on the batch index (and epoch) its peers train at each step
    peer = {x["global_step"]: x["data_pos"] for x in c.rows(0)}
    assert first["data_position"]["batch"] > 0 and first["data_pos"] != [0, 0], first
    assert all(x["data_pos"] == peer[x["global_step"]] for x in back if x["global_step"] in peer), back[:3]
    rejoined = [r for r in c.rows(0) if r["t"] > t_kill and r["quorum"] == 3]
    assert rejoined, "the restarted replica never rejoined the quorum"
    finals = [torch.load(tmp_path / f"replica{r}.pt") for r in range(3)]
    for f in finals[1:]:
        for k, v in finals[0]["params"].items():
            assert torch.equal(v, f["params"][k]), k
    assert all(f["metrics"]["ft/step"] == end for f in finals)
    assert all(f["metrics"]["ft/residual_mass"] > 0 for f in finals)  # each holds its own unsent mass
    # the survivors counted the lost replica and noted their own unsent mass at the loss
    assert all(finals[r]["metrics"]["ft/replicas_lost"] >= 1 and finals[r]["metrics"]["ft/residual_mass_at_loss"] > 0
               for r in (0, 2)), [f["metrics"] for f in finals]
    report = dict(killed_at=killed_at, steps_during_outage=during - killed_at, heal_time_s=back[-1]["heal_time_s"],
                  healed_at_step=first["ft_step"], uncommitted=[c.rows(r)[-1]["uncommitted"] for r in (0, 2)],
                  quorum_changes=[c.rows(r)[-1]["quorum_changes"] for r in (0, 2)])
    print("ELASTIC", json.dumps(report))


@pytest.mark.timeout(240)
def test_kill_mid_step_survivors_roll_back_and_go_on(tmp_path):
    """No sleep between steps, so the SIGKILL usually lands inside a step's collectives: a survivor whose all-gather
    or decision all-reduce failed reports it to torchft, its step is not committed and changes nothing; the two
    survivors go on with a quorum of 2 and end with identical parameters."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchft")
    stop = tmp_path / "stop_at"
    c = Cluster(tmp_path, min_replicas=2)
    args = ("--steps", 100000, "--delay", 0, "--init-differs", "--stop-file", stop)
    try:
        procs = [c.start(r, *args) for r in range(3)]
        _wait(lambda: all(c.rows(r) and c.rows(r)[-1]["ft_step"] >= 30 for r in range(3)), 150, "30 steps on all")
        os.kill(procs[1].pid, signal.SIGKILL)
        procs[1].wait()
        _wait(lambda: all(c.rows(r)[-1]["quorum"] == 2 for r in (0, 2)), 60, "a quorum of 2")
        stop.write_text(str(max(c.rows(r)[-1]["ft_step"] for r in (0, 2)) + 20))
        for p in (procs[0], procs[2]):
            assert p.wait(timeout=120) == 0, _logs(tmp_path)
    finally:
        c.close()
    last = [c.rows(r)[-1] for r in (0, 2)]
    assert last[0]["ft_step"] == last[1]["ft_step"] and all(r["quorum"] == 2 for r in last), last
    assert all(r["uncommitted"] <= 1 for r in last), last  # at most the step the kill interrupted
    finals = [torch.load(tmp_path / f"replica{r}.pt") for r in (0, 2)]
    for k, v in finals[0]["params"].items():
        assert torch.equal(v, finals[1]["params"][k]), k
    print("ELASTIC_MID", json.dumps({"uncommitted": [r["uncommitted"] for r in last],
                                     "failed_collectives": [f["metrics"]["ft/failed_collectives"] for f in finals]}))


FABRIC = ROOT / "tests" / "scripts" / "fabric_elastic.py"


def test_fabric_refusals_name_the_option():
    import torch

    from lightning_topk.lightning.elastic import TorchFTReplica
    from lightning_topk.lightning.fabric import FabricTopKDDPStrategy

    s = FabricTopKDDPStrategy(fault_tolerance="torchft")
    s.topk_elastic = TorchFTReplica(s.topk_config, dict, print)
    with pytest.raises(ValueError, match=r"fabric.setup\(model, optimizer"):
        s.setup_module(torch.nn.Linear(2, 2))
    net = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="takes one optimizer"):
        s.setup_module_and_optimizers(net, [torch.optim.SGD(net.parameters(), 0.1), torch.optim.SGD(net.parameters(), 0.1)])


@pytest.mark.timeout(240)
def test_fabric_uncommitted_step_changes_nothing(tmp_path):
    """Fabric (the standalone lightning_fabric package): the step torchft refuses leaves parameters, optimizer state
    and residuals bitwise as they were; the loop, which reads the committed step, replays its batch."""
    pytest.importorskip("torchft")
    c = Cluster(tmp_path, script=FABRIC)
    try:
        p = c.start(0, "--steps", 6, "--refuse-at", 3, "--package", "lightning_fabric")
        assert p.wait(timeout=180) == 0, _logs(tmp_path)
    finally:
        c.close()
    rows = c.rows(0)
    refused = [r for r in rows if "unchanged" in r]
    assert len(refused) == 1 and refused[0]["unchanged"] and refused[0]["residuals_checked"] > 0, refused
    assert refused[0]["ft_step"] == 3 and refused[0]["uncommitted"] == 1
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 3, 4, 5] and rows[-1]["ft_step"] == 6


@pytest.mark.timeout(300)
def test_fabric_kill_one_of_three_heal_and_rejoin(tmp_path):
    """Fabric, 3 replica groups of 1 process: SIGKILL one mid-run; the others keep committing steps; the killed one
    is restarted, heals from a live peer inside fabric.setup (in place: the module keeps its tensors), rejoins
    within a few steps and trains at the peers' step; at the end all hold identical parameters and optimizer
    state."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchft")
    stop = tmp_path / "stop_at"
    c = Cluster(tmp_path, min_replicas=2, script=FABRIC)
    args = ("--steps", 100000, "--delay", 0.1, "--init-differs", "--stop-file", stop)
    try:
        procs = [c.start(r, *args) for r in range(3)]
        _wait(lambda: all(c.rows(r) and c.rows(r)[-1]["ft_step"] >= 10 for r in range(3)), 150, "10 steps on all")
        os.kill(procs[1].pid, signal.SIGKILL)
        procs[1].wait()
        killed_at = max(c.rows(r)[-1]["ft_step"] for r in (0, 2))
        t_kill = time.monotonic()
        _wait(lambda: min(c.rows(r)[-1]["ft_step"] for r in (0, 2)) >= killed_at + 5, 90, "5 steps without it")
        during, outage_s = min(c.rows(r)[-1]["ft_step"] for r in (0, 2)), time.monotonic() - t_kill
        os.rename(tmp_path / "replica1.jsonl", tmp_path / "replica1.before.jsonl")
        restarted = c.start(1, *args)
        _wait(lambda: c.rows(1), 150, "the restarted replica's first step")
        stop.write_text(str(max(c.rows(r)[-1]["ft_step"] for r in range(3)) + 10))
        for p in (procs[0], procs[2], restarted):
            assert p.wait(timeout=120) == 0, _logs(tmp_path)
    finally:
        c.close()
    assert during >= killed_at + 5, (killed_at, during)  # the survivors stepped on without it
    assert any(r["quorum"] == 2 for r in c.rows(0)), "no step ran with the quorum of 2"
    back, peer = c.rows(1), c.rows(0)
    assert back[0]["heals"] == 1 and back[0]["heal_time_s"] > 0 and back[0]["step"] >= during, back[0]
    assert any(r["quorum"] == 3 for r in back) and all(r["ptrs_kept"] for r in back), back[:3]
    # bounded rejoin: the peers' committed steps between its fabric.setup and its first step
    t_setup = float((tmp_path / "replica1.setup").read_text())
    at_setup = max([r["ft_step"] for r in peer if r["t"] <= t_setup] or [0])
    assert back[0]["step"] - at_setup <= 20, (at_setup, back[0])
    assert {r["step"] for r in back} <= {r["step"] for q in (0, 2) for r in c.rows(q)}  # the peers' steps
    finals = [torch.load(tmp_path / f"replica{r}.pt") for r in range(3)]
    for f in finals[1:]:
        assert f["params"].keys() == finals[0]["params"].keys() and len(f["opt"]) == len(finals[0]["opt"]) > 0
        assert all(torch.equal(v, f["params"][k]) for k, v in finals[0]["params"].items())
        assert all(torch.equal(v, s[k]) for s0, s in zip(finals[0]["opt"], f["opt"]) for k, v in s0.items())
    print("ELASTIC_FABRIC", json.dumps(dict(killed_at=killed_at, steps_during_outage=during - killed_at, outage_s=outage_s,
                                            heal_time_s=back[0]["heal_time_s"], healed_at_step=back[0]["step"],
                                            steps_from_setup_to_first_step=back[0]["step"] - at_setup)))


@pytest.mark.timeout(300)
def test_fabric_two_groups_of_two_processes_heal_and_agree(tmp_path):
    """Fabric, 2 replica groups of 2 processes (each process its own batches): the second group starts late, both
    its ranks heal from the first group mid-run and it joins; all four processes end with identical parameters
    and optimizer state (the group's ranks agree through the same sync as the Trainer's)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchft")
    stop = tmp_path / "stop_at"
    c = Cluster(tmp_path, script=FABRIC)
    args = ("--steps", 100000, "--delay", 0.05, "--init-differs", "--stop-file", stop, "--devices", 2)
    ranks = (".rank0", ".rank1")
    try:
        first = c.start(0, *args)
        _wait(lambda: all(c.rows(0, k) and c.rows(0, k)[-1]["ft_step"] >= 5 for k in ranks), 180, "5 steps")
        late = c.start(1, *args)
        _wait(lambda: all(c.rows(1, k) for k in ranks), 180, "the late group's first step")
        stop.write_text(str(max(c.rows(r, k)[-1]["ft_step"] for r in (0, 1) for k in ranks) + 5))
        for p in (first, late):
            assert p.wait(timeout=180) == 0, _logs(tmp_path)
    finally:
        c.close()
    assert all(c.rows(1, k)[0]["heals"] == 1 and c.rows(1, k)[0]["step"] >= 5 for k in ranks), c.rows(1)
    finals = [torch.load(tmp_path / f"replica{r}{k}.pt") for r in (0, 1) for k in ranks]
    for f in finals[1:]:
        assert all(torch.equal(v, f["params"][n]) for n, v in finals[0]["params"].items())
        assert all(torch.equal(v, s[n]) for s0, s in zip(finals[0]["opt"], f["opt"]) for n, v in s0.items())


@pytest.mark.timeout(300)
def test_fabric_local_sgd_kill_one_of_three_heal_and_rejoin(tmp_path):
    """Fabric, local SGD under torchft (H = 4), 3 replica groups of 1 process: SIGKILL one; the survivors' rounds go
    on committing; the restarted one joins at their next round (inside fabric.setup) and its loop continues at their
    inner step (topk_elastic_position); at the end all three hold identical parameters and outer state."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchft")
    stop = tmp_path / "stop_at"
    c = Cluster(tmp_path, min_replicas=2, script=FABRIC)
    args = ("--steps", 100000, "--delay", 0.05, "--init-differs", "--stop-file", stop, "--local-steps", 4,
            "--min-replicas", 2)
    try:
        procs = [c.start(r, *args) for r in range(3)]
        _wait(lambda: all(c.rows(r) and c.rows(r)[-1]["ft_step"] >= 4 for r in range(3)), 150, "4 rounds on all")
        os.kill(procs[1].pid, signal.SIGKILL)
        procs[1].wait()
        killed_at = max(c.rows(r)[-1]["ft_step"] for r in (0, 2))
        _wait(lambda: min(c.rows(r)[-1]["ft_step"] for r in (0, 2)) >= killed_at + 3, 90, "3 rounds without it")
        os.rename(tmp_path / "replica1.jsonl", tmp_path / "replica1.before.jsonl")
        restarted = c.start(1, *args)
        _wait(lambda: c.rows(1), 150, "the restarted replica's first step")
        stop.write_text(str(max(c.rows(r)[-1]["ft_step"] for r in range(3)) + 3))
        for p in (procs[0], procs[2], restarted):
            assert p.wait(timeout=120) == 0, _logs(tmp_path)
    finally:
        c.close()
    assert any(x["quorum"] == 2 and x["contributors"] == 2 for x in c.rows(0)), "no round of 2 contributors"
    back, peer = c.rows(1), {x["step"]: x for q in (0, 2) for x in c.rows(q)}
    assert back[0]["heals"] == 1 and back[0]["step"] > 0 and back[0]["step"] % 4 == 0, back[0]  # at a round start
    assert all(x["step"] in peer and x["rounds"] == peer[x["step"]]["rounds"] for x in back), back[:3]
    finals = [torch.load(tmp_path / f"replica{r}.pt") for r in range(3)]
    for f in finals[1:]:
        assert all(torch.equal(v, f["params"][k]) for k, v in finals[0]["params"].items())
        assert all(torch.equal(finals[0]["outer"][k], f["outer"][k]) for k in ("theta", "mom"))
        assert all(finals[0]["outer"][k] == f["outer"][k] for k in ("rounds", "position", "steps"))
    print("ELASTIC_FABRIC_LOCAL", json.dumps(dict(killed_at_round=killed_at, heal_time_s=back[0]["heal_time_s"],
                                                  joined_at_step=back[0]["step"])))


@pytest.mark.timeout(240)
def test_fabric_dense_matches_fabric_ddp(tmp_path):
    """No failure, density 1 (fp32 values), exchange="dense": Fabric under torchft with 2 replica groups ends where Lightning Fabric's own
    "ddp" on 2 processes ends, on the same batches (rank r = replica r)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchft")
    c = Cluster(tmp_path, min_replicas=2, script=FABRIC)
    try:
        procs = [c.start(r, "--steps", 8, "--density", 1, "--exchange", "dense", "--min-replicas", 2) for r in (0, 1)]
        procs.append(c.start(9, "--steps", 8, "--reference"))
        for p in procs:
            assert p.wait(timeout=200) == 0, _logs(tmp_path)
    finally:
        c.close()
    worst = 0.0
    for r in (0, 1):
        ft, ref = (torch.load(tmp_path / f"replica{r}{s}.pt")["params"] for s in ("", ".ref"))
        for k, v in ref.items():
            assert torch.allclose(ft[k], v, rtol=1e-5, atol=1e-6), (k, (ft[k] - v).abs().max())
            worst = max(worst, float((ft[k] - v).abs().max()))
        assert all(q == 2 for q in (x["quorum"] for x in c.rows(r)))
    print("ELASTIC_FABRIC_DENSE", json.dumps({"max_abs_diff": worst}))


@pytest.mark.timeout(420)
def test_two_groups_of_two_processes_kill_heal_rejoin(tmp_path):
    """2 replica groups of 2 processes (Lightning DDP inside a group, torchft between the groups, per local rank):
    SIGKILL both processes of one group; the other keeps stepping alone; the killed group is restarted, heals
    from the live one and rejoins; at the end all four processes hold identical parameters."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchft")
    stop = tmp_path / "stop_at"
    c = Cluster(tmp_path)
    args = ("--steps", 100000, "--delay", 0.1, "--init-differs", "--stop-file", stop, "--devices", 2)
    ranks = [".rank0", ".rank1"]
    try:
        killed_at, during = kill_and_restart_group(c, args, stop, lambda row: row["ft_step"] >= 8, 5, 8)
    finally:
        c.close()
    back = [c.rows(1, k) for k in ranks]
    assert all(b[0]["heals"] == 1 and b[0]["ft_step"] >= during for b in back), [b[0] for b in back]
    finals = [torch.load(tmp_path / f"replica{r}{k}.pt") for r in (0, 1) for k in ranks]
    for f in finals[1:]:
        for name, v in finals[0]["params"].items():
            assert torch.equal(v, f["params"][name]), name
    print("ELASTIC_2x2", json.dumps({"killed_at": killed_at, "steps_alone": during - killed_at,
                                     "heal_time_s": [b[-1]["heal_time_s"] for b in back]}))


@pytest.mark.timeout(120)
def test_launcher_starts_replicas_and_restarts_a_failed_one(tmp_path):
    """elastic_launch: the lighthouse bound to --bind, --replicas copies of the command with TORCHFT_LIGHTHOUSE and
    REPLICA_GROUP_ID, a failed copy restarted (within --max_restarts)."""
    pytest.importorskip("torchft")
    port = free_port()
    child = tmp_path / "child.py"
    child.write_text(
        "import os, pathlib, sys\n"
        f"d = pathlib.Path({str(tmp_path)!r})\n"
        "rid = os.environ['REPLICA_GROUP_ID']\n"
        "(d / f'{rid}.{os.getpid()}').write_text(os.environ['TORCHFT_LIGHTHOUSE'])\n"
        "first = not (d / f'{rid}.ran').exists()\n"
        "(d / f'{rid}.ran').write_text('')\n"
        "sys.exit(3 if rid == 'replica1' and first else 0)\n")
    exe, env = python_for(_env())  # the launcher from a zygote, as in Cluster (its replicas: this interpreter)
    p = subprocess.run([exe, "-m", "lightning_topk.app.elastic_launch", "--bind", f"127.0.0.1:{port}",
                        "--replicas", "2", "--max_restarts", "1", "--", sys.executable, str(child)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=100)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert f"TORCHFT_LIGHTHOUSE=http://127.0.0.1:{port}" in p.stdout
    assert "replica1 exited with 3; restart 1/1" in p.stdout
    runs = {}
    for f in tmp_path.glob("replica*.*"):
        if f.suffix != ".ran":
            assert f.read_text() == f"http://127.0.0.1:{port}"
            runs[f.name.split(".")[0]] = runs.get(f.name.split(".")[0], 0) + 1
    assert runs == {"replica0": 1, "replica1": 2}, runs
    assert not _listening(port)  # the lighthouse is gone with the launcher


@pytest.mark.timeout(120)
def test_launcher_refuses_a_busy_address_and_stops_on_sigterm(tmp_path):
    """elastic_launch without a command (the SLURM example's lighthouse step): a second launcher on the same --bind
    fails naming the address (it would otherwise take the first lighthouse for its own); SIGTERM stops the
    lighthouse and the launcher exits 0."""
    pytest.importorskip("torchft")
    port = free_port()
    exe, env = python_for(_env())  # the launcher from a zygote, as in Cluster
    cmd = [exe, "-m", "lightning_topk.app.elastic_launch", "--bind", f"127.0.0.1:{port}"]
    first = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in first.stdout:  # the lighthouse's own log lines come first
            if line.startswith("TORCHFT_LIGHTHOUSE="):
                assert line.strip() == f"TORCHFT_LIGHTHOUSE=http://127.0.0.1:{port}"
                break
        second = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert second.returncode != 0 and f"127.0.0.1:{port} is in use" in second.stderr, second.stderr[-2000:]
        assert first.poll() is None and _listening(port)
        assert _terminate(first, 30) == 0
    finally:
        _terminate(first, 5)  # (exited already, unless an assertion above failed)
    assert not _listening(port)


@pytest.mark.timeout(120)
def test_launcher_passes_sigterm_to_its_replicas_and_refuses_fewer_replicas_than_min(tmp_path):
    """elastic_launch with a command: SIGTERM reaches every replica, the launcher waits for them and exits 0 (before:
    143, the replicas left running); --replicas below --min_replicas is refused before anything starts, naming
    both; each replica's environment names the lighthouse's --min_replicas."""
    pytest.importorskip("torchft")
    port = free_port()
    child = tmp_path / "child.py"
    child.write_text(
        "import os, pathlib, signal, sys, time\n"
        f"d = pathlib.Path({str(tmp_path)!r})\n"
        "rid = os.environ['REPLICA_GROUP_ID']\n"
        "def term(*_):\n"
        "    (d / f'{rid}.term').write_text('')\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, term)\n"
        "(d / f'{rid}.up').write_text(os.environ['TORCHFT_LIGHTHOUSE_MIN_REPLICAS'])\n"
        "time.sleep(600)\n")
    exe, env = python_for(_env())  # the launcher from a zygote, as in Cluster (its replicas: this interpreter)
    cmd = [exe, "-m", "lightning_topk.app.elastic_launch", "--bind", f"127.0.0.1:{port}"]
    bad = subprocess.run([*cmd, "--min_replicas", "2", "--replicas", "1", "--", sys.executable, str(child)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--replicas 1 is fewer than --min_replicas 2" in bad.stderr, bad.stderr[-2000:]
    assert not list(tmp_path.glob("*.up")) and not _listening(port)
    launcher = subprocess.Popen([*cmd, "--min_replicas", "2", "--replicas", "2", "--", sys.executable, str(child)],
                                cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait(lambda: len(list(tmp_path.glob("*.up"))) == 2, 60, "both replicas")
        assert {f.read_text() for f in tmp_path.glob("*.up")} == {"2"}
        assert _terminate(launcher, 60) == 0
    finally:
        _terminate(launcher, 5)
    assert sorted(f.name for f in tmp_path.glob("*.term")) == ["replica0.term", "replica1.term"]
    assert not _listening(port)


def _terminate(proc, timeout):
    """SIGTERM ``proc`` and wait up to ``timeout`` s for its exit status; killed (None) if it does not exit."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None


def _local_args(stop, *extra):
    return ("--steps", 100000, "--delay", 0.05, "--init-differs", "--stop-file", stop, "--local-steps", 4,
            "--min-replicas", 2, "--positioned-data", *extra)


@pytest.mark.timeout(420)
def test_local_sgd_kill_one_of_three_heal_and_rejoin(tmp_path):
    """Local SGD under torchft (H = 4, 5% at 8 bits, DiLoCo's outer step with momentum), 3 replica groups of 1
    process: SIGKILL one mid-run; the two survivors' outer rounds go on committing with R = 2; the killed one is
    restarted, heals from a peer at the survivors' next round (outer state and data position included) and
    rejoins; at the end all three hold identical parameters and identical outer state (θ_outer, outer momentum,
    round, position and step counts; the error feedback is each replica's own)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchft")
    stop = tmp_path / "stop_at"
    c = Cluster(tmp_path, min_replicas=2)
    args = _local_args(stop)
    try:
        procs = [c.start(r, *args) for r in range(3)]
        _wait(lambda: all(c.rows(r) and c.rows(r)[-1]["ft_step"] >= 4 and c.rows(r)[-1]["quorum"] == 3
                          for r in range(3)), 270, "4 committed rounds of 3 replicas on all")  # 150 s: short once
        # in a CI run beside a busy worker (three replica groups start at once); 14 s alone
        os.kill(procs[1].pid, signal.SIGKILL)
        procs[1].wait()
        killed_at = max(c.rows(r)[-1]["ft_step"] for r in (0, 2))
        t_kill = time.time()
        _wait(lambda: min(c.rows(r)[-1]["ft_step"] for r in (0, 2)) >= killed_at + 3, 90, "3 rounds without it")
        during = min(c.rows(r)[-1]["ft_step"] for r in (0, 2))
        os.rename(tmp_path / "replica1.jsonl", tmp_path / "replica1.before.jsonl")
        restarted = c.start(1, *args)
        _wait(lambda: any(r["quorum"] == 3 for r in c.rows(1)), 150, "the restarted replica to rejoin")
        end = max(c.rows(r)[-1]["ft_step"] for r in range(3)) + 3
        stop.write_text(str(end))
        for p in (procs[0], procs[2], restarted):
            assert p.wait(timeout=120) == 0, _logs(tmp_path)
    finally:
        c.close()
    rows = {r: c.rows(r) for r in range(3)}
    # the survivors' rounds during the outage: committed, averaged over 2 contributing replicas
    outage = [x for x in rows[0] if x["t"] > t_kill and x["quorum"] == 2 and x["position"] == 0]
    assert during >= killed_at + 3 and outage and all(x["contributors"] == 2 for x in outage), (killed_at, during)
    assert all(rows[r][-1]["replicas_lost"] >= 1 for r in (0, 2))
    # each survivor's own unsent mass; a survivor that started late joined by a heal (its error feedback empty)
    # and may not have contributed a round before the kill
    on_time = [r for r in (0, 2) if not rows[r][0]["data_position"].get("batch")]
    assert on_time and all(rows[r][-1]["residual_mass_at_loss"] > 0 for r in on_time), on_time
    back = rows[1]
    first = back[0]
    assert first["heals"] == 1 and first["ft_step"] >= during, first  # healed at the peers' round count
    # data position: the restarted replica trains on the batch index (and epoch) its peers train at each step
    peer = {x["global_step"]: x["data_pos"] for x in rows[0]}
    assert first["data_position"]["batch"] > 0
    off = [(x["global_step"], x["data_pos"], x["ft_step"], [(y["data_pos"], y["ft_step"], y.get("round_uncommitted"))
                                                             for y in rows[0] if y["global_step"] == x["global_step"]])
           for x in back if x["global_step"] in peer and x["data_pos"] != peer[x["global_step"]]]
    assert not off, off[:4]  # (step, its position, its round, the peer's rows at that step)
    assert back[-1]["global_step"] == rows[0][-1]["global_step"]
    finals = [torch.load(tmp_path / f"replica{r}.pt") for r in range(3)]
    for f in finals[1:]:
        for k, v in finals[0]["params"].items():
            assert torch.equal(v, f["params"][k]), k
        for k in ("theta", "mom"):
            assert torch.equal(finals[0]["outer"][k], f["outer"][k]), k
        for k in ("rounds", "position", "steps"):
            assert finals[0]["outer"][k] == f["outer"][k], k
    assert finals[0]["outer"]["mom"].abs().sum() > 0  # the outer momentum is live (DiLoCo's step)
    assert all(f["metrics"]["ft/step"] == end for f in finals)
    report = dict(killed_at_round=killed_at, rounds_during_outage=during - killed_at,
                  heal_time_s=back[-1]["heal_time_s"], healed_at_round=first["ft_step"],
                  joined_at=first["data_position"], round_uncommitted=[rows[r][-1]["round_uncommitted"] for r in (0, 2)],
                  residual_mass_at_loss=[rows[r][-1]["residual_mass_at_loss"] for r in (0, 2)])
    print("ELASTIC_LOCAL", json.dumps(report))


@pytest.mark.timeout(240)
def test_local_sgd_uncommitted_round_rolls_back_then_heals(tmp_path):
    """Local SGD under torchft, 2 replica groups: replica 0 reports an error in the round that would commit round
    4, so its should_commit says no: θ_outer, outer momentum, error feedback, round count and parameters are
    bitwise what they were before the round. Replica 1 commits it; at the next round replica 0, one round behind,
    heals from it (keeping its own error feedback) and both end identical."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchft")
    c = Cluster(tmp_path, min_replicas=2)
    stop = tmp_path / "stop_at"
    stop.write_text("8")
    try:
        procs = [c.start(0, *_local_args(stop, "--refuse-round", 4)), c.start(1, *_local_args(stop))]
        for p in procs:
            assert p.wait(timeout=200) == 0, _logs(tmp_path)
    finally:
        c.close()
    rows0, rows1 = c.rows(0), c.rows(1)
    refused = [x for x in rows0 if "round_unchanged" in x]
    assert len(refused) == 1 and refused[0]["round_unchanged"], refused
    assert refused[0]["round_uncommitted"] == 1 and refused[0]["ft_step"] == 3, refused
    assert rows1[-1]["round_uncommitted"] == 0
    at = rows0.index(refused[0])
    assert rows0[-1]["heals"] == rows0[at]["heals"] + 1  # it healed from replica 1 at the next round
    finals = [torch.load(tmp_path / f"replica{r}.pt") for r in (0, 1)]
    for k, v in finals[0]["params"].items():
        assert torch.equal(v, finals[1]["params"][k]), k
    for k in ("theta", "mom"):
        assert torch.equal(finals[0]["outer"][k], finals[1]["outer"][k]), k
    assert finals[0]["outer"]["rounds"] == finals[1]["outer"]["rounds"]


@pytest.mark.timeout(240)
def test_local_sgd_dense_matches_torch_averaging(tmp_path):
    """At dense settings (outer density 1, fp32 values) and no failure, local SGD under torchft over 2 replica
    groups equals local SGD written with torch alone: each replica runs H AdamW steps on its own batches (the
    same loader order), then θ_outer takes DiLoCo's outer step (SGD, lr 0.7, Nesterov momentum 0.9) on the mean
    of the replicas' θ_outer − θ_local, and every replica starts the next round from θ_outer."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchft")
    from torch import nn

    from tests.helpers.digits import digits

    H, rounds = 4, 3
    c = Cluster(tmp_path, min_replicas=2)
    stop = tmp_path / "stop_at"
    stop.write_text(str(rounds + 1))  # the join round (nothing sent) commits too
    args = ("--steps", 100000, "--stop-file", stop, "--local-steps", H, "--min-replicas", 2, "--positioned-data",
            "--outer-density", 1.0, "--outer-bits", 32)
    try:
        procs = [c.start(r, *args) for r in (0, 1)]
        for p in procs:
            assert p.wait(timeout=200) == 0, _logs(tmp_path)
    finally:
        c.close()
    finals = [torch.load(tmp_path / f"replica{r}.pt") for r in (0, 1)]
    assert all(c.rows(r)[-1]["global_step"] == H * rounds for r in (0, 1))

    # the same with torch alone
    x, y = digits()[0].tensors

    def batches(replica):
        epoch, b = 0, 0
        while True:
            order = torch.randperm(len(x), generator=torch.Generator().manual_seed(1000 + 7919 * replica + epoch))
            n = -(-len(x) // 32)
            if b >= n:
                epoch, b = epoch + 1, 0
                continue
            idx = order[b * 32:(b + 1) * 32]
            yield x[idx], y[idx]
            b += 1

    torch.manual_seed(0)
    net0 = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    nets = [net0, nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))]
    nets[1].load_state_dict(net0.state_dict())
    opts = [torch.optim.AdamW(n.parameters(), lr=3e-3) for n in nets]
    data = [batches(r) for r in (0, 1)]
    outer = [p.detach().clone() for p in net0.parameters()]
    mom = [torch.zeros_like(p) for p in outer]
    for _ in range(rounds):
        for net, opt, it in zip(nets, opts, data):
            for _ in range(H):
                xb, yb = next(it)
                opt.zero_grad()
                nn.functional.cross_entropy(net(xb), yb).backward()
                opt.step()
        for i, theta in enumerate(outer):
            g = sum(theta - list(n.parameters())[i].detach() for n in nets) / 2
            mom[i].mul_(0.9).add_(g)
            theta.sub_(g.add(mom[i], alpha=0.9), alpha=0.7)
        with torch.no_grad():
            for n in nets:
                for p, theta in zip(n.parameters(), outer):
                    p.copy_(theta)
    ref = dict(zip([k for k, _ in net0.named_parameters()], outer))
    worst = 0.0
    for f in finals:
        for k, v in f["params"].items():
            assert torch.allclose(v, ref[k], rtol=1e-5, atol=1e-6), (k, (v - ref[k]).abs().max())
            worst = max(worst, float((v - ref[k]).abs().max()))
    assert float(finals[0]["outer"]["mom"].abs().sum()) > 0
    print("ELASTIC_LOCAL_DENSE", json.dumps({"max_abs_diff": worst}))


@pytest.mark.timeout(240)
def test_local_sgd_kill_inside_a_round_rolls_back_on_survivors(tmp_path):
    """Local SGD under torchft, 3 replica groups: replica 1 kills itself (SIGKILL) after round 4's quorum, before
    the round's collectives. The survivors' collectives of that round fail, the round is not committed and is
    rolled back on both (θ_outer, outer momentum, error feedback, round count and parameters bitwise as before
    it); their next rounds form without it, commit with 2 contributors, and they end identical."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchft")
    c = Cluster(tmp_path, min_replicas=2)
    stop = tmp_path / "stop_at"
    stop.write_text("7")
    try:
        procs = [c.start(r, *_local_args(stop, *(("--die-in-round", 4) if r == 1 else ("--watch-round", 4))))
                 for r in range(3)]
        assert procs[1].wait(timeout=200) != 0, _logs(tmp_path)  # killed (through the test zygote: 137 or -9)
        for r in (0, 2):
            assert procs[r].wait(timeout=200) == 0, _logs(tmp_path)
    finally:
        c.close()
    for r in (0, 2):
        rows = c.rows(r)
        watched = [x for x in rows if "round_unchanged" in x]
        assert len(watched) == 1 and watched[0]["round_unchanged"], watched
        assert watched[0]["round_uncommitted"] == 1 and watched[0]["ft_step"] == 3, watched
        after = [x for x in rows[rows.index(watched[0]) + 1:] if x["position"] == 0]
        assert after and all(x["quorum"] == 2 and x["contributors"] == 2 for x in after), after
        assert rows[-1]["ft_step"] == 7 and rows[-1]["replicas_lost"] >= 1
    finals = [torch.load(tmp_path / f"replica{r}.pt") for r in (0, 2)]
    for k, v in finals[0]["params"].items():
        assert torch.equal(v, finals[1]["params"][k]), k
    for k in ("theta", "mom"):
        assert torch.equal(finals[0]["outer"][k], finals[1]["outer"][k]), k
    print("ELASTIC_LOCAL_MID", json.dumps({"failed_collectives": [f["metrics"]["ft/failed_collectives"] for f in finals],
                                           "uncommitted": [c.rows(r)[-1]["round_uncommitted"] for r in (0, 2)]}))


def _end_together(tmp_path, stall_at, stall_s, quorum_timeout=10, slow=(), delay=0.02):
    """3 replica groups of 1 process, lighthouse and strategy at min_replicas=2, 2 epochs of the digits (Lightning's
    max_epochs ends the run, 90 steps); each step sleeps ``delay``; group 2 sleeps ``stall_s`` before its quorum at
    committed step ``stall_at`` (late for the quorums of that time, alive); ``slow``: extra arguments of groups 0 and
    1. Returns each group's final file and its exit code."""
    torch = pytest.importorskip("torch")
    c = Cluster(tmp_path, min_replicas=2)
    args = ("--steps", 100000, "--max-epochs", 2, "--delay", delay, "--min-replicas", 2,
            "--quorum-timeout", quorum_timeout)
    try:
        procs = [c.start(r, *args, *(("--stall-at", stall_at, "--stall-s", stall_s) if r == 2 else slow))
                 for r in range(3)]
        codes = [p.wait(timeout=150) for p in procs]
    finally:
        c.close()
    finals = [torch.load(tmp_path / f"replica{r}.pt") if (tmp_path / f"replica{r}.pt").exists() else None
              for r in range(3)]
    return c, finals, codes


@pytest.mark.timeout(240)
def test_max_epochs_groups_end_together_after_a_late_group_heals(tmp_path):
    """Under max_epochs (the documented Hydra job's way to end), a group late for the quorums mid-run heals from a
    peer and takes its place in the epoch: every group ends at the same committed and Lightning step, in the same
    epoch, bit-identical (before: the late group's epochs ended after its peers', it ran on alone and failed after
    ft_quorum_timeout with 'fewer than min_replicas=2').

    The peers' remaining 75 steps sleep 0.1 s each, so they are still running when group 2 wakes 3 s later, however
    loaded the host (at 0.02 s a step they once finished all 75 steps inside the stall under load, and group 2 woke
    to no peers: a different scenario, not this one)."""
    import torch

    pytest.importorskip("torchft")
    c, finals, codes = _end_together(tmp_path, stall_at=15, stall_s=3.0, delay=0.1)
    assert codes == [0, 0, 0], _logs(tmp_path)
    late = c.rows(2)
    assert late[-1]["heals"] >= 1 and max(r["ft_step"] for r in late) > 15, late[-1]
    ends = {(f["metrics"]["ft/step"], f["global_step"], f["epoch"]) for f in finals}
    assert len(ends) == 1 and all(f["ended_behind"] is None for f in finals), [
        (f["metrics"]["ft/step"], f["global_step"], f["epoch"], f["ended_behind"]) for f in finals]
    for f in finals[1:]:
        assert all(torch.equal(v, f["params"][k]) for k, v in finals[0]["params"].items())
    print("ELASTIC_END", json.dumps({"end": sorted(ends), "late_heals": late[-1]["heals"]}))


@pytest.mark.timeout(240)
def test_max_epochs_group_late_for_the_last_quorum_ends_cleanly_one_step_behind(tmp_path):
    """The last survivor: group 2 sleeps 3 s before the quorum of the run's last step (90 of 2 epochs); its peers
    finish without it (their farewell quorum does not wait that long) and leave. Its quorum then fails after
    ft_quorum_timeout, and it ends without that step, one committed step behind, with a warning and exit 0 (before:
    'fewer than min_replicas=2', exit 1, no final file)."""
    pytest.importorskip("torchft")
    c, finals, codes = _end_together(tmp_path, stall_at=89, stall_s=3.0, quorum_timeout=5)
    assert codes == [0, 0, 0], _logs(tmp_path)
    assert [f["metrics"]["ft/step"] for f in finals] == [90, 90, 89], [f["metrics"] for f in finals]
    assert finals[2]["ended_behind"] and "one committed step behind" in finals[2]["ended_behind"]
    assert "ends one committed step behind" in (tmp_path / "replica2.0.log").read_text()


@pytest.mark.timeout(240)
def test_max_epochs_group_just_late_for_the_last_quorum_heals_in_the_farewell(tmp_path):
    """Group 2 sleeps 1.5 s before the quorum of the last step: its peers' last quorum forms without it (join
    timeout 0.5 s) and their last step takes 3 s, so its quorum request waits at the lighthouse; their farewell
    quorum (after their last step) takes it in: it heals there to the final step and all three end at step 90,
    bit-identical (before: it ran the step alone and failed, 'fewer than min_replicas=2')."""
    import torch

    pytest.importorskip("torchft")
    c, finals, codes = _end_together(tmp_path, stall_at=89, stall_s=1.5, slow=("--slow-at", 89, "--slow-s", 3.0))
    assert codes == [0, 0, 0], _logs(tmp_path)
    assert [f["metrics"]["ft/step"] for f in finals] == [90, 90, 90], [f["metrics"] for f in finals]
    assert finals[2]["ended_behind"] is None
    assert "healed to the final step 90 in the peers' farewell quorum" in (tmp_path / "replica2.0.log").read_text()
    for f in finals[1:]:
        assert all(torch.equal(v, f["params"][k]) for k, v in finals[0]["params"].items())
