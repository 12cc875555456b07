"""``Fabric(strategy="topk_fsdp")`` with a hand-written loop on tests/scripts/fsdp_train.py's model and batches, as
simulated nodes (tests.helpers.procs.run_nodes; 2 processes per node). Rank 0 writes OUT: the final full
parameters (named as under the Trainer script's LightningModule, ``net.``), and every rank OUT.rank<r>: its step
counter and residual sum.

  --density D --value-dtype V --exchange E   top-k options
  --steps N                                  optimizer steps
  --save-at S --save PATH                    fabric.save(PATH, ...) after step S
  --resume PATH                              fabric.load(PATH, ...) first (then steps from the saved step on)
  --local-steps H                            local SGD (outer_value_bits=4, outer_density=0.1): OUT.rank<r> also has
                                             "local_params" and "opt_state" (this rank's shards)
  --torchft R                                fault_tolerance="torchft" (lighthouse: $TORCHFT_LIGHTHOUSE, min_replicas=2):
                                             this run is replica group R of 2 (num_nodes=1), reading node R's batches;
                                             the loop's step is strategy.topk_elastic_position; OUT.rank<r> has "ft"
"""
import argparse
import os
import sys
import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fsdp_train import VOCAB, T, data

import lightning_topk  # noqa: F401  (registers topk_fsdp)
from lightning_topk.models.components.transformer import TransformerLM

warnings.filterwarnings("ignore")


def main():
    from lightning.fabric import Fabric

    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--value-dtype", default="bf16")
    p.add_argument("--exchange", default="allgather")
    p.add_argument("--save-at", type=int, default=-1)
    p.add_argument("--save")
    p.add_argument("--resume")
    p.add_argument("--torchft", type=int, default=None)
    p.add_argument("--local-steps", type=int, default=0)
    a = p.parse_args()
    torch.set_num_threads(1)
    from lightning_topk.lightning.fsdp_fabric import fabric_fsdp_class

    ft = {} if a.torchft is None else dict(fault_tolerance="torchft", min_replicas=2, ft_timeout=30.0,
                                           ft_quorum_timeout=60.0, ft_connect_timeout=5.0)
    strategy = fabric_fsdp_class("lightning.fabric")(density=a.density, value_dtype=a.value_dtype,
                                                     exchange=a.exchange, min_sparse_numel=0,
                                                     local_steps=a.local_steps, outer_chunk=64, **ft)
    fabric = Fabric(accelerator="cpu", devices=2, num_nodes=2 if a.torchft is None else 1, strategy=strategy)
    fabric.launch()
    rank = fabric.global_rank if a.torchft is None else 2 * a.torchft + fabric.global_rank
    torch.manual_seed(0)
    model = fabric.setup_module(TransformerLM(VOCAB, d_model=32, layers=2, heads=2, ff_mult=2, max_len=T, dropout=0.0))
    # torchft: the first quorum runs here
    opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, foreach=False))
    state = {"model": model, "optimizer": opt, "step": 0}
    if a.resume:
        fabric.load(a.resume, state)
    loader = DataLoader(data(rank, 4), batch_size=8, shuffle=False)
    batches = list(loader)
    step = state["step"]
    while step < a.steps:
        if a.torchft is not None:
            step = fabric.strategy.topk_elastic_position
        (x,) = batches[step % len(batches)]
        logits = model(x[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), x[:, 1:].reshape(-1))
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        step += 1
        if a.torchft is not None:
            step = fabric.strategy.topk_elastic_position
        if step == a.save_at:
            state["step"] = step
            fabric.save(a.save, state)
    full = {f"net.{n}": q.full_tensor().detach().clone() for n, q in getattr(model, "module", model).named_parameters()}
    st = fabric.strategy.topk_state
    info = {"step": step, "exchange_step": st.step if st is not None else None,
            "residual_sum": float(sum(t.double().sum() for t in st.residuals().values())) if st is not None else 0.0}
    if a.local_steps:
        from lightning_topk.comm.sharded import local_optimizer_state, local_tensor

        info.update(local_params={n: local_tensor(q).detach().clone() for n, q in model.named_parameters()},
                    opt_state=local_optimizer_state(opt.optimizer)["state"])
    ft = fabric.strategy.topk_elastic
    if ft is not None:
        info.update(ft=ft.metrics(), quorum_sizes=list(ft.quorum_sizes))
    torch.save(info, f"{a.out}.rank{fabric.global_rank}")
    if fabric.global_rank == 0:
        torch.save(full, a.out)
    if ft is not None:
        fabric.strategy.teardown()  # Fabric does not call it: it shuts the torchft Manager down


if __name__ == "__main__":
    main()
