"""Issue 33, AdamW per step: a one-process simulation of ``benchmarks/bench_fsdp.py``'s accuracy run (2 nodes x 2
processes, the byte-level LM, AdamW lr 2e-3 with 10 warm-up steps then cosine, 360 steps, 16 sequences per rank),
with the optimizer written out so that its variants are one flag each. Not shipped
one line of JSON per run.

Each step: the 4 ranks' gradients
each node's mean (FSDP's reduce-scatter inside the node, here the whole vector);
then, by ``--mode``:

* ``dense``: the mean over nodes (HSDP). With no other flag this reproduces bench_fsdp's ``hsdp`` held-out loss
  exactly on torch 2.13 CPU (2.4393159759931327).
* ``topk``: per node error feedback + top-k (``--density``) of the whole vector (bench_fsdp: per bucket), the average
  of the two nodes' sparse vectors goes to AdamW (``topk_fsdp``
  3.142 here against bench_fsdp's 3.169).
* ``mom``: after the freeze, each node keeps its own momentum and error feedback takes m_i / (sqrt(v_frozen) + eps)
  (1-bit Adam's exchange, top-k instead of sign)
  the learning rate multiplies what was sent.
* ``mom2``: after ``--dense-steps``, each node runs AdamW on its own gradient and error feedback takes the update
  (parameter units, weight decay included) - what ``topk_fsdp`` with ``local_steps=1`` does.

Flags: ``--dense-steps N`` (the first N steps dense), ``--freeze W`` (v and its bias correction frozen after step W),
``--vmode local`` (v from the dense mean gradient, an upper bound that needs a dense exchange), ``--floor 1``
(coordinates whose frozen v is 0 keep a live v), ``--flush 1`` (mom2: the residuals applied after the last step),
``--lrmul``, ``--seed`` (the model's initialisation; the data order is bench_fsdp's).

mom2's packets go through the outer codec itself (:func:`lightning_topk.comm.local.codec.compress`, the top-k per
chunk and the value quantization ``topk_fsdp`` with ``local_steps=1`` sends), on each node's whole vector zero-padded
to whole chunks: ``--chunk`` (entries per chunk, ``outer_chunk``; 0: one top-k of the whole vector), ``--bits``
(``outer_value_bits``), ``--ef-decay`` (``outer_ef_decay``: ``e = beta * e + update``), ``--warm W --warm-start s``
(after the dense steps the density decays geometrically from s to ``--density`` over W steps, DGC's warm-up,
:class:`~lightning_topk.comm.schedule.DensitySchedule`), ``--ef ef21`` (EF21: each node sends the top-k of its update
minus its last estimate, the estimates move by what was sent, and the weights take the mean estimate every step),
``--mask 1`` (DGC's momentum-factor masking: a node's momentum is zeroed where it sent), ``--b1s b`` (AdamW's beta1
after the dense steps in ``mom2``; in ``dense``/``topk`` after ``--b1-from`` steps, default ``--freeze``; the third
sweep), ``--lrs x`` (``mom2``: the learning rate times x after the dense steps).
Each row records the mean density of the sparse steps (``rho_sparse``) and the packet bytes per node per step over
the whole run against a dense fp32 vector's (``bytes_vs_dense``; the dense steps and a flush count as 4 bytes per
entry). ``--out FILE`` appends the row to FILE with ``--host``.
Usage: ``python research/adam_lm_sim.py --mode topk --dense-steps 100 --freeze 100``.
"""
import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lightning_topk.comm.local.codec import PacketLayout, chunk_k, chunk_size, compress
from lightning_topk.comm.schedule import DensitySchedule
from lightning_topk.data.text import VOCAB_SIZE, byte_sequences
from lightning_topk.models.components.transformer import TransformerLM

