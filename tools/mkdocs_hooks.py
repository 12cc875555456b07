"""mkdocs hooks for the documentation site (``mkdocs.yml``: ``hooks:``).

The repository's Markdown is written for GitHub: README.md and BENCHMARKS.md live at the root and link into
``docs/``, and pages in ``docs/`` link out to ``../examples/...`` or ``../benchmarks/results/...``. mkdocs only knows
files under ``docs_dir``, so ``mkdocs build --strict`` would reject those links. These hooks keep one source of
each text and make its links work on the site:

- ``<!-- site:include FILE -->`` in a page is replaced by FILE (relative to the repository root), and
  ``<!-- site:include FILE#NAME -->`` by the part of FILE between ``<!-- site:NAME:begin -->`` and
  ``<!-- site:NAME:end -->``. A missing file or part fails the build.
- every relative link is resolved from the file it was written in: into ``docs/`` it becomes the page's path;
  to README.md / BENCHMARKS.md / CONTRIBUTING.md it becomes the page that shows that file; to any other
  repository file that exists it becomes ``repo/<path>``, and that file is copied into the site there.
  A link whose target does not exist is left as written, so strict mode still reports it.
"""
from __future__ import annotations

import os
import re
from typing import Optional, Set

from mkdocs.structure.files import File

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# root Markdown files shown as pages of the site
ROOT_PAGES = {"README.md": "index.md", "BENCHMARKS.md": "benchmarks.md", "CONTRIBUTING.md": "contributing.md"}
INCLUDE = re.compile(r"<!-- site:include ([^#\s]+)(?:#([\w-]+))? -->")
LINK = re.compile(r"(\]\()([^)\s]+)(\))")
_added: Set[str] = set()


def _include(match: "re.Match[str]", page_dir: str = "") -> str:
    path = os.path.join(ROOT, match.group(1))
    if not os.path.isfile(path):
        raise SystemExit(f"mkdocs_hooks: {match.group(0)}: no such file")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    name = match.group(2)
    if name:
        m = re.search(rf"<!-- site:{name}:begin -->\n(.*?)<!-- site:{name}:end -->", text, flags=re.S)
        if m is None:
            raise SystemExit(f"mkdocs_hooks: {match.group(0)}: no part {name!r} in {match.group(1)}")
        text = m.group(1)
    return _relink(text, os.path.dirname(path), page_dir)


def _target(target: str, src_dir: str, docs_dir: str) -> Optional[str]:
    """The site path (from the site's root) for a link written in a file in ``src_dir``, or None to leave it."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
        return None
    path, _, anchor = target.partition("#")
    full = os.path.normpath(os.path.join(src_dir, path))
    anchor = "#" + anchor if anchor else ""
    if full.startswith(docs_dir + os.sep):
        return os.path.relpath(full, docs_dir).replace(os.sep, "/") + anchor
    rel = os.path.relpath(full, ROOT).replace(os.sep, "/")
    if rel in ROOT_PAGES:
        return ROOT_PAGES[rel] + anchor
    if not rel.startswith("..") and os.path.isfile(full):
        _added.add(rel)
        return "repo/" + rel + anchor
    return None


def _relink(text: str, src_dir: str, page_dir: str) -> str:
    """``text``'s links, written in a file in ``src_dir``, for a page whose site directory is ``page_dir``."""
    docs_dir = os.path.join(ROOT, "docs")

    def sub(m: "re.Match[str]") -> str:
        new = _target(m.group(2), src_dir, docs_dir)
        if new is None:
            return m.group(0)
        path, _, anchor = new.partition("#")
        rel = os.path.relpath(path, page_dir or ".").replace(os.sep, "/")
        return m.group(1) + rel + ("#" + anchor if anchor else "") + m.group(3)

    return LINK.sub(sub, text)


def _page_text(text: str, src_dir: str, src_uri: str) -> str:
    page_dir = os.path.dirname(src_uri)
    return INCLUDE.sub(lambda m: _include(m, page_dir), _relink(text, src_dir, page_dir))


def on_files(files, config):  # type: ignore[no-untyped-def]
    """Add the repository files that pages link to (found by rewriting every page once here)."""
    todo = list(files.documentation_pages())
    while todo:
        for f in todo:
            with open(f.abs_src_path, encoding="utf-8") as fh:
                _page_text(fh.read(), os.path.dirname(f.abs_src_path), f.src_uri)
        todo = []
        for rel in sorted(_added):
            uri = "repo/" + rel
            if files.get_file_from_path(uri) is None:
                new = File.generated(config, uri, abs_src_path=os.path.join(ROOT, rel))
                files.append(new)
                if new.is_documentation_page():
                    todo.append(new)
    return files


def on_page_markdown(markdown, page, config, files):  # type: ignore[no-untyped-def]
    return _page_text(markdown, os.path.dirname(page.file.abs_src_path), page.file.src_uri)

