"""Compatibility: sparse local SGD moved to the package :mod:`lightning_topk.comm.local` (codec, outer step,
outer exchanges, round, checkpoint); this module re-exports its public names."""
from lightning_topk.comm.local import *  # noqa: F403
from lightning_topk.comm.local import __all__  # noqa: F401