ap = argparse.ArgumentParser()
ap.add_argument("--mode", default="topk")  # dense | topk
ap.add_argument("--density", type=float, default=0.01)
ap.add_argument("--dense-steps", type=int, default=0)
ap.add_argument("--freeze", type=int, default=0)  # freeze v after this many steps (0: never)
ap.add_argument("--steps", type=int, default=360)
ap.add_argument("--lr", type=float, default=2e-3)
ap.add_argument("--vmode", default="recv")  # recv | local (v from the node's dense gradient, averaged across nodes)
ap.add_argument("--tag", default="")
ap.add_argument("--floor", type=int, default=0)  # coordinates whose frozen v is 0 keep the live v
ap.add_argument("--lrmul", type=float, default=1.0)
ap.add_argument("--flush", type=int, default=0)  # mom2: apply the residuals at the end
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--chunk", type=int, default=0)  # mom2: entries per top-k chunk (0: the whole vector)
ap.add_argument("--bits", type=int, default=32)  # mom2: bits per value sent
ap.add_argument("--ef-decay", type=float, default=1.0)  # mom2: e = beta * e + update
ap.add_argument("--warm", type=int, default=0)  # mom2: density warm-up steps after the dense steps
ap.add_argument("--warm-start", type=float, default=0.25)
ap.add_argument("--ef", default="ef")  # mom2: ef | ef21
ap.add_argument("--mask", type=int, default=0)  # mom2: DGC's momentum-factor masking (sent entries' m_i zeroed)
ap.add_argument("--lrs", type=float, default=1.0)  # mom2: learning-rate multiplier after the dense steps only
ap.add_argument("--b1s", type=float, default=-1.0)  # beta1 after the dense steps (mom2), after --freeze (dense, topk)
ap.add_argument("--b1-from", type=int, default=-1)  # dense/topk: --b1s from after this step (-1: --freeze)
ap.add_argument("--out", default="")
ap.add_argument("--host", default="")
a = ap.parse_args()
torch.set_num_threads(1)
seq_len = 65
train, val = byte_sequences(seq_len=seq_len, val_fraction=0.05, seed=0)
torch.manual_seed(a.seed)
net = TransformerLM(VOCAB_SIZE, d_model=128, layers=2, heads=4, ff_mult=4, max_len=64, dropout=0.0)
params = list(net.parameters())
world, B = 4, 16
data = [torch.from_numpy(train[r::world].astype(np.int64)) for r in range(world)]


def loss_of(x):
    logits = net(x[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB_SIZE), x[:, 1:].reshape(-1))


def lr_at(step):
    warm = 10
    if step < warm:
        return (step + 1) / warm
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, a.steps - warm))))


