"""Hydra configs of ``lightning-topk-train`` (shipped as ``lightning_topk.conf``).

Importing this package registers the ``lt.*`` resolvers the configs use, so the Hydra compose API
(``initialize_config_module("lightning_topk.conf")``) works as well as the command.
"""
from lightning_topk.app.resolvers import register_resolvers

register_resolvers()
