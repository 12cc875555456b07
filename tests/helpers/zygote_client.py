"""The client half of the test zygote (:mod:`tests.helpers.zygote`), run as ``python -S`` by a generated shim
that stands in for ``sys.executable``: standard library only, so it starts in milliseconds.

``shim script.py args`` or ``shim -m module args`` asks a zygote (a Python process that has already
imported torch, Lightning and lightning_topk) to fork a child that runs it with this process's arguments,
environment, working directory and standard streams; it forwards termination signals to that child and
exits with its exit code. Anything else (``-c``, interpreter flags), or no zygote, runs the real interpreter
with ``exec``, exactly as asked.
"""
import json
import os
import signal
import socket
import struct
import sys

ENV = "LIGHTNING_TOPK_TEST_ZYGOTE"  # "<real python>|<socket>|<socket>": the interpreter and the zygotes
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT)


def supported(args):
    if not args:
        return False
    if args[0] == "-m":
        return len(args) > 1
    return not args[0].startswith("-") and args[0].endswith(".py")


def zygote_for(env, sockets):
    """Processes that talk to each other (local ranks, nodes) come from different zygotes, which differ in
    their string hash seed, as separately started interpreters do."""
    rank = sum(int(env.get(k) or 0) for k in ("LOCAL_RANK", "NODE_RANK") if (env.get(k) or "0").isdigit())
    return sockets[rank % len(sockets)]


def main():
    args = sys.argv[1:]
    real, *sockets = os.environ[ENV].split("|")
    if not supported(args) or not sockets:
        os.execv(real, [real, *args])
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(zygote_for(os.environ, sockets))
    except OSError:  # the zygote is gone (end of the session): a fresh interpreter
        os.execv(real, [real, *args])
    payload = json.dumps({"argv": args, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    socket.send_fds(s, [struct.pack("!I", len(payload))], [0, 1, 2])
    s.sendall(payload)
    for sig in FORWARDED:
        signal.signal(sig, lambda n, _f: s.sendall(b"S%d\n" % n))
    buf = b""
    while True:
        try:
            chunk = s.recv(64)
        except InterruptedError:
            continue
        if not chunk:
            break
        buf += chunk
    # "X<code>\n" from the child when it exits; nothing when it died of a signal (reported as 128 + KILL)
    code = int(buf[1:].split(b"\n")[0]) if buf.startswith(b"X") else 128 + signal.SIGKILL
    os._exit(code)


if __name__ == "__main__":
    main()
