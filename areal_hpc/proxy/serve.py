"""``areal-hpc proxy --config FILE``: build the proxy from the config's ``proxy:`` section and serve it
until SIGINT/SIGTERM (open sessions are then ended and written, the live shard finalised; ended
sessions stay in ``<shards dir>/ended-sessions/`` for late rewards to a restarted proxy).
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

from areal_hpc.errors import UserError
from areal_hpc.proxy.app import build_app
from areal_hpc.proxy.chat_template import ChatTokenizer
from areal_hpc.proxy.ended import EndedSessions
from areal_hpc.proxy.gateway import Proxy, ProxySettings
from areal_hpc.proxy.records import RecordSink
from areal_hpc.proxy.router import BackendRouter
from areal_hpc.proxy.tenants import Quota, TenantKeys
from areal_hpc.runtime.name_resolve import NameResolve, bind
from areal_hpc.runtime.rollout_token import rollout_token


def build_proxy(cfg) -> Proxy:
    p = cfg.proxy
    folder = cfg.tokenizer.path or cfg.model.path
    if not folder:
        raise UserError("the proxy needs the served model's tokenizer: set model.path=DIR (or tokenizer.path=DIR)")
    if not p.keys_file:
        raise UserError(
            "the proxy needs proxy.keys_file=FILE (tenants and their hashed keys; "
            "`areal-hpc proxy-key --keys-file FILE --tenant NAME` makes one)"
        )
    backends = [b.strip() for b in p.backends.split(",") if b.strip()]
    for address in backends:
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise UserError(f"proxy.backends entry {address!r} is not host:port")
    names = None if backends else NameResolve(Path(p.name_resolve or cfg.run_dir / "name_resolve"))
    settings = ProxySettings(
        model_name=p.model_name or Path(folder).name,
        default_max_tokens=p.default_max_tokens,
        max_tokens_cap=p.max_tokens_cap,
        discount=p.discount,
        reward_grace_s=p.reward_grace_s,
        session_idle_s=p.session_idle_s,
        records_per_version=cfg.rl.proxy_records_per_step,
        max_staleness=cfg.rollout.max_head_offpolicyness,
    )
    keys = TenantKeys(p.keys_file, Quota(p.requests_per_minute, p.tokens_per_minute))
    router = BackendRouter(backends, names, read_token(p.rollout_token_file, cfg.run_dir), p.request_timeout_s)
    sink = RecordSink(
        p.shards_dir or cfg.run_dir / "shards", experiment=cfg.experiment.name, trial=cfg.experiment.trial
    )
    return Proxy(
        settings,
        ChatTokenizer(folder),
        keys,
        router,
        sink,
        ended_sessions=EndedSessions(sink.writer.directory / "ended-sessions"),
    )


def read_token(path: str, run_dir: Path) -> str | None:
    """The rollout servers' token: the configured file, else the run's own when it exists."""
    if not path:
        return rollout_token(run_dir)
    try:
        return Path(path).read_text().strip() or None
    except OSError as exc:
        raise UserError(f"cannot read proxy.rollout_token_file {path}: {exc.strerror}") from None


def serve_proxy(cfg) -> None:
    sock = bind(cfg.proxy.host, cfg.proxy.port)
    proxy = build_proxy(cfg)
    host, port = sock.getsockname()[:2]
    print(
        f"proxy for {proxy.settings.model_name} on http://{host}:{port}/v1 "
        f"(backends: {cfg.proxy.backends or 'name-resolve'}; records: {proxy.sink.writer.directory})",
        flush=True,
    )
    web.run_app(build_app(proxy, cfg.proxy.max_request_bytes), sock=sock, print=None, handle_signals=True)
