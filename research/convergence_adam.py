"""Issue 22, AdamW: Adam's statistics moved into the hook, prototyped in ``benchmarks/convergence.py``'s
simulator (not shipped). One line of JSON per density, as ``convergence_prototypes.py`` writes them.

Variants (``KEY=VALUE``; ``recipe=``/``opt=``/``dens=``/``steps=``/``seeds=``/``task=`` pick the run,
``set.OPTION=VALUE`` a TopKConfig option, ``lr=X`` the optimizer's learning rate):

* ``adam=1`` (variant 1, "preconditioned update exchange"): each rank keeps Adam moments ``m_i``, ``v_i`` of
  its own dense local gradient (bias-corrected, ``b1``/``b2`` 0.9/0.999, ``eps`` 1e-8); its error-feedback
  residual takes ``u_i = m_hat_i / (sqrt(v_hat_i) + eps)`` in place of the gradient; top-k of the residual is
  sent and averaged (the all-gather's arithmetic, unchanged); the optimizer is ``SGD(lr, momentum=0,
  weight_decay=wd)``, which for a step that does not depend on θ is exactly AdamW's decoupled decay
  (``θ -= lr*wd*θ`` on every coordinate, every step) plus ``θ -= lr*avg(u)``. Run with ``recipe=ef``; at
  ``dens=1`` (every step dense) it is AdamW with per-rank moments of the local gradients.
* ``look=C`` (variant 3): the residual takes ``u + C*(u - u_prev)`` (``momentum_lookahead``'s form: a sent
  entry carries C steps of its update ahead, the residual keeps the debt).
* ``sel=P``: the residual (in update units) is selected by ``|acc| * den**P`` (den = ``sqrt(v_hat) + eps``, the
  rank's or the shared one) instead of ``|acc|``: P = 1 ranks by the momentum (gradient units, as plain error
  feedback does), P = 0.5 by ``acc_m * acc_u``, the entry's first-order loss decrease.
* ``floor=1``: with a shared ``v`` (``frozen``/``vevery``), each rank also keeps its local ``v_i`` and divides by
  ``max(sqrt(v_shared_hat), sqrt(v_i_hat / W)) + eps`` (the shared v alone divides by eps at entries whose
  averaged gradient was 0 when v was sampled, and diverged).
* ``frozen=T`` (variant 2, 1-bit Adam's frozen variance): the first T steps exchange dense and run Adam on
  the averaged gradient (shared ``m``, ``v``); then ``v_hat`` is frozen (shared by every rank), each rank
  continues its own ``m_i`` (from the shared ``m``) on its local gradient and its residual takes
  ``m_hat_i / (sqrt(v_frozen) + eps)``. With ``m`` local and ``v`` shared the update is linear in ``m``, so at
  density 1 the average of the ranks' updates is Adam's on the averaged gradient with that ``v``.
* ``vevery=K`` (variant 2, refreshed): the shared ``v`` is refreshed from a dense all-reduce of the gradient
  every K steps (from step 1, or after the ``frozen`` warm-up), a sampled EMA with decay ``b2**K`` per
  sample and its own bias correction; the sparse exchange of ``m_hat_i / (sqrt(v) + eps)`` runs every step.
  Costs one dense all-reduce per K steps on top of the sparse exchange.

Usage::

    python research/convergence_adam.py NAME opt=adamw recipe=ef adam=1 dens=0.01,0.001 seeds=0,1,2,3,4 \\
        steps=500 [--out results.jsonl]
"""
from __future__ import annotations

import os
import sys
from typing import Any, Dict, List, Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # the other prototype script
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks"))  # the shipped simulator
import convergence as C

from lightning_topk.comm.exchanges.kit import select, send_values, sparse_k, take_bucket

P: Dict[str, float] = {}  # the prototype knobs
B1, B2, EPS, WD = 0.9, 0.999, 1e-8, 0.01


