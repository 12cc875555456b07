"""``TopKDDPStrategy`` and ``TopKPrecision`` for the unified ``lightning`` package (``lightning.pytorch``)."""
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy

from lightning_topk.lightning.precision import TopKPrecisionMixin
from lightning_topk.lightning.strategy import TopKStrategyMixin, cli_signature


@cli_signature
class UnifiedTopKDDPStrategy(TopKStrategyMixin, DDPStrategy):
    """:class:`lightning_topk.TopKDDPStrategy` (pytorch_lightning) rebuilt on ``lightning.pytorch``'s DDPStrategy."""

    strategy_name = "topk_ddp"


class UnifiedTopKPrecision(TopKPrecisionMixin, Precision):
    """:class:`lightning_topk.TopKPrecision` (pytorch_lightning) rebuilt on ``lightning.pytorch``'s Precision:
    ``lightning.pytorch.Trainer(plugins=[UnifiedTopKPrecision("16-mixed")], strategy="topk_ddp")``. Its state
    is saved under the same checkpoint key, so either class resumes the other's checkpoints."""
