"""Regenerate ``lightning_topk/data/packaged/stdlib_docs.txt.gz``: a byte-level English text for the
Transformer LM preset (``data=bytes_text``), assembled from the docstrings of Python's standard library.

    python tools/make_packaged_text.py [--check] [--max-bytes 786432]

The docstrings (module, class and function ones, ``ast.get_docstring(clean=True)``) of every ``.py`` file of the
running interpreter's standard library, in sorted path order, without the ``test``/``tests``, ``idlelib``,
``site-packages`` and ``dist-packages`` folders; only docstrings of at least 200 characters; each preceded by
a header line naming its origin (``# module.Name``), separated by blank lines; cut at ``--max-bytes`` on a
docstring boundary. The Python standard library is distributed under the PSF License Agreement (see
``packaged/README.md``). The shipped file was made with CPython 3.11.7; another version's library gives another
text, so ``--check`` only compares when the running version is the recorded one (exit 1 on a difference,
2 on another version).
"""
from __future__ import annotations

import argparse
import ast
import gzip
import io
import os
import sys
import sysconfig

SOURCE_VERSION = "3.11.7"
OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "lightning_topk", "data",
                   "packaged", "stdlib_docs.txt.gz")
SKIP = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__", "turtledemo"}


def docstrings(root: str):
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in SKIP)
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            path = os.path.join(d, f)
            mod = os.path.relpath(path, root)[:-3].replace(os.sep, ".").removesuffix(".__init__")
            try:
                tree = ast.parse(open(path, "rb").read())
            except (SyntaxError, ValueError):
                continue
            nodes = [(mod, tree)] + [(f"{mod}.{n.name}", n) for n in ast.walk(tree)
                                     if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
            for name, node in nodes:
                doc = ast.get_docstring(node, clean=True)
                if doc and len(doc) >= 200:
                    yield f"# {name}\n{doc.strip()}\n\n"


def build(max_bytes: int) -> bytes:
    out, total = [], 0
    for block in docstrings(sysconfig.get_paths()["stdlib"]):
        b = block.encode("utf-8")
        if total + len(b) > max_bytes:
            break
        out.append(b)
        total += len(b)
    return b"".join(out)


def gz(data: bytes) -> bytes:
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", compresslevel=9, mtime=0, filename="") as f:
        f.write(data)
    return buf.getvalue()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="compare with the shipped file instead of writing")
    p.add_argument("--max-bytes", type=int, default=768 * 1024)
    a = p.parse_args(argv)
    text = build(a.max_bytes)
    if a.check:
        version = sys.version.split()[0]
        if version != SOURCE_VERSION:
            print(f"{OUT}: made from Python {SOURCE_VERSION}'s library, this is {version}: not compared")
            return 2
        with gzip.open(OUT, "rb") as f:
            same = f.read() == text
        print(f"{OUT}: {'matches' if same else 'DIFFERS FROM'} the standard library's docstrings")
        return 0 if same else 1
    from lightning_topk.files import atomic_write

    with atomic_write(OUT) as f:
        f.write(gz(text))
    print(f"wrote {OUT}: {len(text)} bytes of text, {os.path.getsize(OUT)} compressed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
