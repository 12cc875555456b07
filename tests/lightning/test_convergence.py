"""Convergence parity on real data: the digits CNN at density 0.001 with the flat all-gather pinned (with
defaults ``auto`` sends this small model dense) ends within 3 points of dense DDP after the same epochs, on
2 real processes. SGD with momentum: ``recipe="auto"`` moves the momentum into the hook (DGC momentum
correction, docs/convergence.md)."""
import json

import pytest
import torch
from pytorch_lightning.strategies import DDPStrategy
from torch import nn

import lightning_topk  # noqa: F401  (registers the strategies)
from lightning_topk.lightning.strategy import TopKDDPStrategy
from lightning_topk.models import SmallCNN
from tests.helpers.digits import DigitsNet, trainer

pytestmark = pytest.mark.usefixtures("one_thread")

EPOCHS = 24


class DigitsCNN(DigitsNet):
    """The shared digits module with the strategy tests' SmallCNN(width=16) and SGD with momentum."""

    def __init__(self, out_dir):
        super().__init__(out_dir=out_dir, batch_size=64)
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Unflatten(1, (1, 8, 8)), SmallCNN(width=16))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def on_train_end(self):
        super().on_train_end()
        st = getattr(self.trainer.strategy, "topk_state", None)
        if st is not None and self.out_dir:
            info = dict(recipe=self.trainer.strategy.topk_recipe, numel=st.totals.numel,
                        numel_sent=st.totals.numel_sent, allgather=st.totals.buckets_via("allgather"),
                        velocities=len(st.velocities()), momentum=self.trainer.optimizers[0].param_groups[0]["momentum"])
            with open(f"{self.out_dir}/topk{self.global_rank}.json", "w") as f:
                json.dump(info, f)


def _fit(tmp_path, strategy):
    model = DigitsCNN(str(tmp_path))
    trainer(epochs=EPOCHS, strategy=strategy, devices=2).fit(model)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def test_digits_at_density_0_001_is_within_three_points_of_dense(tmp_path):
    dense_dir, sparse_dir = tmp_path / "dense", tmp_path / "sparse"
    dense_dir.mkdir()
    sparse_dir.mkdir()
    dense = _fit(dense_dir, DDPStrategy(start_method="spawn", process_group_backend="gloo"))
    sparse = _fit(sparse_dir, TopKDDPStrategy(start_method="spawn", process_group_backend="gloo", density=0.001,
                                              min_sparse_numel=0, exchange="allgather"))
    info = [json.loads((sparse_dir / f"topk{r}.json").read_text()) for r in range(2)]
    for i in info:
        # the momentum moved into the hook; the user's optimizer still shows its own between steps
        assert "-> momentum_correction" in i["recipe"] and i["velocities"] > 0 and i["momentum"] == 0.9
        assert i["allgather"] > 0 and i["numel_sent"] < 0.002 * i["numel"]  # it really was sparse
    d, s = dense[0]["accuracy"], sparse[0]["accuracy"]
    assert dense[1]["accuracy"] == d and sparse[1]["accuracy"] == s  # the ranks agree
    assert d > 0.95
    # 3 points = 11 of the 360 test digits. The gap (dense - sparse) over seeds 0-4 for the init and the shuffling,
    # on AMD's native kernels and under ATEN_CPU_CAPABILITY=default (10 runs, 2026-11-29): mean +0.1 points, sd 0.7,
    # worst +1.4 (seed 0 under default, 5 digits); another CPU's rounding moves a run as another seed does. So the
    # threshold sits 4 sd above the mean and 6 digits past the worst run seen (a 1-point margin failed that one)
    assert s >= d - 0.03, (s, d)
