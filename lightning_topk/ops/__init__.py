"""Device operations below every other layer: the CuPy kernels and their torch references
(:mod:`lightning_topk.ops.cuda`), used by ``comm`` (selection, rebuild) and ``optim`` (fused LARS)."""
