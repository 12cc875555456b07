"""A store call of lightning_topk that returns while the interpreter finalizes: the store's host (a child process)
is stopped (SIGSTOP, as a hung rank 0), so an ``add`` times out in ``faults._timed``, which leaves its thread in the
C++ call; the host is resumed only once the interpreter is finalizing (an object's ``__del__`` at module teardown),
so the call returns then. Exit code 0 expected; the bug was an abort ("terminate called without an active
exception", SIGABRT) as that thread tried to retake the GIL."""
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from lightning_topk.lightning import faults

HOST = r"""
import socket, time, torch.distributed as dist
from datetime import timedelta
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
store = dist.TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=60), wait_for_workers=False)
print(port, flush=True)
time.sleep(600)
"""


class ResumeAtFinalization:
    def __init__(self, pid: int) -> None:
        self.pid = pid

    def __del__(self) -> None:  # module teardown: after atexit, with the interpreter finalizing
        os.kill(self.pid, signal.SIGCONT)
        time.sleep(1.0)  # GIL released: the store thread's call returns meanwhile
        os.kill(self.pid, signal.SIGKILL)


host = subprocess.Popen([sys.executable, "-c", HOST], stdout=subprocess.PIPE, text=True)
port = int(host.stdout.readline())
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60), wait_for_workers=False)
store.add("k", 1)
os.kill(host.pid, signal.SIGSTOP)
try:
    faults._timed(lambda: store.add("k", 1), timeout=0.5)
except TimeoutError:
    print("store call timed out", flush=True)
keeper = ResumeAtFinalization(host.pid)
