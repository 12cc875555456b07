"""Thin Lightning glue over :mod:`lightning_topk.comm`: the strategy (``pytorch_lightning`` and
``lightning.pytorch``), the precision plugin, per-rank checkpoint shards, fault handling, registration
and the baseline strategies of the benchmarks."""
