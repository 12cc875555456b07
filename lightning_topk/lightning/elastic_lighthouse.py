"""The torchft lighthouse as a replica group sees it (:mod:`lightning_topk.lightning.elastic`): its address, and a
check that it answers before any process group exists."""
from __future__ import annotations

import os
import socket
import time
from urllib.parse import urlparse

from lightning_topk.comm.config import TopKConfig

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
#: the lighthouse's --min_replicas, where the launcher (app.elastic_launch) started this replica group
MIN_REPLICAS_ENV = "TORCHFT_LIGHTHOUSE_MIN_REPLICAS"


def lighthouse_address(config: TopKConfig) -> str:
    """The lighthouse's address: ``config.lighthouse``, else ``$TORCHFT_LIGHTHOUSE``; a missing one is an error."""
    addr = config.lighthouse or os.environ.get(LIGHTHOUSE_ENV, "").strip()
    if not addr:
        raise ValueError("topk_ddp: fault_tolerance='torchft' needs a torchft lighthouse: set lighthouse='http://HOST:PORT' "
                         f"or the environment variable {LIGHTHOUSE_ENV} (start one with `python -m "
                         "lightning_topk.app.elastic_launch --bind HOST:PORT --min_replicas N`, docs/elastic.md)")
    return addr if "://" in addr else f"http://{addr}"


# HTTP/2's client preface and an empty SETTINGS frame: the lighthouse speaks gRPC, so it answers with a SETTINGS
# frame (frame type 4 in the 4th byte of its 9-byte header) and nothing else happens on its side.
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


def check_lighthouse(addr: str, timeout: float) -> None:
    """Raise ``ConnectionError`` naming ``addr`` unless an HTTP/2 (gRPC) server answers there within ``timeout``
    seconds: refused, unroutable, or a listener that never answers all fail within the timeout (torchft's own
    client would fail deep inside the first quorum call, after its connect timeout). No side effect on the
    lighthouse (no heartbeat, no quorum request)."""
    url = urlparse(addr)
    host, port = url.hostname, url.port
    if not host or not port:
        raise ValueError(f"topk_ddp: lighthouse={addr!r} is not an address such as 'http://host:29510'")
    t0 = time.monotonic()
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.settimeout(max(0.05, timeout - (time.monotonic() - t0)))
            sock.sendall(_H2_PREFACE)
            head = sock.recv(9)
        if len(head) < 4 or head[3] != 4:
            raise ConnectionError(f"it answered {head[:16]!r}, not an HTTP/2 SETTINGS frame")
    except OSError as e:  # ConnectionError, socket.timeout and the others
        raise ConnectionError(
            f"topk_ddp: fault_tolerance='torchft': no torchft lighthouse answers at {addr} ({e.__class__.__name__}: "
            f"{e}; gave up after {time.monotonic() - t0:.1f} s, ft_connect_timeout={timeout:g} s). Start one with "
            "`python -m lightning_topk.app.elastic_launch --bind HOST:PORT --min_replicas N` (or torchft_lighthouse) "
            f"and pass its address as lighthouse= or {LIGHTHOUSE_ENV}") from None
