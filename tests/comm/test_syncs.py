"""Host syncs of the exchange on the sync-free path (LIGHTNING_TOPK_SYNC_FREE=1 forces it on CPU): none inside the
hooks and their callbacks, for exact and mstopk, fp32 and bf16 wire values, flat, hierarchical, scale-free, both at
once and auto; at most one per step outside them (the step controller's). Real gloo processes; counter in tests/helpers/syncs.py."""
import os

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_topk import TopKConfig, TopKState
from lightning_topk.comm import cost
from lightning_topk.comm.controller import StepController
from lightning_topk.comm.exchanges import auto as auto_module
from lightning_topk.comm.exchanges.allgather import topk_allgather_hook
from lightning_topk.comm.exchanges.auto import auto_topk_hook, candidates_for
from lightning_topk.comm.exchanges.hierarchical import (
    hierarchical_scatter_topk_hook,
    hierarchical_topk_hook,
    make_groups,
)
from lightning_topk.comm.exchanges.scatter import scatter_topk_hook
from tests.helpers.dist import run_distributed
from tests.helpers.exchanges import make_auto
from tests.helpers.syncs import SyncCounter

STEPS = 3
COMBOS = [(sel, wire) for sel in ("exact", "mstopk") for wire in ("fp32", "bf16")]


HOOKS = {"flat": topk_allgather_hook, "hierarchical": hierarchical_topk_hook, "scatter": scatter_topk_hook,
         "hierarchical_scatter": hierarchical_scatter_topk_hook, "auto": auto_topk_hook}


def _slow_link_auto(st, cfg, world, rank):
    """exchange="auto" with a model of a 1 MB/s link (sparse wins) that refreshes every 2 exchanges."""
    auto_module.REFRESH_STEPS = 2
    model = cost.CostModel(world, 1, None, cost.Link(50e-6, 1e6), 2e-9, 1e-4, 0.5e-9, 20e-9)
    return make_auto(st, model, candidates_for(cfg, world, 1, False), rank)


def _count(rank, world, mode, sync_free):
    os.environ["LIGHTNING_TOPK_SYNC_FREE"] = "1" if sync_free else "0"
    groups = make_groups(2, 2, rank) if mode.startswith("hierarchical") else None
    out = {}
    for selector, wire in COMBOS:
        torch.manual_seed(0)
        # 3.2 MB of gradients: several buckets, most above the selectors' small-tensor cut-off
        m = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 10))
        ddp = DDP(m, bucket_cap_mb=0.6)
        cfg = TopKConfig(density=0.01, selector=selector, value_dtype=wire, min_sparse_numel=1000, dense_steps=1,
                         nonfinite="skip", hierarchical=True if mode == "hierarchical" else "auto",
                         exchange=mode if "scatter" in mode else "auto")
        st = TopKState(cfg, hier=groups)
        st.bind(m.named_parameters())
        if mode == "auto":
            _slow_link_auto(st, cfg, world, rank)
        counter = SyncCounter()
        ddp.register_comm_hook(st, counter.wrap_hook(HOOKS[mode]))
        ctl = StepController(st)
        opt = torch.optim.SGD(m.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(rank)
        batches = [(torch.randn(8, 256, generator=g), torch.randn(8, 10, generator=g)) for _ in range(STEPS)]
        with counter:
            for x, y in batches:
                opt.zero_grad()
                nn.functional.mse_loss(ddp(x), y).backward()
                ctl.finish_step()
                opt.step()
        out[(selector, wire)] = (dict(counter.inside), dict(counter.outside), counter.hook_calls,
                                 st.totals.numel_sent < st.totals.numel,
                                 st.exchange.refreshes if mode == "auto" else None)
    return out


@pytest.mark.parametrize("mode", ["flat", "hierarchical", "scatter", "hierarchical_scatter", "auto"])
def test_sync_free_hooks_make_no_host_sync(mode):
    """auto: its cost-model refresh (at step 2) rides on the controller's all-reduce, not in a hook."""
    world = {"flat": 2, "hierarchical": 4, "scatter": 3, "hierarchical_scatter": 4, "auto": 2}[mode]
    for per_rank in run_distributed(_count, world, (mode, True)):
        for combo, (inside, outside, calls, sparse, refreshes) in per_rank.items():
            assert sparse and calls > STEPS, combo  # sparse steps; several buckets after DDP's rebuild
            assert refreshes == (1 if mode == "auto" else None), combo
            assert inside == {}, (combo, inside)
            assert sum(outside.values()) <= STEPS, (combo, outside)  # the controller's one read per step


def test_the_counter_sees_the_cpu_fast_path():
    """Without the sync-free path the CPU selection makes host syncs: the counter must see them."""
    inside, _outside, _calls, _, _ = run_distributed(_count, 2, ("flat", False))[0][("exact", "fp32")]
    assert any("nonzero" in op for op in inside) and sum(inside.values()) >= STEPS, inside
