"""``lightning-topk-train`` / ``python -m lightning_topk``: Hydra entry point (configs in ``lightning_topk.conf``).

Under Lightning's popen launcher, local ranks > 0 re-run this same command with the parent's overrides
plus ``hydra.run.dir=<parent's dir> hydra.job.name=train_ddp_process_<r> hydra.output_subdir=null``
(Hydra keeps the last value of a repeated override, so a user's own ``hydra.run.dir=`` is fine).
"""
from __future__ import annotations

import hydra
from omegaconf import DictConfig

from lightning_topk.app.resolvers import register_resolvers


@hydra.main(version_base="1.3", config_path="pkg://lightning_topk.conf", config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    from lightning_topk.app.train import run

    run(cfg)


def main() -> None:
    """Console entry point: compose the config from the command line's overrides and train."""
    register_resolvers()
    _hydra_main()


if __name__ == "__main__":
    main()
