"""benchmarks/ft_goodput.py's bookkeeping, on rows written by hand (no processes, no namespaces): the kill schedule
is fixed by its seed, committed samples count each torchft step once with its quorum, a restarted job counts its
redone steps once, heals are told apart, and the tables render."""
import argparse
import os
import sys

from tests.helpers.procs import ROOT

sys.path.insert(0, os.path.join(str(ROOT), "benchmarks"))
import ft_goodput


def _args(**kw):
    base = dict(duration=100.0, target_acc=0.9, nodes=2)
    base.update(kw)
    return argparse.Namespace(**base)


def test_schedule_is_fixed_by_its_seed():
    a = ft_goodput.schedule(300, 60, 20, 4, seed=0)
    assert a == ft_goodput.schedule(300, 60, 20, 4, seed=0)
    assert [e["kill_at_s"] for e in a] == [60, 120, 180, 240]
    assert all(e["back_at_s"] == e["kill_at_s"] + 20 and 0 <= e["node"] < 4 for e in a)


def _row(t, step, inc=0, committed=True, quorum=2, heals=0, heal=0.0, correct=None):
    r = dict(t=t, step=step, inc=inc, committed=committed, quorum=quorum, heals=heals, heal_time_s=heal)
    if correct is not None:
        r.update(correct=correct, n=10)
    return r


def test_torchft_counts_each_committed_step_once_with_its_quorum():
    rows = {0: [_row(1, 1, heals=1, heal=0.5), _row(2, 2, correct=8), _row(3, 3, quorum=1), _row(4, 3, committed=False),
                _row(5, 4, quorum=2, heals=2, heal=0.3, correct=10)],
            1: [_row(1, 1), _row(2, 2, correct=9), _row(10, 4, inc=1, heals=1, heal=0.7, correct=10)]}
    events = [{"t_s": 6.0, "event": "start", "node": 1, "inc": 1}]
    s = ft_goodput.summarize_goodput("ft", rows, 0.0, _args(), events)
    assert s["steps_committed"] == 4
    assert s["samples_committed"] == 32 * (2 + 2 + 1 + 2)
    assert s["heals_at_start_s"] == [0.5] and s["heal_times_s"] == [0.7] and s["heals_of_survivors_s"] == [0.3]
    assert s["start_to_first_commit_s"] == [4.0]
    assert s["curve"][0] == {"step": 2, "t_s": 2, "acc": 0.85, "slices": 2}
    assert s["time_to_target_s"] == 10 and s["uncommitted_steps"] == 1


def test_restart_counts_the_job_at_its_end_and_the_redone_steps():
    rows = {n: [_row(t, t, quorum=2) for t in range(1, 8)] + [_row(20 + t, 5 + t, inc=1, quorum=2) for t in range(1, 5)]
            for n in (0, 1)}
    s = ft_goodput.summarize_goodput("restart", rows, 0.0, _args(), [])
    assert s["steps_committed"] == 9 and s["samples_committed"] == 32 * 2 * 9
    assert s["steps_redone"] == 2  # died after step 7, resumed from the checkpoint of step 5


def test_tables_render():
    s = ft_goodput.summarize_goodput("ft", {0: [_row(1, 1)], 1: [_row(1, 1)]}, 0.0, _args(), [])
    s.update(schedule=ft_goodput.schedule(100, 60, 20, 2, 0), events=[], starts=2)
    setup = dict(nodes=2, rate="100mbit", duration=100.0, kill_every=60.0, down=20.0, seed=0, hidden=256, density=0.01,
                 ckpt_every=30, min_replicas=2, join_timeout_ms=500, heartbeat_timeout_ms=1500, target_acc=0.9)
    d = {"date": "2026-11-27T00:00:00Z", "command": "python x", "rows": {"setup": setup, "results": [s]},
         "host": {"cpus": 2, "machine": "x86_64", "torch": "2.13.0", "cuda": False}}
    assert "| torchft, preempted | 1 |" in ft_goodput.goodput_table(d)
    assert ft_goodput._heals([0.5, 0.7, 2.0]) == "3, 0.7" and ft_goodput._heals([]) == "0"
    assert "Schedule" in ft_goodput.goodput_table(d) and "100mbit per link" in ft_goodput.header(d)
    runs = [dict(seed=0, killed=False, accuracy=0.9, identical=True),
            dict(seed=0, killed=True, accuracy=0.91, identical=True, heal_time_s=0.1)]
    summary = dict(undisturbed_mean=0.9, killed_mean=0.91, undisturbed_range=[0.9, 0.9], killed_range=[0.91, 0.91],
                   diff_points_mean=1.0)
    assert "| 0 | 90.0% | 91.0% | +1.0 |" in ft_goodput.accuracy_table({"rows": {"runs": runs, "summary": summary}})


def test_own_pace_is_the_median_full_quorum_step():
    rows = {n: [_row(t, t, quorum=2) for t in range(1, 11)] for n in (0, 1)}
    s = ft_goodput.summarize_goodput("ddp", rows, 0.0, _args(duration=11.0), [])
    assert s["median_step_s"] == 1.0
    assert abs(s["share_of_own_pace"] - 10 / 10) < 1e-9  # 10 steps in the 10 s from the first step to the end
