"""Your existing Lightning project, with top-k gradient exchange: no Hydra, just ``strategy="topk_ddp"``.

    pip install "lightning-topk[data]"
    python examples/plain_lightning/train_digits.py            # 2 CPU processes (or all GPUs)

The only lines that are about lightning_topk are marked with  # <-- lightning_topk.
"""
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

import lightning_topk  # noqa: F401  <-- lightning_topk: registers "topk_ddp" with Lightning
from lightning_topk import TopKDDPStrategy  # <-- lightning_topk (only needed to pass options)


class Net(pl.LightningModule):
    def __init__(self, lr: float = 0.1):
        super().__init__()
        self.lr = lr
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(1, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(32, 64, 3, padding=1),
            torch.nn.ReLU(), torch.nn.MaxPool2d(2), torch.nn.Flatten(), torch.nn.Linear(64 * 16, 128),
            torch.nn.ReLU(), torch.nn.Linear(128, 10))

    def training_step(self, batch, _):
        x, y = batch
        loss = F.cross_entropy(self.body(x), y)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, _):
        x, y = batch
        self.log("val/acc", (self.body(x).argmax(1) == y).float().mean(), prog_bar=True, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, fused=True)


def data():
    d = load_digits()  # ships with scikit-learn; nothing is downloaded
    x = (torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0 - 0.3) / 0.35
    y = torch.tensor(d.target)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    return (DataLoader(TensorDataset(x[:1400], y[:1400]), batch_size=32, shuffle=True),
            DataLoader(TensorDataset(x[1400:], y[1400:]), batch_size=128))


if __name__ == "__main__":
    pl.seed_everything(0)
    gpus = torch.cuda.device_count()
    trainer = pl.Trainer(
        accelerator="gpu" if gpus else "cpu",
        devices=gpus or 2,
        # strategy="topk_ddp" works as is (density 0.01); pass the class to set options:
        strategy=TopKDDPStrategy(density=0.01, min_sparse_numel=4096),  # <-- lightning_topk
        max_epochs=5,
    )
    train, val = data()
    trainer.fit(Net(), train, val)
    if trainer.is_global_zero:
        t = trainer.strategy.topk_totals  # <-- lightning_topk: bytes this rank sent vs a dense all-reduce
        print(f"val/acc {float(trainer.callback_metrics['val/acc']):.3f}; sent {t.bytes_sent / 1e6:.1f} MB "
              f"instead of {t.bytes_dense / 1e6:.1f} MB ({t.bytes_dense / max(1, t.bytes_sent):.0f}x less)")
