"""A Lightning Fabric loop whose replica groups come and go: top-k exchange under torchft (docs/elastic.md, "Fabric").

    pip install 'lightning-topk[ft]' lightning
    python -m lightning_topk.app.elastic_launch --bind 127.0.0.1:29510 --min_replicas 1 \\
        --replicas 3 --max_restarts 5 -- python examples/fabric/train_elastic.py

Each copy is one replica group (one process here; ``devices`` may be several). ``kill -9`` one: the others go on
stepping; the launcher restarts it, it heals from a live peer inside ``fabric.setup`` and trains on at the peers'
step. What the loop must do is marked  # <-- torchft:

1. set up the model and its one optimizer together, ``fabric.setup(model, optimizer)``: the first quorum (and a
   heal) runs in there;
2. at the top of each iteration, read the position ``fabric.strategy.topk_elastic_position`` (torchft's committed
   step; with ``local_steps`` > 0, the inner step) and derive from it everything the step uses that the heal does
   not carry: the batch, the learning rate. After a heal it is the peers', so the loop is at their position; after
   a step the replicas did not commit it is unchanged, so the batch is replayed;
3. end with ``fabric.strategy.teardown()`` (Fabric does not call it): it leaves torchft cleanly.
"""
import math
import os
import zlib

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from train_digits import data  # the digits, as the plain Fabric example loads them

from lightning_topk.lightning.fabric import FabricTopKDDPStrategy

STEPS, BATCH, LR = 600, 32, 3e-3


def main():
    strategy = FabricTopKDDPStrategy(fault_tolerance="torchft", density=0.05)  # lighthouse: $TORCHFT_LIGHTHOUSE
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)  # the first quorum gives every replica group the same weights anyway (torchft's init_sync)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optimizer = fabric.setup(model, optimizer)  # <-- torchft: 1. a replica group that is behind heals here

    train, val = data()
    x, y = train.tensors
    # each replica group its own order (by its name), the same position (epoch, batch index) as its peers
    seed = zlib.crc32(os.environ.get("REPLICA_GROUP_ID", "replica0").encode())
    per_epoch = -(-len(y) // BATCH)

    def batch_at(step):
        epoch, b = divmod(step, per_epoch)
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed * 1000 + epoch))
        idx = order[b * BATCH:(b + 1) * BATCH]
        return x[idx].to(fabric.device), y[idx].to(fabric.device)

    while (step := fabric.strategy.topk_elastic_position) < STEPS:  # <-- torchft: 2. the peers' after a heal
        for group in optimizer.param_groups:  # <-- torchft: 2. the learning rate from the step, not a counter
            group["lr"] = LR * 0.5 * (1 + math.cos(math.pi * step / STEPS))
        xb, yb = batch_at(step)  # <-- torchft: 2. the batch from the step
        loss = F.cross_entropy(model(xb), yb)
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()  # commits (or rolls back) with the quorum, then forms the next step's quorum
        if step % 100 == 0:
            ft = fabric.strategy.topk_elastic
            fabric.print(f"step {step}: loss {loss.item():.3f}, {ft.quorum_size} replica group(s), heals {ft.heals}")
    with torch.no_grad():
        xv, yv = (t.to(fabric.device) for t in val.tensors)
        fabric.print(f"val accuracy {(model(xv).argmax(1) == yv).float().mean().item():.3f}")
    fabric.strategy.teardown()  # <-- torchft: 3.


if __name__ == "__main__":
    main()
