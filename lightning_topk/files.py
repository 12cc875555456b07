"""Atomic file writes, local or remote: the one place that publishes a finished file.

Local paths are written to a temporary file in the target directory, flushed to disk, made
world-readable (``mkstemp`` creates 0600) and renamed over the target, so a reader sees the old file or
the new one, never half of one. URLs (``s3://``, ``gs://``, ``memory://``, ...) go through fsspec, whose
object stores publish an object only when its upload completes. ``file://`` URLs are local paths.
:func:`isfile`, :func:`isdir`, :func:`open_read` and :func:`remove` read and delete the same way.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from typing import IO, Any, Iterator, Union

PathLike = Union[str, "os.PathLike[str]"]


def is_url(path: PathLike) -> bool:
    """True for ``protocol://...`` paths other than ``file://``."""
    p = os.fspath(path)
    return "://" in p and not p.startswith("file://")


def local_path(path: PathLike) -> str:
    p = os.fspath(path)
    return p[len("file://"):] if p.startswith("file://") else p


def join(path: PathLike, *names: str) -> str:
    """``os.path.join`` for local paths, ``/``-joined for URLs."""
    p = os.fspath(path)
    return "/".join([p.rstrip("/"), *names]) if is_url(p) else os.path.join(local_path(p), *names)


def _fs(path: PathLike):
    import fsspec

    return fsspec.core.url_to_fs(os.fspath(path))[0]


def isfile(path: PathLike) -> bool:
    return _fs(path).isfile(os.fspath(path)) if is_url(path) else os.path.isfile(local_path(path))


def isdir(path: PathLike) -> bool:
    return _fs(path).isdir(os.fspath(path)) if is_url(path) else os.path.isdir(local_path(path))


def open_read(path: PathLike) -> IO[bytes]:
    """A binary file object for reading ``path`` (local or fsspec URL)."""
    if is_url(path):
        import fsspec

        return fsspec.open(os.fspath(path), "rb").open()
    return open(local_path(path), "rb")


def remove(path: PathLike, recursive: bool = False) -> None:
    """Delete a file (or, with ``recursive``, a directory tree); a missing path is not an error."""
    if is_url(path):
        fs = _fs(path)
        with contextlib.suppress(FileNotFoundError):
            if fs.exists(os.fspath(path)):
                fs.rm(os.fspath(path), recursive=recursive)
        return
    p = local_path(path)
    if recursive:
        import shutil

        shutil.rmtree(p, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(p)


def publish(tmp: str, path: PathLike, *, fsync: bool = True) -> None:
    """Make the finished temporary file ``tmp`` (in the target's directory) visible as ``path``."""
    os.chmod(tmp, 0o644)
    if fsync:
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    os.replace(tmp, local_path(path))


def temp_path(path: PathLike, prefix: str = ".tmp-", suffix: str = "") -> str:
    """A new empty temporary file beside ``path`` (same filesystem, so :func:`publish` is a rename)."""
    d = os.path.dirname(os.path.abspath(local_path(path)))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=d)
    os.close(fd)
    return tmp


@contextlib.contextmanager
def atomic_write(path: PathLike, mode: str = "wb", *, fsync: bool = True, suffix: str = "") -> Iterator[IO[Any]]:
    """``with atomic_write(path) as f: ...``: ``path`` appears complete when the block exits, or not at all."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_write: mode must be 'w' or 'wb', got {mode!r}")
    if is_url(path):
        import fsspec

        with fsspec.open(os.fspath(path), mode) as f:
            yield f
        return
    tmp = temp_path(path, suffix=suffix)
    try:
        with open(tmp, mode) as f:
            yield f
        publish(tmp, path, fsync=fsync)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_torch_save(obj: Any, path: PathLike) -> None:
    """``torch.save`` through :func:`atomic_write` (local or fsspec URL)."""
    import torch

    with atomic_write(path, "wb") as f:
        torch.save(obj, f)
