"""A zygote for the test suite's script runs: Python processes that import torch, Lightning and
lightning_topk once and then fork a child per script run.

Importing them takes about 4.5 s of CPU per process on the CI machine; the suite starts a few hundred
Python processes (each Trainer script and every local rank Lightning's launcher starts for it), which was
most of its time on 2 cores. A child forked from a zygote runs the script as ``python script.py`` would:
``__main__``, ``sys.argv``, ``sys.path[0]``, environment, working directory and standard streams are the
caller's; atexit handlers run; the exit code and termination signals pass through. Its ``sys.executable``
is a shim (:mod:`tests.helpers.zygote_client`), so the ranks Lightning launches come from a zygote too.

Two zygotes with different string hash seeds serve alternate local ranks / nodes, so ranks still disagree
on the order of a ``set`` of strings as separately started interpreters do. Runs that change what an
interpreter reads at start (``PYTHON*`` variables, ``OMP_NUM_THREADS``) get a fresh interpreter, except
``PYTHONUNBUFFERED`` set where the zygote's own environment does not have it: the child then makes its standard
streams unbuffered as ``python -u`` does.
"""
from __future__ import annotations

import atexit
import io
import json
import os
import runpy
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Dict, List, Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
ENV = "LIGHTNING_TOPK_TEST_ZYGOTE"
PRELOAD = ("numpy", "torch", "torch.distributed", "pytorch_lightning", "lightning.pytorch", "lightning.fabric",
           "lightning_fabric", "lightning_topk", "lightning_topk.lightning.strategy", "lightning_topk.lightning.fabric",
           "lightning_topk.lightning.unified", "lightning_topk.data.datamodule", "lightning_topk.app.train",
           "sklearn.datasets")
STARTUP_ENV = {"OMP_NUM_THREADS": "1"}  # what the zygotes start with; runs that differ get a fresh interpreter
_servers: List[subprocess.Popen] = []
_env_value: Optional[str] = None


# ---- the caller's side -----------------------------------------------------------------------------------
def command_env(env: Dict[str, str]) -> Optional[Dict[str, str]]:
    """``env`` plus what routes ``[shim, ...]`` to a zygote, or None where the run needs a fresh interpreter
    (or the zygotes could not start)."""
    if os.environ.get("LIGHTNING_TOPK_TEST_NO_ZYGOTE"):
        return None
    base = _start()
    if base is None:
        return None
    for k, v in env.items():
        if k.startswith("PYTHON") and os.environ.get(k) != v and not (k == "PYTHONUNBUFFERED" and _unbuffered(env)
                                                                      and not _unbuffered(os.environ)):
            return None
    if _unbuffered(os.environ) and not _unbuffered(env):
        return None
    if any(env.get(k) != v for k, v in STARTUP_ENV.items()):
        return None
    return dict(env, **{ENV: base})


def _unbuffered(env) -> bool:
    return bool(env.get("PYTHONUNBUFFERED"))  # (what Python checks: a non-empty string)


def shim() -> str:
    return str(_shim_path())


def _shim_path() -> Path:
    d = Path(tempfile.gettempdir()) / f"ltk-zygote-{os.getpid()}"
    return d / "python"


def _start() -> Optional[str]:
    global _env_value
    if _env_value is not None:
        return _env_value or None
    d = _shim_path().parent
    d.mkdir(parents=True, exist_ok=True)
    _shim_path().write_text(f"#!{sys.executable} -S\nimport sys\nsys.path.insert(0, {str(HERE)!r})\n"
                            "import zygote_client\nzygote_client.main()\n")
    _shim_path().chmod(0o755)
    socks = [str(d / f"z{i}.sock") for i in range(2)]
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "RANK")}
    for i, sock in enumerate(socks):
        e = dict(env, **STARTUP_ENV, PYTHONHASHSEED=str(1000 + 7919 * i))
        _servers.append(subprocess.Popen([sys.executable, str(HERE / "zygote.py"), sock, shim()], env=e, cwd=ROOT,
                                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=open(d / f"z{i}.log", "w")))
    atexit.register(_stop)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not all(Path(s + ".ready").exists() for s in socks):
        if any(p.poll() is not None for p in _servers):
            break
        time.sleep(0.1)
    if not all(Path(s + ".ready").exists() for s in socks):
        logs = "".join((d / f"z{i}.log").read_text()[-2000:] for i in range(len(socks)))
        print(f"test zygote did not start ({[p.poll() for p in _servers]}); fresh interpreters:\n{logs}",
              file=sys.stderr)
        _stop()
        _env_value = ""
        return None
    _env_value = "|".join([sys.executable, *socks])
    return _env_value