n = sum(p.numel() for p in params)
res = [torch.zeros(n), torch.zeros(n)]
m = torch.zeros(n)
v = torch.zeros(n)
b1, b2, eps, wd = 0.9, 0.999, 1e-8, 0.01
flat = torch.cat([p.detach().reshape(-1) for p in params])
ms = vs = den_frozen = v_fz = vl = None
sched = DensitySchedule(a.density, a.dense_steps, a.warm, a.warm_start)
c = chunk_size(n, a.chunk)
C = -(-n // c)
est: list = []  # ef21: each node's estimate of its update
last_upd = torch.zeros(n)  # the last dense step's update
sent_bytes, sent_numel, sparse_steps = 0, 0, 0
losses = []
t0 = time.time()
for step in range(a.steps):
    grads = []
    for r in range(world):
        nb = len(data[r]) // B
        x = data[r][(step % nb) * B:(step % nb) * B + B]
        for p in params:
            p.grad = None
        loss = loss_of(x)
        loss.backward()
        losses.append(float(loss.detach()))
        grads.append(torch.cat([p.grad.reshape(-1) for p in params]))
    node = [(grads[0] + grads[1]) / 2, (grads[2] + grads[3]) / 2]
    dense_g = (node[0] + node[1]) / 2
    lr = a.lr * a.lrmul * lr_at(step)
    if a.mode == "mom2" and step >= a.dense_steps:
        lr *= a.lrs
    t = step + 1
    frozen = a.freeze and t > a.freeze
    prev = flat.clone()
    flat.mul_(1 - lr * wd)
    if a.mode == "mom2" and step >= a.dense_steps:  # each node's AdamW update (param units), per-chunk top-k
        if ms is None:
            ms = [m.clone(), m.clone()]
            vs = [v.clone(), v.clone()]
            res = [torch.zeros(C * c), torch.zeros(C * c)]
            if a.ef == "ef21":  # the estimates start at the last dense step's update (every node knows it)
                est = [torch.zeros(C * c), torch.zeros(C * c)]
                est[0][:n] = last_upd
                est[1][:n] = last_upd
        b1m = b1 if a.b1s < 0 else a.b1s
        bc1 = 1 - b1m ** t
        lay = PacketLayout(C, c, chunk_k(c, sched.density_at(step)), a.bits)
        sent_bytes += lay.nbytes
        sent_numel += lay.C * lay.k
        sparse_steps += 1
        out = torch.zeros(C * c)
        for i in range(2):
            ms[i].lerp_(node[i], 1 - b1m)
            if frozen:
                den = den_frozen
            else:
                vs[i].mul_(b2).addcmul_(node[i], node[i], value=1 - b2)
                den = (vs[i].sqrt() / math.sqrt(1 - b2 ** t)).add_(eps)
            upd = torch.zeros(C * c)
            upd[:n] = (lr * wd) * flat + (lr / bc1) * ms[i] / den
            if a.ef == "ef21":  # send top-k(update - estimate); the weights take the estimates' mean
                _, sent = compress(upd - est[i], lay)
                est[i] += sent
                out += est[i]
            else:
                res[i].mul_(a.ef_decay).add_(upd)
                _, sent = compress(res[i], lay)  # res keeps what was not sent
                out += sent
                if a.mask:
                    ms[i].masked_fill_(sent[:n] != 0, 0.0)
        flat.mul_(1 / (1 - lr * wd))
        flat.sub_(out[:n] / 2)
        if a.flush and t == a.steps:
            flat.sub_((res[0] + res[1])[:n] / 2)
            sent_bytes += 4 * n
    elif a.mode == "mom" and frozen:  # 1-bit Adam: local m_i, EF on m_i/den, frozen den
        if ms is None:
            ms = [m.clone(), m.clone()]
        bc1 = 1 - b1 ** t
        k = max(1, int(math.ceil(a.density * n)))
        out = torch.zeros(n)
        for i in range(2):
            ms[i].lerp_(node[i], 1 - b1)
            acc = res[i] + ms[i] / bc1 / den_frozen
            idx = acc.abs().topk(k).indices
            sent = torch.zeros(n)
            sent[idx] = acc[idx]
            res[i] = acc - sent
            out += sent
        flat.add_(out / 2, alpha=-lr)
    else:
        if a.mode == "dense" or step < a.dense_steps:
            g = dense_g
        else:
            k = max(1, int(math.ceil(a.density * n)))
            out = torch.zeros(n)
            for i in range(2):
                acc = res[i] + node[i]
                idx = acc.abs().topk(k).indices
                sent = torch.zeros(n)
                sent[idx] = acc[idx]
                res[i] = acc - sent
                out += sent
            g = out / 2
        b1_from = a.freeze if a.b1_from < 0 else a.b1_from
        m.lerp_(g, 1 - (a.b1s if a.b1s >= 0 and (b1_from or a.b1_from == 0) and t > b1_from else b1))
        if frozen:
            if a.floor:
                vl.mul_(b2).addcmul_(g, g, value=1 - b2)
                denom = torch.where(v_fz > 0, den_frozen, (vl.sqrt() / math.sqrt(1 - b2 ** t)).add_(eps))
            else:
                denom = den_frozen
        else:
            gv = dense_g if a.vmode == "local" else g
            v.mul_(b2).addcmul_(gv, gv, value=1 - b2)
            bc2 = 1 - b2 ** t
            denom = (v.sqrt() / math.sqrt(bc2)).add_(eps)
            den_frozen = denom.clone()
            v_fz = v.clone()
            vl = v.clone()
        bc1 = 1 - b1 ** t
        flat.addcdiv_(m, denom, value=-lr / bc1)
    last_upd = prev - flat
    off = 0
    with torch.no_grad():
        for p in params:
            p.copy_(flat[off:off + p.numel()].view_as(p))
            off += p.numel()
net.eval()
vv = torch.from_numpy(val.astype(np.int64))
tot = 0.0
with torch.no_grad():
    for i in range(0, len(vv), 64):
        x = vv[i:i + 64]
        tot += float(loss_of(x)) * len(x)
vl = tot / len(vv)
r = dict(vars(a), val_loss=vl, train_last10=sum(losses[-40:]) / 40, wall=time.time() - t0)
if a.mode == "mom2":
    dense_steps = min(a.steps, a.dense_steps)
    r["rho_sparse"] = sent_numel / max(1, sparse_steps) / n
    r["bytes_vs_dense"] = (sent_bytes + 4 * n * dense_steps) / a.steps / (4 * n)
    r["numel"] = n
if a.mode == "dense" or (a.mode == "topk" and a.dense_steps >= a.steps):
    r["bytes_vs_dense"] = 1.0
host = r.pop("host")
out_path = r.pop("out")
print(json.dumps(r), flush=True)
if out_path:
    with open(out_path, "a") as f:
        f.write(json.dumps(dict(r, host=host)) + "\n")
