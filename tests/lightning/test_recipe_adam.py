"""recipe="auto" with AdamW in a Trainer run under topk_ddp (issue 42), 2 simulated nodes x 1 process
(tests/scripts/adam_recipe_train.py, one launch for all phases): dormant through the dense steps (Lightning's ddp bit
for bit), engaged after the first sparse step with the optimizer's groups still the user's, and a checkpoint taken
after engagement resumes bit for bit; a skipped step keeps nothing."""
import pytest
import torch

from tests.helpers.procs import run_nodes

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("adam_recipe")
    run_nodes(["tests/scripts/adam_recipe_train.py", "--out", d], num_nodes=2, timeout=240)
    return lambda phase, rank: torch.load(d / f"{phase}_rank{rank}.pt", weights_only=False)


def test_dormant_through_the_dense_steps_then_engaged_with_the_users_groups(runs):
    """Steps 1-2 (dense_steps=2) and 3-4 (the lr still rises) are Lightning's ddp with AdamW bit for bit; step 5 sends
    sparse with the user's AdamW; from step 6 Adam's moments are in the hook (today's default kept plain error
    feedback: no recipe). Every step the optimizer shows the scheduler's lr and the user's betas and weight decay."""
    for r in range(2):
        ddp, topk = runs("ddp", r), runs("straight", r)
        assert topk["live"] == "AdamLiveRecipe" and topk["engaged"] and "Adam in the hook" in topk["recipe"]
        for a, b in zip(ddp["trace"][:4], topk["trace"][:4]):
            assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"]), a["step"]
        assert not all(torch.equal(ddp["params"][k], topk["params"][k]) for k in ddp["params"])  # sparse since
        assert [(t["lr"], t["betas"], t["weight_decay"]) for t in topk["trace"]] == \
               [(t["lr"], t["betas"], t["weight_decay"]) for t in ddp["trace"]]
        assert topk["optimizer_state_keys"] == ["exp_avg_sq", "step", "topk_frozen_step"]
        assert topk["velocities"] and topk["local_v"].keys() == topk["velocities"].keys()
        assert all(int(s["topk_frozen_step"]) == 5 and int(s["step"]) == 8 for s in topk["optimizer_state"].values())


def test_a_checkpoint_after_engagement_resumes_bit_for_bit(runs):
    """Saved after step 6 (engaged), resumed to step 8: parameters, velocities, residuals, this rank's local v and
    the optimizer's state equal the uninterrupted run's."""
    for r in range(2):
        stop, straight, resume = runs("stop", r), runs("straight", r), runs("resume", r)
        assert stop["engaged"] and stop["step"] == 6 and resume["engaged"] and resume["step"] == 8
        for key in ("params", "velocities", "residuals", "local_v"):
            assert straight[key] and straight[key].keys() == resume[key].keys(), key
            for k in straight[key]:
                assert torch.equal(straight[key][k], resume[key][k]), (key, k)
        for n, s in straight["optimizer_state"].items():
            assert all(torch.equal(s[k], resume["optimizer_state"][n][k]) for k in s), n


def test_a_skipped_step_after_engagement_keeps_nothing(runs):
    """A NaN in one gradient element on rank 0 at step 7 (engaged), nonfinite="skip": every rank ends step 7 with the
    parameters, velocities, residuals, local v and optimizer state it had after step 6."""
    for r in range(2):
        stop, skip = runs("stop", r), runs("skip", r)
        assert skip["engaged"] and skip["step"] == 7
        for key in ("params", "velocities", "residuals", "local_v"):
            assert stop[key] and stop[key].keys() == skip[key].keys(), key
            for k in stop[key]:
                assert torch.equal(stop[key][k], skip[key][k]), (key, k)
        for n, s in stop["optimizer_state"].items():
            assert all(torch.equal(s[k], skip["optimizer_state"][n][k]) for k in s), n
