"""recipe="auto" in a run, where it engages (SGD with momentum and weight decay, sparse from the first step), under
topk_ddp and topk_fsdp at 2 simulated nodes x 1 process: a checkpoint taken right after the first sparse step resumes
into the recipe at the same step as the uninterrupted run, manual optimization engages where automatic does, and a
fine-tuning callback that unfreezes parameters outside DDP's buckets is refused (tests/scripts/recipe_train.py, one
launch for all phases)."""
import pytest
import torch

from tests.helpers.procs import run_nodes

pytestmark = pytest.mark.timeout(300)
PHASES = ("ddp_straight,ddp_stop,ddp_resume,ddp_manual,fsdp_straight,fsdp_stop,fsdp_resume,fsdp_manual,"
          "tune_ddp,tune_none,tune_auto,unfreeze")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("recipe")
    run_nodes(["tests/scripts/recipe_train.py", "--out", d, "--phases", PHASES], num_nodes=2, timeout=240)
    return lambda phase, rank: torch.load(d / f"{phase}_rank{rank}.pt", weights_only=False)


def assert_same(a, b):
    assert a["step"] == b["step"] and a["exchange_step"] == b["exchange_step"]
    assert a["engaged"] and b["engaged"] and a["momentum_buffers"] == b["momentum_buffers"] == 0
    assert a["wd_momentum"] == b["wd_momentum"] > 0
    for k in a["params"]:
        assert torch.equal(a["params"][k], b["params"][k]), k
    assert a["velocities"] and a["velocities"].keys() == b["velocities"].keys()
    for k in a["velocities"]:
        assert torch.equal(a["velocities"][k], b["velocities"][k]), k


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_checkpoint_after_the_first_sparse_step_resumes_into_the_recipe_on_time(runs, strategy):
    """Saved after step 1 (sent sparse, the recipe still dormant: the optimizer holds momentum buffers), resumed to
    step 3: the recipe engages at step 2 as in the uninterrupted run (it was one step late: 2.3e-3 under topk_ddp,
    7.4e-3 under topk_fsdp)."""
    for r in range(2):
        stop = runs(f"{strategy}_stop", r)
        assert not stop["engaged"] and stop["momentum_buffers"] > 0 and stop["exchange_step"] == 1
        assert_same(runs(f"{strategy}_straight", r), runs(f"{strategy}_resume", r))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_manual_optimization_engages_where_automatic_does(runs, strategy):
    """Manual optimization (zero_grad, manual_backward, step) is automatic optimization bit for bit (it engaged inside
    the first sparse step's optimizer step: 5.0e-3 under topk_ddp, 8.1e-3 under topk_fsdp)."""
    for r in range(2):
        assert_same(runs(f"{strategy}_straight", r), runs(f"{strategy}_manual", r))


def test_backbone_finetuning_is_refused_where_the_hook_holds_the_momentum(runs):
    """BackboneFinetuning unfreezes the backbone after DDP built its buckets: under Lightning's ddp and under
    recipe="none" those parameters keep SGD's momentum buffer; recipe="auto" would step them without momentum (it
    did: 0 buffers), so it is refused at setup, naming the callback and recipe='none'."""
    for r in range(2):
        ddp, none = runs("tune_ddp", r), runs("tune_none", r)
        assert ddp["groups"] == none["groups"] == 2 and ddp["backbone_buffers"] == none["backbone_buffers"] == 2
        auto = runs("tune_auto", r)
        assert auto["step"] == auto["epoch"] == 0 and "BackboneFinetuning" in auto["error"] and "recipe='none'" in auto["error"]


def test_parameters_unfrozen_outside_the_buckets_are_refused_at_that_step(runs):
    """A callback of the user's own unfreezes the backbone at epoch 1 (the second step, one batch per epoch) and adds
    it to the optimizer: refused in that step, naming the parameters (it stepped them without momentum: 0 buffers)."""
    for r in range(2):
        err = runs("unfreeze", r)
        assert err["epoch"] == 1 and "backbone.0.weight" in err["error"] and "recipe='none'" in err["error"]
