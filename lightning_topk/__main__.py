"""``python -m lightning_topk [overrides]``: same as ``lightning-topk-train``."""
from lightning_topk.app.cli import main

if __name__ == "__main__":
    main()
