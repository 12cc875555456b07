"""``TopKDDPStrategy`` for the unified ``lightning`` package (``lightning.pytorch``)."""
from lightning.pytorch.strategies import DDPStrategy

from lightning_topk.lightning.strategy import TopKStrategyMixin


class UnifiedTopKDDPStrategy(TopKStrategyMixin, DDPStrategy):
    """:class:`lightning_topk.TopKDDPStrategy` (pytorch_lightning) rebuilt on ``lightning.pytorch``'s DDPStrategy."""

    strategy_name = "topk_ddp"
