"""``areal-hpc proxy | proxy-key``: the login-node gateway and its tenant keys, as subcommands; ``areal_hpc/cli.py``
lists them in its table.

    areal-hpc proxy --config configs/my-run.yaml proxy.keys_file=$HOME/proxy-keys.yaml
    areal-hpc proxy-key --keys-file $HOME/proxy-keys.yaml --tenant alice
"""

from __future__ import annotations

import argparse
import sys


def run_proxy(args: argparse.Namespace) -> int:
    from areal_hpc.config import load_config
    from areal_hpc.proxy.serve import serve_proxy

    serve_proxy(load_config(args.config, args.overrides))
    return 0


def proxy_key_arguments(key: argparse.ArgumentParser) -> None:
    """Declare ``proxy-key``'s arguments on its parser."""
    key.add_argument("--keys-file", required=True, metavar="FILE", help="the proxy's keys file (proxy.keys_file)")
    key.add_argument("--tenant", required=True, help="tenant name (letters, digits, '_', '.', '-')")


def run_proxy_key(args: argparse.Namespace) -> int:
    from areal_hpc.proxy.tenants import add_key

    key = add_key(args.keys_file, args.tenant)
    print(key)
    print(
        f"added a key for tenant {args.tenant} to {args.keys_file} (only its hash is stored: keep the key)",
        file=sys.stderr,
    )
    return 0
