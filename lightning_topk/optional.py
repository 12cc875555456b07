"""Optional dependencies: the one place that imports them and says which extra installs a missing one.

Layer 0 (standard library only). ``require("sklearn", "data", "the 'mnist5k' data set")`` returns the module
or raises :class:`MissingDependency`, whose message is one line naming the ``pip install`` command;
``lightning-topk-train`` prints that line (without a traceback) and exits with status 2.
"""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Optional

#: extra -> what it installs (pyproject's [project.optional-dependencies]).
EXTRAS = {
    "data": "scikit-learn, mlxtend",
    "cuda": "cupy",
    "slurm": "hydra-submitit-launcher",
    "tensorboard": "tensorboard",
    "ft": "torchft",
}


class MissingDependency(ImportError):
    """An optional dependency is not installed; the message names the extra that installs it."""


def install_hint(extra: str) -> str:
    if extra not in EXTRAS:
        raise ValueError(f"install_hint: unknown extra {extra!r}; allowed: {', '.join(EXTRAS)}")
    return f"pip install 'lightning-topk[{extra}]'"


def require(module: str, extra: str, what: str, package: Optional[str] = None) -> ModuleType:
    """Import ``module`` for ``what``, or raise :class:`MissingDependency` naming ``extra``.

    ``package`` is the distribution's name when it differs from the module's (``scikit-learn``).
    """
    hint = install_hint(extra)
    try:
        return importlib.import_module(module)
    except ImportError as e:
        missing = getattr(e, "name", None)
        if missing is not None and not module.startswith(missing) and not missing.startswith(module):
            raise  # the module is there but one of *its* imports failed: not ours to explain
        name = package or module.split(".")[0]
        raise MissingDependency(f"{what} needs {name}, which is not installed: {hint}") from e


def find_missing(exc: BaseException) -> Optional[MissingDependency]:
    """The :class:`MissingDependency` in ``exc``'s cause/context chain (Hydra wraps it), or None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, MissingDependency):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None
