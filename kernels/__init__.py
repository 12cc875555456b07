"""CUDA C sources of lightning_topk's CuPy kernels (shipped as package data; loaded by lightning_topk.ops.cuda)."""
