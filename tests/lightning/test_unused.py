"""Parameters unused in a backward, through the Trainer (2 real gloo processes, one launch of
tests/scripts/unused_train.py): a GAN with manual optimization and ``toggle_optimizer``, and a branch used on
alternate steps (by one rank only, or by none) with ``find_unused_parameters=True``.

Conservation of the error-feedback mass, per parameter: what the optimizers applied (``.grad`` at each step,
plain SGD) plus the pending error feedback averaged over the ranks equals the local gradients averaged over the
ranks. At density 1 the runs equal Lightning's own ``ddp``."""
import pytest
import torch

from tests.helpers.procs import run_script

SCRIPT = "tests/scripts/unused_train.py"
LR = 0.5  # the script's
KINDS = ("gan", "branch")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("unused")
    run_script([SCRIPT, "--out", out])

    def load(kind, name):
        return [torch.load(out / f"{kind}_{name}_rank{r}.pt") for r in range(2)]

    return load


def _flat(d, p):
    return d[p].reshape(-1) if p in d else 0


@pytest.mark.parametrize("name", ["allgather", "scatter"])
@pytest.mark.parametrize("kind", KINDS)
def test_error_feedback_mass_is_conserved_for_every_parameter(runs, kind, name):
    r0, r1 = runs(kind, name)
    assert r0["exchanges"] == (16 if kind == "gan" else 8)  # two backward passes per GAN step
    for p in r0["start"]:
        applied = r0["applied"][p].reshape(-1)
        lhs = applied + (_flat(r0["pending"], p) + _flat(r1["pending"], p)) / 2
        rhs = (r0["local"][p] + r1["local"][p]).reshape(-1) / 2
        err = float((lhs - rhs).abs().max() / rhs.abs().max())
        assert err <= 1e-6, (kind, name, p, err)
        # what was applied is what moved the weights (plain SGD), identically on both ranks
        moved = (r0["end"][p] - r0["start"][p]).reshape(-1)
        assert torch.allclose(moved, -LR * applied, rtol=0, atol=1e-6), (kind, name, p)
        assert torch.equal(r0["end"][p], r1["end"][p]), (kind, name, p)


@pytest.mark.parametrize("kind", KINDS)
def test_density_one_equals_lightning_ddp(runs, kind):
    dense, ddp = runs(kind, "dense1"), runs(kind, "ddp")
    assert dense[0]["global_step"] == ddp[0]["global_step"] > 0
    for r, d in zip(dense, ddp):
        for p in d["end"]:
            assert torch.allclose(r["end"][p], d["end"][p], rtol=0, atol=1e-7), (kind, p)
            assert not torch.equal(d["end"][p], d["start"][p]), (kind, p)  # every parameter trained


@pytest.mark.parametrize("kind", KINDS)
def test_local_sgd_trains_with_unused_parameters(runs, kind):
    """``local_steps`` keeps no per-step residual; with unused parameters its replicas still train and agree."""
    r0, r1 = runs(kind, "local")
    for p in r0["end"]:
        assert torch.isfinite(r0["end"][p]).all() and torch.equal(r0["end"][p], r1["end"][p]), (kind, p)
        assert not torch.equal(r0["end"][p], r0["start"][p]), (kind, p)
