"""A LightningCLI script (``pytorch_lightning.cli`` or, with LIGHTNING_NS=lightning, ``lightning.pytorch.cli``) on
sklearn's digits: ``python tests/scripts/cli_fit.py fit --trainer.strategy=topk_ddp ...``. Rank 0 writes the
strategy's class, density and DDP options to the file in $CLI_OUT after fit."""
import json
import os
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import lightning_topk  # noqa: F401  (registers topk_ddp)
from tests.helpers.digits import digits

if os.environ.get("LIGHTNING_NS") == "lightning":
    from lightning.pytorch import LightningModule
    from lightning.pytorch.cli import LightningCLI
else:
    from pytorch_lightning import LightningModule
    from pytorch_lightning.cli import LightningCLI


class Net(LightningModule):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        return DataLoader(digits()[0], batch_size=32)

    def on_fit_end(self):
        s = self.trainer.strategy
        if self.trainer.global_rank == 0 and os.environ.get("CLI_OUT"):
            with open(os.environ["CLI_OUT"], "w") as f:
                json.dump({"class": type(s).__name__, "density": s.topk_config.density, "world": s.world_size,
                           "steps": self.trainer.global_step, "ddp_kwargs": {k: str(v) for k, v in s._ddp_kwargs.items()}}, f)


if __name__ == "__main__":
    torch.set_num_threads(1)
    LightningCLI(Net)
