"""Shard lists: expand brace patterns, check local files, count samples per shard."""
from __future__ import annotations

import json
import os
import tarfile
import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Union

import braceexpand
from webdataset.tariterators import base_plus_ext

INDEX_NAME = "index.json"
INDEX_FORMAT = "lightning_topk-shards/1"


def local_path(url: str) -> Optional[str]:
    """The file path of a local shard (plain path or ``file:``), or None for URLs and ``pipe:`` commands."""
    if url.startswith("file://"):
        return url[len("file://"):]
    if url.startswith("file:"):
        return url[len("file:"):]
    if "://" in url or url.startswith("pipe:"):
        return None
    return url


def expand_shards(spec: Union[str, Sequence[str]], option: str = "shards") -> List[str]:
    """Expand ``"a-{000..009}.tar"``, ``"x.tar::y.tar"`` or a list of such into a list of URLs/paths.

    Local files must exist: a missing one raises FileNotFoundError naming it.
    """
    if spec is None:
        raise ValueError(f"{option} is required")
    parts = spec.split("::") if isinstance(spec, str) else list(spec)
    urls: List[str] = []
    for part in parts:
        part = os.fspath(part)
        urls.extend(braceexpand.braceexpand(part) if "{" in part else [part])
    if not urls:
        raise ValueError(f"{option}={spec!r} expands to no shards")
    for u in urls:
        p = local_path(u)
        if p is not None and not os.path.isfile(p):
            raise FileNotFoundError(f"{option}: shard file not found: {p}")
    return urls


@dataclass
class ShardInfo:
    samples: int
    nbytes: int  # sum of member sizes (encoded sample bytes)


def scan_tar(path: str, on_bad_sample: str = "raise") -> ShardInfo:
    """Count samples (runs of members with one key) by walking tar headers; data is skipped by seeking."""
    samples, nbytes, last = 0, 0, None
    try:
        with tarfile.open(path, "r:") as tf:
            for m in tf:
                if not m.isreg():
                    continue
                key, _ = base_plus_ext(m.name)
                if key is None:
                    continue
                if key != last:
                    samples += 1
                    last = key
                nbytes += m.size
            # a tar cut at a member boundary reads as a clean end: require the end-of-archive blocks
            if os.path.getsize(path) - tf.offset < 1024:
                raise tarfile.ReadError("no end-of-archive marker (file truncated?)")
    except (tarfile.TarError, OSError, EOFError) as exn:
        msg = f"corrupt or truncated tar shard {path!r} after key {last!r}: {exn}"
        if on_bad_sample == "raise":
            raise RuntimeError(msg + " (set on_bad_sample='skip' to skip bad samples)") from exn
        warnings.warn(msg + f"; counting the {samples} samples before it", RuntimeWarning, stacklevel=2)
    return ShardInfo(samples, nbytes)


def read_index(directory: str) -> Dict[str, dict]:
    path = os.path.join(directory, INDEX_NAME)
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data.get("shards", {}) if data.get("format") == INDEX_FORMAT else {}


def shard_infos(urls: Sequence[str], shard_sizes=None, on_bad_sample: str = "raise", fetch=None) -> Optional[List[ShardInfo]]:
    """Sample counts for every shard, or None when some remote shard cannot be counted.

    Sources, in order: ``shard_sizes`` (list aligned with urls, or dict url/basename -> count), the
    writer's ``index.json`` beside local shards (used when the recorded file size matches), a header
    scan of local files, and for remote shards ``fetch(url) -> local path`` (the disk cache) if given.
    """
    if shard_sizes is not None:
        if isinstance(shard_sizes, dict):
            out = []
            for u in urls:
                n = shard_sizes.get(u, shard_sizes.get(os.path.basename(u)))
                if n is None:
                    raise ValueError(f"shard_sizes has no entry for shard {u!r}")
                out.append(ShardInfo(int(n), 0))
            return out
        if len(shard_sizes) != len(urls):
            raise ValueError(f"shard_sizes has {len(shard_sizes)} entries for {len(urls)} shards")
        return [ShardInfo(int(n), 0) for n in shard_sizes]
    indexes: Dict[str, Dict[str, dict]] = {}
    out = []
    for u in urls:
        p = local_path(u)
        if p is None:
            if fetch is None:
                return None
            p = fetch(u)
        d = os.path.dirname(os.path.abspath(p))
        if d not in indexes:
            indexes[d] = read_index(d)
        entry = indexes[d].get(os.path.basename(p))
        if entry and entry.get("size") == os.path.getsize(p):
            out.append(ShardInfo(int(entry["samples"]), int(entry.get("bytes", 0))))
        else:
            out.append(scan_tar(p, on_bad_sample))
    return out
