"""``areal-hpc serve``: a rollout server (the embedded engine, or SGLang) with SGLang's HTTP API, as a subcommand;
``areal_hpc/cli.py`` lists it in its table.

    areal-hpc serve backend=embedded model.path=DIR port=N
"""

from __future__ import annotations

import argparse

from areal_hpc.errors import UserError

# `areal-hpc serve backend=embedded model.path=DIR port=N`: the server's own words for its settings.
SERVE_ALIASES = {"backend": "rollout.backend", "host": "rollout.host", "port": "rollout.port"}


def run_serve(args: argparse.Namespace) -> int:
    from areal_hpc.config import load_config
    from areal_hpc.resolve import Host, resolve

    overrides = [_serve_alias(item) for item in args.overrides]
    cfg = resolve(load_config(args.config, overrides), Host.probe()).cfg
    if not cfg.model.path:
        raise UserError("serve needs model.path=DIR (a local Hugging Face model folder)")
    if cfg.rollout.backend == "embedded":
        from areal_hpc.rollout.server import serve_embedded

        serve_embedded(cfg)
    else:
        from areal_hpc.rollout.sglang_server import serve_sglang

        serve_sglang(cfg)
    return 0


def _serve_alias(item: str) -> str:
    key, sep, value = item.partition("=")
    return f"{SERVE_ALIASES.get(key, key)}{sep}{value}"
