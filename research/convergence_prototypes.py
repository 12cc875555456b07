"""Prototypes of issue 22's third pass, patched into ``benchmarks/convergence.py``'s simulator (not shipped).

One line of JSON per density: steps to each target per seed, their means, the final accuracy. The variants
(``KEY=VALUE`` arguments; ``set.OPTION=VALUE`` sets a TopKConfig option, ``recipe=``/``opt=``/``dens=``/
``steps=``/``seeds=``/``task=`` pick the run):

* ``clip=X``: DGC local gradient clipping: each rank's gradient is clipped to X times a running mean (0.9
  EMA) of the ranks' local gradient norms before it enters the residual (a per-rank norm already carries
  DGC's N^-1/2 scaling of a global threshold);
* ``decay=X``: the residual is multiplied by X before each step's gradient is added;
* ``look=C``: the momentum lookahead as a separate score ``r + C*v`` (what ``momentum_lookahead`` now does
  in the residual itself); with ``tail=1`` the residual is zeroed where sent instead of keeping ``-C*v``
  (with masking and C = m/(1-m) this is plain error feedback on ``g/(1-m)`` with a momentum-free optimizer);
* ``fullk=1``: every entry is "selected" each step (the recipe's dense equivalent);
* ``lr=X`` / ``mom=X`` / ``nesterov=1``: the SGD learning rate, momentum, Nesterov.

Fourth pass (issue 22, 2026-11-27), other exchanges' arithmetic (``ex=``; sparse steps only):

* ``ex=union``: union sparse all-reduce: every rank picks its top-k of its accumulator as today, the index
  sets are all-gathered, and every rank sends its accumulator's values at the union U of the W sets (an
  all-reduce of |U| <= W*k values, summed, averaged over W) and clears its accumulator at all of U
  (``send_values``: zero for fp32 wire, the rounding error for bf16; with the lookahead the next step's
  accumulate leaves the debt -c*u there, as today);
* ``ex=cltk``: ScaleCom's cyclic local top-k: the leader rank (step mod W) picks k indices from its own
  accumulator, every rank sends its values there (an all-reduce of k values) and clears them;
* ``lpf=B`` (with ``ex=``): ScaleCom's low-pass filter on the error memory,
  ``m_new = (1-B)*m_old + B*(x - C(x))`` with ``x = m_old + (the step's accumulation)`` (B = 1: plain);
* ``kmul=X`` (with ``ex=``): k scaled by X (e.g. the union at fewer entries per rank);
* ``ualpha=A`` (with ``ex=union``): at the union's entries that a rank did not pick itself it sends only A
  times its accumulator and keeps the rest (A = 1: the union; A = 0: the all-gather's arithmetic, at the
  union's bytes); at its own picks it sends everything.

Each line then carries ``sent``: the mean number of distinct entries summed per step (|U| for the union,
k for CLT-k), for the wire bytes.

Usage::

    python research/convergence_prototypes.py NAME look=3 recipe=ef set.momentum_correction=true \\
        set.momentum_masking=false seeds=0,1,2,3,4 [--out results.jsonl]
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any, Dict, List, Optional, Tuple

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # the other prototype script
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks"))  # the shipped simulator
import convergence as C

from lightning_topk.comm.exchanges.kit import select, send_values, sparse_k, take_bucket
from lightning_topk.comm.wire import to_wire

P: Dict[str, float] = {}  # the prototype knobs
EX: Dict[str, str] = {}  # string knobs: ex=union|cltk
SENT: List[int] = []  # per step: distinct entries summed (ex=)


class Sim(C.SimulatedAllgather):
    def __init__(self, *a: Any, **k: Any) -> None:
        super().__init__(*a, **k)
        self.gnorm: Optional[torch.Tensor] = None

    def reduce(self, grads):  # type: ignore[override]
        if EX.get("ex"):
            return self.reduce_ex(grads, EX["ex"])
        clip = P.get("clip")
        if clip:
            norms = torch.stack([g.norm() for g in grads])
            ref = norms.mean() if self.gnorm is None else self.gnorm
            grads = [g * min(1.0, float(clip * ref / (g.norm() + 1e-12))) for g in grads]
            self.gnorm = norms.mean() if self.gnorm is None else 0.9 * self.gnorm + 0.1 * norms.mean()
        return super().reduce(grads)

    def rank_send(self, st, g, n):  # type: ignore[override]
        c, decay = P.get("look", 0.0), P.get("decay", 1.0)
        k, ks, numels = sparse_k(st, self.params, n)
        if P.get("fullk"):
            k = n
        if decay != 1.0:
            st.buffers(self.params, g.device).residual.mul_(decay)
        if k == 0 or not (c and st.config.momentum_correction):
            return super().rank_send(st, g, n) if not P.get("fullk") else self._send_all(st, g, n, k, ks, numels)
        b, acc, vel, _ = take_bucket(st, self.params, st.names_of(self.params), g, lookahead=True)
        lead = c * vel
        if P.get("agelead"):  # c per entry: half the steps since the entry was last sent, at most C
            age = getattr(st, "_age", None)
            if age is None:
                age = st._age = torch.zeros_like(vel)
            age.add_(1.0)
            lead = (age * P["agelead"]).clamp_(max=c) * vel
        beta, tau = P.get("leadclip"), getattr(st, "_tau", 0.0)
        if beta and tau is not None:
            if P.get("leadmode") == 1:  # lead ~ half the entry's sending interval tau/|v|, 0 where sent each step
                lead = vel.sign() * torch.minimum(lead.abs(), beta * (tau - vel.abs()).clamp_min(0.0))
            else:
                lead = lead.clamp(-beta * tau, beta * tau)
        if P.get("agree"):  # lead only where this step's gradient pushes the way the momentum goes
            lead = torch.where(torch.sign(g[:vel.numel()]) == torch.sign(vel), lead, torch.zeros_like(lead))
        score = acc + lead
        idx = select(st, score, k, ks, numels)
        values = score.index_select(0, idx)
        if P.get("tauacc"):  # the threshold of the accumulator alone (no feedback of the lead into tau)
            st._tau = float(acc.abs().topk(k).values[-1])
        else:
            st._tau = float(values.abs().min())
        if P.get("agelead"):
            st._age.index_fill_(0, idx, 0.0)
        if P.get("selonly"):  # the lead only picks the entries; they send what they hold
            values = acc.index_select(0, idx)
            acc.index_fill_(0, idx, 0.0)
        elif P.get("tail"):
            acc.index_fill_(0, idx, 0.0)
        else:
            acc.index_copy_(0, idx, -lead.index_select(0, idx))
        if st.config.momentum_masking:
            vel.index_fill_(0, idx, 0.0)
        return values, idx

    def reduce_ex(self, grads, ex):
        """``ex=union`` / ``ex=cltk``: every rank sends its values at one common index set."""
        n, world = grads[0].numel(), self.world
        self.t = getattr(self, "t", 0) + 1
        beta = P.get("lpf", 1.0)
        accs, vels, olds = [], [], []
        k = ks = numels = None
        for st, g in zip(self.states, grads):
            k, ks, numels = sparse_k(st, self.params, n)
            if k == 0:
                raise ValueError("convergence_prototypes: ex= is for sparse steps only")
            k = max(1, int(round(k * P.get("kmul", 1.0))))
            if beta != 1.0:
                olds.append(st.buffers(self.params, g.device).residual[:n].clone())
            _, acc, vel, _ = take_bucket(st, self.params, st.names_of(self.params), g, lookahead=True)
            accs.append(acc)
            vels.append(vel)
        own = None
        if ex == "union":
            own = [select(st, acc, k, ks, numels) for st, acc in zip(self.states, accs)]
            idx = torch.unique(torch.cat(own))
        elif ex == "cltk":
            leader = (self.t - 1) % world
            idx = select(self.states[leader], accs[leader], k, ks, numels)
        else:
            raise ValueError(f"convergence_prototypes: ex must be union or cltk, got {ex!r}")
        out = torch.zeros(n)
        alpha = P.get("ualpha", 1.0)
        for i, (st, acc, vel) in enumerate(zip(self.states, accs, vels)):
            if own is not None and alpha != 1.0:
                scale = torch.where(torch.isin(idx, own[i]), 1.0, alpha)
                wire = to_wire(acc.index_select(0, idx) * scale, st.config.wire_dtype).float()
                acc.index_add_(0, idx, -wire)  # keeps the unsent part and the rounding error
                if vel is not None and st.config.momentum_masking:
                    vel.index_fill_(0, own[i], 0.0)
                out.index_add_(0, idx, wire)
            else:
                out.index_add_(0, idx, send_values(st, acc, idx, vel).float())
            if beta != 1.0:
                acc.mul_(beta).add_(olds[i], alpha=1.0 - beta)
            st.end_exchange()
        SENT.append(idx.numel())
        return out.div_(world)

    def _send_all(self, st, g, n, k, ks, numels):
        b, acc, vel, _ = take_bucket(st, self.params, st.names_of(self.params), g, lookahead=True)
        idx = select(st, acc, k, ks, numels)
        return send_values(st, acc, idx, vel).float(), idx


_optimizer_for = C.optimizer_for


def optimizer_for(name, params, momentum_in_hook):
    if name == "sgd" and ("lr" in P or "mom" in P or "nesterov" in P):
        mom = 0.0 if momentum_in_hook else P.get("mom", 0.9)
        return torch.optim.SGD(params, lr=P.get("lr", 0.05), momentum=mom, weight_decay=5e-4,
                               nesterov=bool(P.get("nesterov")) and mom > 0)
    return _optimizer_for(name, params, momentum_in_hook)


def cli(argv: List[str], knobs: Dict[str, float], defaults: Dict[str, Any],
        string_knobs: Optional[Dict[str, str]] = None, string_keys: Tuple[str, ...] = (), extra_line: Any = None,
        check: Any = None) -> None:
    """Parse ``NAME KEY=VALUE ... [--out FILE]`` (``task``/``opt``/``recipe``/``dens``/``steps``/``seeds``,
    ``set.OPTION=VALUE`` for a TopKConfig option, a key in ``string_keys`` as a string into ``string_knobs``, anything else a float
    into ``knobs``), run the harness (``C.train``, with the simulator and optimizer the caller patched into
    ``convergence``) for each density and print one JSON line each (appended to FILE too). ``defaults``: the run's
    task, opt, recipe, dens, steps and seeds; ``extra_line()`` adds fields to a line; ``check(recipe)`` may
    refuse a combination (SystemExit). Shared by the prototype scripts (this one, ``convergence_adam.py``)."""
    import yaml

    name, out_path = argv[0], None
    run = dict(defaults)
    over: Dict[str, Any] = {}
    rest = argv[1:]
    if "--out" in rest:
        i = rest.index("--out")
        out_path, rest = rest[i + 1], rest[:i] + rest[i + 2:]
    for a in rest:
        k, v = a.split("=", 1)
        if k in ("task", "opt", "recipe"):
            run[k] = v
        elif k == "dens":
            run["dens"] = [float(x) for x in v.split(",")]
        elif k == "steps":
            run["steps"] = int(v)
        elif k == "seeds":
            run["seeds"] = [int(x) for x in v.split(",")]
        elif string_knobs is not None and k in string_keys:
            string_knobs[k] = v
        elif k.startswith("set."):
            over[k[4:]] = yaml.safe_load(v)
        else:
            knobs[k] = float(v)
    task, opt, recipe, steps = run["task"], run["opt"], run["recipe"], run["steps"]
    if check is not None:
        check(recipe)
    torch.set_num_threads(1)
    data = C.load(task)
    t1, t2 = C.TARGETS[task]
    for d in run["dens"]:
        rs = [C.train(task, opt, recipe, d if recipe != "dense" else 1.0, steps, seed=s, data=data,
                      overrides=None if recipe == "dense" else over) for s in run["seeds"]]
        s1, s2 = [r.steps_to(t1) for r in rs], [r.steps_to(t2) for r in rs]
        line = dict(name=name, task=task, opt=opt, recipe=recipe, d=d, P=dict(knobs), over=over, s1=s1, s2=s2,
                    m1=C._mean(s1), m2=C._mean(s2), final=round(sum(r.final for r in rs) / len(rs), 4), steps=steps,
                    finals=[round(r.final, 4) for r in rs], secs=round(sum(r.seconds for r in rs), 1))
        if extra_line is not None:
            line.update(extra_line())
        print(json.dumps(line), flush=True)
        if out_path:
            with open(out_path, "a") as f:
                f.write(json.dumps(line) + "\n")
        if recipe == "dense":
            break


def _sent_fields() -> Dict[str, Any]:
    out: Dict[str, Any] = dict(EX, sent=round(sum(SENT) / max(1, len(SENT)), 1)) if EX else {}
    SENT.clear()
    return out


def main(argv: List[str]) -> None:
    C.SimulatedAllgather = Sim  # type: ignore[misc]
    C.optimizer_for = optimizer_for
    cli(argv, P, dict(task="mnist5k", opt="sgd", recipe="auto", dens=[0.01, 0.001], steps=300, seeds=[0, 1, 2]),
        string_knobs=EX, string_keys=("ex",), extra_line=_sent_fields)


if __name__ == "__main__":
    main(sys.argv[1:])
