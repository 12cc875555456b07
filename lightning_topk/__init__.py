"""lightning_topk: top-k sparse gradient exchange with error feedback for PyTorch Lightning DDP."""
from lightning_topk.selection import topk_select

__version__ = "0.1.0"
__all__ = ["topk_select", "__version__"]
