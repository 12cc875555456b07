"""One decision per step for gradient faults, through the Trainer, with real gloo processes.

A NaN in one gradient element on one rank (before the exchange) at step 3: with nonfinite="skip" every rank
must end where a run that never saw that batch ends, under every precision plugin and for the flat and the
hierarchical exchange; with nonfinite="raise" every rank must raise FloatingPointError (no hang). Lightning's
own MixedPrecision (GradScaler) is supported: the hooks get the live scale, so residuals are in unscaled units.
Scenarios: tests/scripts/nonfinite_train.py.
"""
import pytest
import torch

from tests.helpers.procs import run_nodes, run_script

SCRIPT = "tests/scripts/nonfinite_train.py"
PLUGINS = ["none", "32-true", "bf16-mixed", "tk16", "mp16"]

pytestmark = pytest.mark.slow


def _load(d, world):
    return [torch.load(d / f"rank{r}.pt") for r in range(world)]


@pytest.fixture(scope="module")
def flat(tmp_path_factory):
    d = tmp_path_factory.mktemp("flat")
    cases = ",".join([f"skip:{p}" for p in PLUGINS] + ["defaults:bf16-mixed", "scale", "raise"])
    run_script([SCRIPT, "--cases", cases, "--out", d])
    return _load(d, 2)


@pytest.fixture(scope="module")
def hier(tmp_path_factory):
    d = tmp_path_factory.mktemp("hier")
    run_nodes([SCRIPT, "--num-nodes", "2", "--cases", "skip:none,raise", "--out", d])
    return _load(d, 4)


def _max_diff(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _check_skip_equals_never_seen(ranks, case, tol=1e-6, engaged=True):
    for r in ranks:
        x = r[case]
        assert x["residuals_finite"]
        assert _max_diff(x["bad"], x["ref"]) <= tol, case
        # recipe="auto" moved SGD's momentum into the hook where the exchange allows it: the skip rolled the
        # velocities back too (the reference never had that batch)
        bad_v, ref_v = x["velocities"]
        if "-> momentum_correction" in x["recipe"] and engaged:
            assert bad_v and bad_v.keys() == ref_v.keys(), case
            assert _max_diff(bad_v, ref_v) <= tol, case
        else:
            assert not bad_v, case
    for r in ranks[1:]:  # and the ranks agree
        assert _max_diff(r[case]["bad"], ranks[0][case]["bad"]) == 0.0


@pytest.mark.parametrize("plugin", PLUGINS)
def test_skip_equals_a_run_that_never_saw_the_batch(flat, plugin):
    _check_skip_equals_never_seen(flat, f"skip:{plugin}")
    scales = flat[0][f"skip:{plugin}"]["scales"]
    if plugin in ("tk16", "mp16"):  # the scaler's skip applied on every rank: one backoff at step 3
        assert all(r[f"skip:{plugin}"]["scales"] == [1024.0] * 3 + [512.0] * 5 for r in flat)
    else:
        assert scales == [None] * 8


def test_skip_with_defaults_under_deterministic_equals_the_never_seen_run_exactly(flat):
    """Only density (and nonfinite="skip") set: exchange="auto" takes no timing under deterministic=True,
    so the run and its reference take one plan and the skip is exact, not merely close."""
    for r in flat:
        x = r["defaults:bf16-mixed"]
        assert x["plans"][0] and x["plans"][0] == x["plans"][1]
        assert x["residuals_finite"] and _max_diff(x["bad"], x["ref"]) == 0.0
        # SGD with momentum at density 0.01: recipe="auto" resolved it to momentum correction without masking,
        # with the Nesterov lookahead, but the plan sends this model dense on one node, so it stays dormant:
        # SGD keeps its momentum, the hook has no velocity (docs/compatibility.md)
        assert "-> momentum_correction without masking, momentum_lookahead 0.9 (Nesterov)" in x["recipe"]
        assert set(x["plans"][0].values()) <= {"dense", "dense_bf16"} and not x["velocities"][0]
    _check_skip_equals_never_seen(flat, "defaults:bf16-mixed", tol=0.0, engaged=False)
    assert flat[0]["defaults:bf16-mixed"]["plans"] == flat[1]["defaults:bf16-mixed"]["plans"]


def test_hierarchical_skip_equals_a_run_that_never_saw_the_batch(hier):
    _check_skip_equals_never_seen(hier, "skip:none")


@pytest.mark.parametrize("layout", ["flat", "hier"])
def test_raise_on_every_rank(flat, hier, layout):
    ranks = flat if layout == "flat" else hier
    for r in ranks:
        err = r["raise"]["error"]
        assert err is not None and err["type"] == "FloatingPointError", err
        assert "entered the exchange on rank(s) [0]" in err["message"]


def test_lightning_mixed_precision_keeps_residuals_unscaled(flat):
    """Lightning's MixedPrecision with the scale doubling every step (2048 ... 131072) against a constant
    1024: the residuals agree, so they do not carry the scale."""
    for r in flat:
        x = r["scale"]
        grow, const = x["scales"]
        assert grow[-1] / grow[0] == 64.0 and set(const) == {1024.0}
        size = max(float(v.abs().max()) for v in x["flat"].values())
        assert 1e-4 < size < 1.0  # gradient-sized, not 1024x
        assert _max_diff(x["grow"], x["flat"]) <= 1e-6 * max(1.0, size)