def _stop() -> None:
    for p in _servers:
        if p.poll() is None:
            p.kill()
            p.wait()
    _servers.clear()
    shutil.rmtree(_shim_path().parent, ignore_errors=True)


# ---- the zygote --------------------------------------------------------------------------------------------
def _watch(conn: socket.socket) -> None:
    """Forward signal requests from the client; its end closing (killed, timed out) ends this child too."""
    buf = b""
    while True:
        try:
            chunk = conn.recv(64)
        except OSError:
            chunk = b""
        if not chunk:
            os.kill(os.getpid(), signal.SIGKILL)
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            if line.startswith(b"S"):
                os.kill(os.getpid(), int(line[1:]))


def _run(argv: List[str]) -> int:
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
        return 0
    except SystemExit as e:
        if e.code is None:
            return 0
        if isinstance(e.code, int):
            return e.code
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1


def _child(conn: socket.socket, fds: List[int], req: dict, shim_path: str) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for i, fd in enumerate(fds):
        os.dup2(fd, i)
        os.close(fd)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    if _unbuffered(os.environ) and not sys.stdout.write_through:
        _unbuffer()
    sys.executable = shim_path
    threading.Thread(target=_watch, args=(conn,), daemon=True).start()
    code = _run(req["argv"])
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # join non-daemon threads, as at interpreter exit
        import atexit as _atexit

        _atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except Exception:
            pass
    try:
        conn.sendall(b"X%d\n" % (code & 0xFF))
    finally:
        os._exit(code & 0xFF)


def _unbuffer() -> None:
    """Standard output and error as ``python -u`` makes them: the raw file under a write-through text layer."""
    for name, fd in (("stdout", 1), ("stderr", 2)):
        old = getattr(sys, name)
        new = io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding=old.encoding,  # type: ignore[arg-type]
                               errors=old.errors, write_through=True)
        setattr(sys, name, new)
        setattr(sys, f"__{name}__", new)


def _reap(_signum: int, _frame: object) -> None:
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass


def serve(sock_path: str, shim_path: str) -> None:
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    assert threading.active_count() == 1, "a preloaded module started a thread: forking would be unsafe"
    signal.signal(signal.SIGCHLD, _reap)  # (waited for, so their CPU time counts in the caller's rusage)
    if os.path.exists(sock_path):
        os.unlink(sock_path)
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lsock.bind(sock_path)
    lsock.listen(64)
    lsock.settimeout(2.0)
    parent = os.getppid()
    Path(sock_path + ".ready").touch()
    while True:
        try:
            conn, _ = lsock.accept()
        except socket.timeout:
            if os.getppid() != parent:  # the test session is gone (killed): so is its zygote
                os.unlink(sock_path)
                return
            continue
        conn.setblocking(True)
        try:
            msg, fds, _flags, _addr = socket.recv_fds(conn, 4, 3)
            (n,) = struct.unpack("!I", msg)
            data = b""
            while len(data) < n:
                data += conn.recv(n - len(data))
            req = json.loads(data)
        except Exception:
            conn.close()
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            lsock.close()
            _child(conn, fds, req, shim_path)
        for fd in fds:
            os.close(fd)
        conn.close()


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2])
