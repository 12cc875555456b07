"""A Lightning Fabric training loop with top-k gradient exchange: ``Fabric(strategy="topk_ddp")``.

    pip install lightning-topk lightning                       # lightning provides lightning.fabric
    python examples/fabric/train_digits.py                      # 2 CPU processes (or all GPUs)

The digits ship with lightning_topk (``load_arrays("digits")``): nothing is downloaded. The lines that are
about lightning_topk are marked with  # <-- lightning_topk. See docs/fabric.md.
"""
import os

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric, seed_everything
from torch.utils.data import DataLoader, TensorDataset

import lightning_topk  # noqa: F401  <-- lightning_topk: registers "topk_ddp" with Fabric too
from lightning_topk.data import load_arrays


def data():
    images, labels = load_arrays("digits")
    x = (torch.tensor(images, dtype=torch.float32).unsqueeze(1) / 255.0 - 0.3) / 0.35
    y = torch.tensor(labels)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    return TensorDataset(x[:1400], y[:1400]), TensorDataset(x[1400:], y[1400:])


def main(epochs: int = 6, out: str = "fabric_digits"):
    devices = torch.cuda.device_count() or 2
    fabric = Fabric(accelerator="auto", devices=devices, strategy="topk_ddp")  # <-- lightning_topk
    fabric.launch()
    seed_everything(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(32, 64, 3, padding=1),
        torch.nn.ReLU(), torch.nn.MaxPool2d(2), torch.nn.Flatten(), torch.nn.Linear(64 * 16, 128),
        torch.nn.ReLU(), torch.nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = fabric.setup(model, optimizer)
    train, val = data()
    loader = fabric.setup_dataloaders(DataLoader(train, batch_size=32, shuffle=True))
    ckpt = os.path.join(out, "last.ckpt")
    state = {"model": model, "optimizer": optimizer, "epoch": 0}
    if os.path.isfile(ckpt):  # preempted earlier: continue, with every rank's residuals restored
        fabric.load(ckpt, state)
    for epoch in range(state["epoch"], epochs):
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()
        topk = fabric.strategy.topk_metrics()  # <-- lightning_topk: reduced over ranks (call on every rank)
        fabric.print(f"epoch {epoch}: loss {loss.item():.3f}, compression {topk['topk/compression']:.1f}x, "
                     f"density {topk['topk/density']:.4f}")
        state["epoch"] = epoch + 1
        fabric.save(ckpt, state)  # rank 0 writes the file; every rank writes its residual shard beside it
    with torch.no_grad():
        x, y = (t.to(fabric.device) for t in val.tensors)
        fabric.print(f"val accuracy {(model(x).argmax(1) == y).float().mean().item():.3f}")


if __name__ == "__main__":
    main()
