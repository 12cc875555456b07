"""The support matrix as data (lightning_topk.support): its rules, the pairwise sample, and that the option checks
raise the matrix's own messages (the gloo runs of its cells are tests/matrix/)."""
import itertools

import pytest

from lightning_topk import support
from lightning_topk.comm.config import TopKConfig


def test_every_cell_has_one_status_and_the_counts_add_up():
    n = support.counts()
    total = 1
    for v in support.DIMENSIONS.values():
        total *= len(v)
    assert sum(n.values()) == total
    assert n["supported"] > 0 and n["refused"] > 0


def test_every_refusal_names_what_to_use_instead():
    for r in support.RULES:
        if r.status == "refused":
            assert r.message.startswith(("topk_ddp:", "topk_fsdp:")), r.name
            assert any(w in r.message for w in ("use ", "set ", "choose ", "fully_shard")), r.name


def test_pairwise_covers_every_pair_of_the_pool():
    pool = [c for c in support.cells() if support.status(c)[0] == "supported" and c["fault_tolerance"] == "none"]
    chosen = support.pairwise(pool)
    want = {p for c in pool for p in itertools.combinations(sorted(c.items()), 2)}
    got = {p for c in chosen for p in itertools.combinations(sorted(c.items()), 2)}
    assert want <= got
    assert len(chosen) < len(pool) / 20  # a sample, not the pool


def test_refuse_raises_the_rules_message_and_passes_supported_cells():
    cell = {"strategy": "topk_ddp", "api": "trainer", "mode": "per_step", "exchange": "hierarchical",
            "fault_tolerance": "none", "layout": "2x1", "optimization": "automatic", "feature": "plain",
            "end": "max_steps"}
    with pytest.raises(ValueError, match="needs more than one process per node") as e:
        support.refuse(cell)
    assert str(e.value) == support.RULES[[r.name for r in support.RULES].index("node_tier_one_process")].render(cell)
    support.refuse({**cell, "layout": "2x2"})  # supported: no error


@pytest.mark.parametrize("kwargs,rule,values", [
    (dict(fault_tolerance="torchft", lighthouse="http://127.0.0.1:9", exchange="hierarchical"), "ft_exchange",
     dict(exchange="hierarchical")),
    (dict(fault_tolerance="torchft", lighthouse="http://127.0.0.1:9", local_steps=4, outer_exchange="scatter"),
     "ft_outer_scatter", {}),
])
def test_option_checks_raise_the_matrix_message(kwargs, rule, values):
    with pytest.raises(ValueError) as e:
        TopKConfig(**kwargs)
    assert str(e.value) == support.message(rule, **values)
