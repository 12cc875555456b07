"""benchmarks/convergence.py simulates W ranks in one process; here it is checked against real gloo
processes running DDP with ``topk_allgather_hook`` on the same data, seeds and optimizer."""
import os
import sys

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_topk import TopKState, topk_allgather_hook
from tests.helpers.dist import run_distributed
from tests.helpers.procs import ROOT

sys.path.insert(0, os.path.join(str(ROOT), "benchmarks"))
import convergence as conv

STEPS, BATCH = 12, 32
# fp32 values: with bf16 (the default) a last-bit difference in summation order between DDP's bucket and the
# simulation's flat vector can flip a value's bf16 rounding, and 12 steps amplify that past the tolerance.
FP32 = {"value_dtype": "fp32"}
CASES = {  # recipe -> (optimizer, density)
    "ef": ("adamw", 0.02),
    "mc_warmup": ("sgd", 0.01),
    "mc_nomask": ("sgd", 0.01),  # momentum_masking=False: the velocity is kept where sent
    "mc_look": ("sgd", 0.01),  # and momentum_lookahead: the residual leads by c times the velocity
}


BETA1_CASE = "ef_adam_beta1_0.5"  # ef with torch's AdamW(betas=(0.5, 0.999)): the harness's --adam-beta1 0.5


def _real(rank, world):
    out = {}
    xtr, ytr, _, _ = conv.load("digits")
    for recipe, (opt, density) in [*CASES.items(), (BETA1_CASE, ("adamw", 0.02))]:
        model = conv.model_for("digits", 0)
        cfg = conv.config_for("ef" if recipe == BETA1_CASE else recipe, density, warmup_steps=6, overrides=FP32)
        ddp = DDP(model, bucket_cap_mb=100)  # one bucket, as the simulation
        state = TopKState(cfg)
        state.bind(model.named_parameters())
        ddp.register_comm_hook(state, topk_allgather_hook)
        if recipe == BETA1_CASE:
            optim = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.5, 0.999), weight_decay=0.01)
        else:
            optim = conv.optimizer_for(opt, list(model.parameters()), momentum_in_hook=cfg.momentum_correction)
        for shards in conv.batches(len(xtr), world, BATCH, STEPS):
            idx = shards[rank]
            optim.zero_grad()
            nn.functional.cross_entropy(ddp(xtr[idx]), ytr[idx]).backward()
            optim.step()
        out[recipe] = ({k: v.detach().clone() for k, v in model.state_dict().items()},
                       {k: v.clone() for k, v in state.residuals().items()}, state.totals.numel_sent,
                       {k: v.clone() for k, v in state.velocities().items()})
    return out


@pytest.fixture(scope="module")
def real():
    return run_distributed(_real, 2)


@pytest.mark.parametrize("recipe", list(CASES))
def test_simulation_matches_two_gloo_processes(real, recipe):
    opt, density = CASES[recipe]
    data = conv.load("digits")
    sims = []
    run = conv.train("digits", opt, recipe, density, STEPS, world=2, batch=BATCH, warmup_steps=6, data=data, overrides=FP32,
                     on_step=lambda step, m: sims.append({k: v.detach().clone() for k, v in m.state_dict().items()}))
    assert len(sims) == STEPS and run.curve
    got, residuals = sims[-1], [st.residuals() for st in run.states]
    for rank in range(2):
        params, res, sent, vel = real[rank][recipe]
        assert 0 < sent
        for k, v in params.items():
            assert torch.allclose(got[k], v, atol=2e-5, rtol=1e-4), (recipe, rank, k)
        # the real rank's residual (per-rank state) is the simulated rank's
        for name, r in res.items():
            assert torch.allclose(residuals[rank][name], r, atol=2e-5, rtol=1e-4), (recipe, rank, name)
        # and so is its momentum-correction velocity (masked at the sent entries or kept)
        assert vel.keys() == run.states[rank].velocities().keys() and bool(vel) == recipe.startswith("mc")
        for name, v in vel.items():
            assert torch.allclose(run.states[rank].velocities()[name], v, atol=2e-5, rtol=1e-4), (recipe, rank, name)
    # and it is not trivially so: the two ranks' residuals differ, and training moved the parameters
    r0, r1 = real[0][recipe][1], real[1][recipe][1]
    assert any(not torch.equal(r0[n], r1[n]) for n in r0)
    init = conv.model_for("digits", 0).state_dict()
    assert any(not torch.allclose(init[k], got[k]) for k in init)


def test_adam_beta1_matches_torch_adamw_in_two_gloo_processes(real):
    """``adam_beta1=0.5`` (``--adam-beta1``) trains as torch's ``AdamW(betas=(0.5, 0.999))`` under the real hook."""
    sims = []
    run = conv.train("digits", "adamw", "ef", 0.02, STEPS, world=2, batch=BATCH, data=conv.load("digits"),
                     overrides=FP32, adam_beta1=0.5,
                     on_step=lambda step, m: sims.append({k: v.detach().clone() for k, v in m.state_dict().items()}))
    assert run.adam_beta1 == 0.5 and len(sims) == STEPS
    got = sims[-1]
    for rank in range(2):
        for k, v in real[rank][BETA1_CASE][0].items():
            assert torch.allclose(got[k], v, atol=2e-5, rtol=1e-4), (rank, k)
    # and beta1 reached the optimizer: the weights differ from beta1 0.9's
    beta09 = real[0]["ef"][0]
    assert any(not torch.allclose(got[k], beta09[k], atol=1e-4) for k in got)


def test_lm_task_scores_held_out_loss_and_counts_steps_to_a_lower_loss():
    """``--task lm`` (the frontier LM): the training loss is the next-byte cross-entropy of the sequence itself, the
    metric is the held-out loss, and a target is reached when the loss falls to it (not rises, as accuracy does)."""
    torch.manual_seed(0)
    seqs = torch.randint(0, 256, (16, conv._frontier().SEQ_LEN + 1))
    data = (seqs, seqs[:, 0], seqs[:4], seqs[:4, 0])
    run = conv.train("lm", "adamw", "dense", steps=2, world=2, batch=2, eval_every=1, data=data)
    model = conv.model_for("lm", 0)
    assert sum(p.numel() for p in model.parameters()) == 7_221_504  # frontier.py's N_PARAMS
    first = conv.metric("lm", model, seqs[:4], seqs[:4, 0])
    assert 5.0 < first < 6.5  # about ln(256) = 5.55 at initialisation: a loss, not an accuracy
    assert [s for s, _ in run.curve] == [1, 2] and run.curve[1][1] < first
    assert run.steps_to(run.curve[1][1]) == 2 and run.steps_to(first + 1.0) == 1 and run.steps_to(0.1) is None
