"""``lightning-topk-train`` / ``python -m lightning_topk``: Hydra entry point (configs in ``lightning_topk.conf``).

Under Lightning's popen launcher, local ranks > 0 re-run this same command with the parent's overrides
plus ``hydra.run.dir=<parent's dir> hydra.job.name=train_ddp_process_<r> hydra.output_subdir=null``
(Hydra keeps the last value of a repeated override, so a user's own ``hydra.run.dir=`` is fine).

A missing optional dependency ends the command with one line on stderr naming the extra to install
(:mod:`lightning_topk.optional`) and exit status 2, not a traceback through Hydra.
"""
from __future__ import annotations

import sys
from typing import NoReturn, Sequence

import hydra
from omegaconf import DictConfig

from lightning_topk.app.resolvers import register_resolvers
from lightning_topk.optional import MissingDependency, find_missing, require

EXIT_MISSING_DEPENDENCY = 2


@hydra.main(version_base="1.3", config_path="pkg://lightning_topk.conf", config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    from lightning_topk.app.train import run

    try:
        run(cfg)
    except Exception as e:  # Hydra wraps instantiate errors (InstantiationException): unwrap the cause
        missing = find_missing(e)
        if missing is None:
            raise
        _fail(missing)


def _fail(missing: MissingDependency) -> NoReturn:
    print(f"lightning-topk-train: {missing}", file=sys.stderr)
    sys.exit(EXIT_MISSING_DEPENDENCY)


def _check_launcher(argv: Sequence[str]) -> None:
    # Hydra composes hydra/launcher before any of our code runs, and fails on a missing plugin with a long
    # config-search error: check the plugin first.
    if any(a.split("=", 1)[0].lstrip("+~") == "hydra/launcher" and a.endswith("=slurm") for a in argv):
        require("hydra_plugins.hydra_submitit_launcher", "slurm", "hydra/launcher=slurm",
                package="hydra-submitit-launcher")


def main() -> None:
    """Console entry point: compose the config from the command line's overrides and train."""
    try:
        _check_launcher(sys.argv[1:])
    except MissingDependency as e:
        _fail(e)
    register_resolvers()
    _hydra_main()


if __name__ == "__main__":
    main()
