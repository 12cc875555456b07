"""The support matrix, as data: every combination of options a user can pick, and whether it is supported,
refused (with the message the strategies raise), or has no meaning.

One source of truth for three readers:

* the strategies, which refuse a cell at setup, before any collective (:func:`refuse`);
* the generated test suite (``tests/matrix/``), which runs a pairwise sample of the supported cells on real gloo
  processes and checks that every refused cell fails with this module's message;
* ``docs/compatibility.md``'s generated tables (``tools/render_support.py``).

A *cell* is a mapping of every dimension in :data:`DIMENSIONS` to one of its values. :func:`status` walks
:data:`RULES` in order; the first rule whose conditions all hold decides. Cells no rule matches are supported.
Standard library only: the torch-only ``comm`` layer and the Lightning glue both read it.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

Cell = Mapping[str, str]

#: The dimensions and their values, in the order the docs' tables list them.
DIMENSIONS: Dict[str, Tuple[str, ...]] = {
    "strategy": ("topk_ddp", "topk_fsdp"),
    "api": ("trainer", "fabric"),
    "mode": ("per_step", "local_sgd", "dense_steps"),
    # under local SGD, the outer exchange (``outer_exchange``); else the per-step ``exchange``
    "exchange": ("auto", "dense", "dense_bf16", "allgather", "scatter", "hierarchical", "hierarchical_scatter"),
    "fault_tolerance": ("none", "torchft"),
    # nodes x processes per node; under torchft, replica groups x processes per group
    "layout": ("1x2", "2x1", "2x2", "1x3", "3x1"),
    "optimization": ("automatic", "manual"),
    "feature": ("plain", "unused", "unfreeze", "partial_shard"),
    "end": ("max_steps", "max_epochs", "kill", "stall"),
}

#: What each value means in options, for the docs.
MEANING: Dict[str, str] = {
    "per_step": "`local_steps=0`, `dense_steps=0`: the top-k exchange every step",
    "local_sgd": "`local_steps=H` > 0: sparse local SGD (the exchange value is `outer_exchange`)",
    "dense_steps": "`dense_steps=N` > 0, then the per-step exchange",
    "unused": "a parameter used on some ranks and steps only (`find_unused_parameters=True` under `topk_ddp`)",
    "unfreeze": "parameters frozen at the start and unfrozen later (Lightning's `BackboneFinetuning`)",
    "partial_shard": "`configure_model` shards some modules on `device_mesh['shard']` and leaves others unsharded",
    "kill": "a replica's process is killed (`kill -9`) and restarted",
    "stall": "a replica stops for seconds (SIGSTOP, then SIGCONT)",
    "max_steps": "`Trainer(max_steps=N)` (Fabric: the loop's step count)",
    "max_epochs": "`Trainer(max_epochs=N)`",
}


def nodes(cell: Cell) -> int:
    return int(cell["layout"].split("x")[0])


def procs(cell: Cell) -> int:
    """Processes per node (per replica group under torchft)."""
    return int(cell["layout"].split("x")[1])


@dataclass(frozen=True)
class Rule:
    """A set of cells (every dimension in ``when`` takes one of the values listed, and ``test`` holds, if given)
    and what they are: ``"refused"`` (``message`` is the error, formatted with the cell's values) or ``"n/a"``
    (the combination has no meaning; ``message`` says why). ``at`` says when a refusal fires: ``"setup"`` (before
    the process group), ``"configure_model"`` (right after the user's ``configure_model``, which needs the device
    mesh, before any collective), ``"first backward"``."""

    name: str
    status: str
    message: str
    when: Mapping[str, Sequence[str]] = field(default_factory=dict)
    test: Optional[Callable[[Cell], bool]] = None
    condition: str = ""  # ``test`` in words, for the docs
    at: str = "setup"

    def matches(self, cell: Cell) -> bool:
        if any(cell[d] not in v for d, v in self.when.items()):
            return False
        return self.test is None or self.test(cell)

    def render(self, cell: Cell) -> str:
        return self.message.format(**cell, nodes=nodes(cell), procs=procs(cell))


ELASTIC_EXCHANGES = ("auto", "allgather", "scatter", "dense")
OUTER_EXCHANGES = ("auto", "allgather", "scatter")
NODE_TIER = ("hierarchical", "hierarchical_scatter")

RULES: Tuple[Rule, ...] = (
    # ---- combinations without a meaning: not cells ----
    Rule("fabric_epochs", "n/a", "Fabric runs the user's loop: no max_epochs", {"api": ("fabric",), "end": ("max_epochs",)}),
    Rule("fabric_manual", "n/a", "Fabric's loop is the user's: one kind of optimization",
         {"api": ("fabric",), "optimization": ("manual",)}),
    Rule("fabric_unfreeze", "n/a", "BackboneFinetuning is a Trainer callback",
         {"api": ("fabric",), "feature": ("unfreeze",)}),
    Rule("ddp_partial", "n/a", "partial sharding is a topk_fsdp model", {"strategy": ("topk_ddp",), "feature": ("partial_shard",)}),
    Rule("fault_without_ft", "n/a", "without fault_tolerance a lost process ends the job (a SLURM requeue resumes it)",
         {"fault_tolerance": ("none",), "end": ("kill", "stall")}),
    Rule("local_exchange", "n/a", "local SGD's exchange value is its outer_exchange: one of auto, allgather, scatter",
         {"mode": ("local_sgd",)}, lambda c: c["exchange"] not in OUTER_EXCHANGES,
         "exchange not an outer exchange"),
    Rule("one_process", "n/a", "one process: nothing to exchange", test=lambda c: nodes(c) * procs(c) == 1,
         condition="1 process in all"),
    # ---- refused, at setup, before any collective ----
    Rule("node_tier_one_process", "refused",
         "topk_ddp: exchange={exchange!r} needs more than one process per node (devices={procs}); use "
         "exchange='auto' or 'scatter'",
         {"strategy": ("topk_ddp",), "exchange": NODE_TIER}, lambda c: procs(c) == 1, "1 process per node"),
    Rule("fsdp_node_tier", "refused",
         "topk_fsdp: exchange={exchange!r} is what topk_fsdp does already (FSDP's reduce-scatter is the node tier); "
         "choose the cross-node exchange: 'auto', 'allgather', 'scatter', 'dense' or 'dense_bf16'",
         {"strategy": ("topk_fsdp",), "exchange": NODE_TIER}),
    Rule("ft_exchange", "refused",
         "topk_ddp: fault_tolerance='torchft' runs over a replica count that changes between steps, which "
         "exchange={exchange!r} does not; use one of ['auto', 'allgather', 'scatter', 'dense']",
         {"fault_tolerance": ("torchft",)}, lambda c: c["exchange"] not in ELASTIC_EXCHANGES,
         "exchange not elastic"),
    Rule("ft_outer_scatter", "refused",
         "topk_ddp: fault_tolerance='torchft' with local_steps > 0 runs the outer all-gather (the scale-free "
         "owners' ranges assume a fixed replica count); set outer_exchange='allgather' or 'auto'",
         {"fault_tolerance": ("torchft",), "mode": ("local_sgd",), "exchange": ("scatter",)}),
    Rule("ft_ddp_local_procs", "refused",
         "topk_ddp: fault_tolerance='torchft' with local_steps > 0 runs one process per replica group (got "
         "devices={procs}); the outer round's shards over a group's processes are not built under torchft yet "
         "(docs/elastic.md): set devices=1, or local_steps=0, or shard the model over the group's processes with "
         "topk_fsdp (local SGD under torchft runs there)",
         {"strategy": ("topk_ddp",), "fault_tolerance": ("torchft",), "mode": ("local_sgd",)},
         lambda c: procs(c) > 1, "several processes per group"),
    Rule("partial_shard", "refused",
         "topk_fsdp: the model was sharded in part: no fully_shard holds some parameters, so their gradients would "
         "never be reduced within or across nodes; fully_shard the modules that hold them on "
         "self.device_mesh['shard'] (or, last, the module that contains them all), or shard nothing in "
         "configure_model and let topk_fsdp shard the model (shard_modules=...)",
         {"strategy": ("topk_fsdp",), "feature": ("partial_shard",)}, at="configure_model"),
    Rule("fsdp_missing_grad", "refused",
         "topk_fsdp: a sharded module's parameters got no gradient in this backward (FSDP leaves them out of its "
         "reduce-scatter), which the sparse exchange does not support; use every parameter of a sharded module in "
         "each backward, or put the unused ones in a module of their own",
         {"strategy": ("topk_fsdp",), "feature": ("unused", "unfreeze")}, at="first backward"),
)


def status(cell: Cell) -> Tuple[str, Optional[Rule]]:
    """``("supported", None)``, or the first matching rule's status and the rule."""
    for rule in RULES:
        if rule.matches(cell):
            return rule.status, rule
    return "supported", None


def cells() -> Iterator[Dict[str, str]]:
    """Every combination of the dimensions' values (``n/a`` ones included)."""
    names = list(DIMENSIONS)
    for values in itertools.product(*DIMENSIONS.values()):
        yield dict(zip(names, values))


def counts() -> Dict[str, int]:
    out = {"supported": 0, "refused": 0, "n/a": 0}
    for c in cells():
        out[status(c)[0]] += 1
    return out


def refuse(cell: Cell, at: str = "setup") -> None:
    """Raise ``ValueError`` with the matrix's message when ``cell`` is refused (by a rule that fires ``at``)."""
    st, rule = status(cell)
    if st == "refused" and rule is not None and rule.at == at:
        raise ValueError(rule.render(cell))


def message(name: str, **values: object) -> str:
    """The refusal message of rule ``name`` with ``values`` (the raise sites that check one option at a time)."""
    rule = next(r for r in RULES if r.name == name)
    cell = {**{d: "" for d in DIMENSIONS}, "layout": "1x1", **{k: str(v) for k, v in values.items()}}
    return rule.render(cell)


def pairwise(pool: Sequence[Cell], must: Sequence[Cell] = (),
             group: Optional[Callable[[Cell], object]] = None) -> List[Cell]:
    """A small subset of ``pool`` (supported cells) that covers every pair of (dimension, value)s that occurs in
    ``pool``, plus ``must``: greedy, deterministic (the first cell that covers most new pairs, in pool order; among
    equals, one whose ``group`` (e.g. its launch) is already chosen)."""
    def pairs(c: Cell) -> set:
        items = sorted(c.items())
        return {(a, b) for a, b in itertools.combinations(items, 2)}

    left = set().union(*(pairs(c) for c in pool)) if pool else set()
    chosen: List[Cell] = []
    for c in must:
        chosen.append(c)
        left -= pairs(c)
    cache = [(c, pairs(c)) for c in pool]
    keys = {group(c) for c in chosen} if group else set()
    while left:
        best, gain = None, (0, False)
        for c, p in cache:
            g = (len(p & left), bool(group) and group(c) in keys)
            if g[0] and g > gain:
                best, gain = (c, p), g
        assert best is not None
        chosen.append(best[0])
        left -= best[1]
        if group:
            keys.add(group(best[0]))
    return chosen


def cell_id(cell: Cell) -> str:
    return "-".join(cell[d] for d in DIMENSIONS)