class AdamInHook(C.SimulatedAllgather):
    """The simulated all-gather with each rank's Adam in front of its error-feedback residual."""

    def __init__(self, *a: Any, **k: Any) -> None:
        super().__init__(*a, **k)
        self.t = 0
        self.m: List[torch.Tensor] = []
        self.v: List[torch.Tensor] = []
        self.u_prev: List[torch.Tensor] = []
        self.v_frozen: Optional[torch.Tensor] = None
        self.den: Dict[int, torch.Tensor] = {}

    def reduce(self, grads):  # type: ignore[override]
        if not (P.get("adam") or P.get("frozen") or P.get("vevery")):
            return super().reduce(grads)
        self.t += 1
        t, w = self.t, len(grads)
        if not self.m:
            self.m = [torch.zeros_like(grads[0]) for _ in range(w)]
            self.v = [torch.zeros_like(grads[0]) for _ in range(w)]
            self.u_prev = [torch.zeros_like(grads[0]) for _ in range(w)]
        bc1, bc2 = 1 - B1 ** t, 1 - B2 ** t
        frozen, every = int(P.get("frozen", 0)), int(P.get("vevery", 0))
        if frozen and t <= frozen:  # dense warm-up: Adam on the averaged gradient, moments shared
            g = torch.stack(grads).mean(0)
            for m, v in zip(self.m, self.v):
                m.mul_(B1).add_(g, alpha=1 - B1)
                v.mul_(B2).addcmul_(g, g, value=1 - B2)
            for st in self.states:
                st.end_exchange()
            self.vs = self.v[0].clone()  # the shared v (the ranks' v go on locally for the floor)
            self.v_frozen = (self.vs / bc2).sqrt_().add_(EPS)
            self.vbc = bc2
            return (self.m[0] / bc1) / self.v_frozen
        if every and (t - frozen - 1) % every == 0:
            # a dense all-reduce of the gradient (1/every of the steps) feeds the shared v: a sampled EMA with
            # the same time constant (decay b2**every per sample), bias-corrected by its own count
            g = torch.stack(grads).mean(0)
            d = B2 ** every
            if self.v_frozen is None:
                self.vs, self.vbc = torch.zeros_like(g), 0.0
            self.vs.mul_(d).addcmul_(g, g, value=1 - d)
            self.vbc = 1 - (1 - self.vbc) * d
            self.v_frozen = (self.vs / self.vbc).sqrt_().add_(EPS)
        c = P.get("look", 0.0)
        us = []
        for r, g in enumerate(grads):
            m, v = self.m[r], self.v[r]
            m.mul_(B1).add_(g, alpha=1 - B1)
            if self.v_frozen is not None and P.get("floor"):
                # the shared v, floored by the rank's own v / W (a lower bound of the averaged gradient's
                # second moment in expectation): no entry divides by eps where the shared v missed it
                v.mul_(B2).addcmul_(g, g, value=1 - B2)
                den = torch.maximum(self.v_frozen, (v / (bc2 * w)).sqrt_().add_(EPS))
            elif self.v_frozen is not None:
                den = self.v_frozen
            else:
                v.mul_(B2).addcmul_(g, g, value=1 - B2)
                den = (v / bc2).sqrt_().add_(EPS)
            u = (m / bc1) / den
            self.den[r] = den
            if c:
                send = u + c * (u - self.u_prev[r])
                self.u_prev[r] = u
                u = send
            us.append(u)
        return super().reduce(us)


    def rank_send(self, st, g, n):  # type: ignore[override]
        p = P.get("sel")
        if p is None or not self.den:
            return super().rank_send(st, g, n)
        k, ks, numels = sparse_k(st, self.params, n)
        if k == 0:
            return super().rank_send(st, g, n)
        b, acc, vel, _ = take_bucket(st, self.params, st.names_of(self.params), g, lookahead=True)
        score = acc * self.den[self.states.index(st)].pow(p)
        idx = select(st, score, k, ks, numels)
        return send_values(st, acc, idx, vel).float(), idx


_optimizer_for = C.optimizer_for


def optimizer_for(name, params, momentum_in_hook):
    lr = P.get("lr")
    if name == "adamw" and (P.get("adam") or P.get("frozen") or P.get("vevery")):
        # the averaged update applied as plain SGD: θ -= lr*wd*θ + lr*u (= AdamW's decoupled decay)
        return torch.optim.SGD(params, lr=lr or 1e-3, momentum=0.0, weight_decay=WD)
    if name == "adamw" and lr:
        return torch.optim.AdamW(params, lr=lr, weight_decay=WD)
    return _optimizer_for(name, params, momentum_in_hook)


def _check(recipe: str) -> None:
    if recipe == "dense" and (P.get("adam") or P.get("frozen") or P.get("vevery")):
        raise SystemExit("convergence_adam: adam=/frozen= need a sparse recipe (recipe=ef, dens=1 for dense)")


def main(argv: List[str]) -> None:
    from convergence_prototypes import cli

    C.SimulatedAllgather = AdamInHook  # type: ignore[misc]
    C.optimizer_for = optimizer_for
    cli(argv, P, dict(task="mnist5k", opt="adamw", recipe="ef", dens=[0.01, 0.001], steps=500, seeds=[0, 1, 2, 3, 4]),
        check=_check)


if __name__ == "__main__":
    main(sys.argv[1:])
