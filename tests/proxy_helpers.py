"""Helpers for the proxy tests: a keys file, an aiohttp app (a proxy built from the config) run in a
thread on loopback, and plain HTTP calls that return (status, JSON body, headers)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import urllib.error
import urllib.request
from pathlib import Path

import yaml

from areal_hpc.config import load_config
from areal_hpc.proxy.tenants import hash_key


def write_keys(path: Path, tenants: dict[str, dict], revoked: list[str] = ()) -> None:
    """``tenants``: name -> {"keys": [plain keys], other fields as they are}; stored hashed."""
    tree = {
        "tenants": {name: {**entry, "keys": [hash_key(k) for k in entry["keys"]]} for name, entry in tenants.items()},
        "revoked": [hash_key(k) for k in revoked],
    }
    path.write_text(yaml.safe_dump(tree))


def proxy_config(model_dir: Path, run_root: Path, backends: list[str], keys_file: Path, *overrides: str):
    return load_config(
        None,
        [
            f"model.path={model_dir}",
            f"cluster.fileroot={run_root}",
            f"proxy.keys_file={keys_file}",
            f"proxy.backends={','.join(backends)}",
            "proxy.model_name=tiny",
            *overrides,
        ],
    )


@contextlib.contextmanager
def serving(app):
    """The aiohttp ``app`` on a free loopback port, its event loop in a thread; yields (base url,
    run(coroutine) -> result on that loop)."""
    from aiohttp import web

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(coroutine, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coroutine, loop).result(timeout)

    async def start():
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner, runner.addresses[0][1]

    runner, port = run(start())
    try:
        yield f"http://127.0.0.1:{port}", run
    finally:
        run(runner.cleanup())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        loop.close()


@contextlib.contextmanager
def running_proxy(cfg):
    """The proxy of ``cfg`` on a free loopback port, its event loop in a thread; yields
    (base url, the Proxy object, run(coroutine) -> result on that loop)."""
    from areal_hpc.proxy.app import build_app
    from areal_hpc.proxy.serve import build_proxy

    proxy = build_proxy(cfg)
    with serving(build_app(proxy, cfg.proxy.max_request_bytes)) as (base, run):
        yield base, proxy, run


def call(
    base: str, route: str, body=None, key: str | None = None, raw: bytes | None = None, method: str | None = None
) -> tuple[int, dict, dict]:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    request = urllib.request.Request(
        base + route, data=data, headers=headers, method=method or ("POST" if data is not None else "GET")
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, json.loads(reply.read()), dict(reply.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), dict(exc.headers)


def start_session(base: str, tenant_key: str, **body) -> tuple[str, str]:
    status, reply, _ = call(base, "/rl/start_session", body, tenant_key)
    assert status == 200, reply
    return reply["session_id"], reply["session_key"]
