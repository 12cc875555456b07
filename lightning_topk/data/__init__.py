"""WebDataset data loading for lightning_topk: a DataModule with disk/RAM/device caches and a shard writer."""
from .cache import DiskCache
from .datamodule import CacheStatsLogger, WebDataModule, WebLoader
from .datasets import ensure_digits_shards, load_arrays
from .decode import BadSampleError
from .text import byte_sequences, ensure_text_shards, load_text
from .transforms import BatchAugment, ToFloat
from .writer import array_samples, folder_samples, write_shards

__all__ = ["WebDataModule", "WebLoader", "CacheStatsLogger", "DiskCache", "BadSampleError", "BatchAugment", "ToFloat",
           "write_shards", "array_samples", "folder_samples", "ensure_digits_shards", "load_arrays",
           "ensure_text_shards", "byte_sequences", "load_text"]
