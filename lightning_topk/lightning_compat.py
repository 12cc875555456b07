"""``TopKDDPStrategy`` for the unified ``lightning`` package (``lightning.pytorch``)."""
from lightning.pytorch.strategies import DDPStrategy

from lightning_topk.strategy import TopKStrategyMixin


class TopKDDPStrategy(TopKStrategyMixin, DDPStrategy):
    """Same as :class:`lightning_topk.TopKDDPStrategy`, built on ``lightning.pytorch``'s DDPStrategy."""

    strategy_name = "topk_ddp"
