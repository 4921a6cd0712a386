"""Tenants, their keys and quotas: keys are stored only as SHA-256 hashes in a YAML keys file, which the
proxy re-reads when it changes (so removing or revoking a key takes effect without a restart).

    tenants:
      alice:
        keys: ["sha256:9f86d0..."]        # `areal-hpc proxy-key --keys-file FILE --tenant alice` adds one
        requests_per_minute: 120          # optional: overrides proxy.requests_per_minute
        tokens_per_minute: 200000         # optional: overrides proxy.tokens_per_minute
    revoked: ["sha256:2c26b4..."]
"""

from __future__ import annotations

import hashlib
import math
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from areal_hpc.errors import UserError
from areal_hpc.fsio import atomic_write_text

HASH = re.compile(r"sha256:[0-9a-f]{64}")
TENANT = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def hash_key(key: str) -> str:
    """How a key is stored and looked up: keys are 256-bit random tokens, so an unsalted hash is enough.
    A key from a header is hashed as the bytes sent: aiohttp hands bytes that are not UTF-8 over as
    surrogates, which ``surrogateescape`` turns back (such a key matches none, and is refused as unknown)."""
    return "sha256:" + hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


def new_key(prefix: str) -> str:
    return f"{prefix}-{secrets.token_urlsafe(32)}"


@dataclass(frozen=True)
class Quota:
    requests_per_minute: float  # 0: unlimited
    tokens_per_minute: float


class TenantKeys:
    """Tenant keys from ``path`` (re-read when its modification time changes)."""

    def __init__(self, path: str | Path, default: Quota):
        self.path, self.default = Path(path), default
        self._stamp: tuple | None = None
        self._tenants: dict[str, str] = {}  # key hash -> tenant
        self._quotas: dict[str, Quota] = {}
        self._revoked: set[str] = set()
        self.reload()

    def reload(self) -> None:
        """Read the file if it changed; unreadable or malformed, it is a UserError (the caller keeps the
        keys it had, so a half-edited file never opens the proxy to everyone or no one)."""
        try:
            stat = self.path.stat()
        except OSError as exc:
            raise UserError(f"cannot read the proxy keys file {self.path}: {exc.strerror}") from None
        stamp = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
        if stamp == self._stamp:
            return
        tenants, quotas, revoked = parse_keys(self.path, self.default)
        self._tenants, self._quotas, self._revoked, self._stamp = tenants, quotas, revoked, stamp

    def tenant(self, key_hash: str) -> str | None:
        """The tenant a key (by hash) belongs to; None for an unknown or revoked key."""
        if key_hash in self._revoked:
            return None
        return self._tenants.get(key_hash)

    def quota(self, tenant: str) -> Quota:
        return self._quotas.get(tenant, self.default)


def parse_keys(path: Path, default: Quota) -> tuple[dict[str, str], dict[str, Quota], set[str]]:
    """(key hash -> tenant, tenant -> quota, revoked hashes); a malformed file is a UserError naming what."""

    def bad(what: str) -> UserError:
        return UserError(f"proxy keys file {path}: {what}")

    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise bad(f"cannot be read as YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(tree, dict) or set(tree) - {"tenants", "revoked"}:
        raise bad("must be a mapping with 'tenants' (and optionally 'revoked')")
    tenants, quotas = {}, {}
    for name, entry in (tree.get("tenants") or {}).items():
        if not isinstance(name, str) or not TENANT.fullmatch(name):
            raise bad(f"tenant name {name!r} must be 1-64 letters, digits, '_', '.' or '-'")
        if not isinstance(entry, dict) or set(entry) - {"keys", "requests_per_minute", "tokens_per_minute"}:
            raise bad(f"tenant {name}: give 'keys' and optionally 'requests_per_minute', 'tokens_per_minute'")
        for key_hash in entry.get("keys") or []:
            if not isinstance(key_hash, str) or not HASH.fullmatch(key_hash):
                raise bad(
                    f"tenant {name}: key {str(key_hash)[:20]!r}... is not 'sha256:' and 64 hex digits "
                    "(the file holds hashes, never keys)"
                )
            if tenants.setdefault(key_hash, name) != name:
                raise bad(f"one key hash is listed for tenants {tenants[key_hash]} and {name}")
        limits = {}
        for field in ("requests_per_minute", "tokens_per_minute"):
            value = entry.get(field)
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0):
                raise bad(f"tenant {name}: {field} = {value!r}; it must be a number >= 0 (0: unlimited)")
            limits[field] = getattr(default, field) if value is None else float(value)
        quotas[name] = Quota(**limits)
    revoked = tree.get("revoked") or []
    if not isinstance(revoked, list) or not all(isinstance(h, str) and HASH.fullmatch(h) for h in revoked):
        raise bad("'revoked' must be a list of 'sha256:<64 hex digits>' hashes")
    return tenants, quotas, set(revoked)


def add_key(path: str | Path, tenant: str) -> str:
    """Make a key for ``tenant``, store its hash in the keys file (created if missing) and return the key,
    which is shown once and stored nowhere."""
    path = Path(path)
    if not TENANT.fullmatch(tenant):
        raise UserError(f"tenant name {tenant!r} must be 1-64 letters, digits, '_', '.' or '-'")
    if path.exists():
        parse_keys(path, Quota(0, 0))  # refuse to extend a malformed file
        tree = yaml.safe_load(path.read_text()) or {}
    else:
        tree = {}
    key = new_key("tk")
    entry = tree.setdefault("tenants", {}).setdefault(tenant, {})
    entry.setdefault("keys", []).append(hash_key(key))
    atomic_write_text(path, yaml.safe_dump(tree, sort_keys=False))
    path.chmod(0o600)
    return key


class QuotaMeter:
    """Per-tenant token buckets: requests per minute, and prompt + completion tokens per minute. A request
    reserves its prompt and its ``max_tokens`` before it runs and gives back what it did not use after, so
    concurrent requests together never spend more than the bucket holds."""

    def __init__(self):
        self._buckets: dict[tuple[str, str], list[float]] = {}  # (tenant, kind) -> [level, last refill time]

    def _level(self, tenant: str, kind: str, per_minute: float) -> list[float]:
        bucket = self._buckets.setdefault((tenant, kind), [per_minute, time.monotonic()])
        t = time.monotonic()
        bucket[0] = min(per_minute, bucket[0] + (t - bucket[1]) * per_minute / 60.0)
        bucket[1] = t
        return bucket

    def admit(self, tenant: str, quota: Quota, tokens: int = 0) -> float:
        """Count a request: 0 when it may start now (one request taken), else the seconds until it may.
        ``tokens``: what it will reserve at least, which the token bucket must hold already (nothing is
        taken from it here: the request reserves once its prompt is tokenised)."""
        waits = []
        if quota.tokens_per_minute:
            level = self._level(tenant, "tokens", quota.tokens_per_minute)[0]
            if level < tokens:
                waits.append((tokens - level) * 60.0 / quota.tokens_per_minute)
        if quota.requests_per_minute:
            requests = self._level(tenant, "requests", quota.requests_per_minute)
            if requests[0] < 1:
                waits.append((1 - requests[0]) * 60.0 / quota.requests_per_minute)
        if waits:
            return max(waits)
        if quota.requests_per_minute:
            requests[0] -= 1
        return 0.0

    def reserve(self, tenant: str, quota: Quota, tokens: int) -> float:
        """Take ``tokens`` from the token bucket: 0 when taken, else the seconds until the bucket holds them."""
        if not quota.tokens_per_minute:
            return 0.0
        bucket = self._level(tenant, "tokens", quota.tokens_per_minute)
        if bucket[0] < tokens:
            return (tokens - bucket[0]) * 60.0 / quota.tokens_per_minute
        bucket[0] -= tokens
        return 0.0

    def refund(self, tenant: str, quota: Quota, tokens: int) -> None:
        """Give back the part of a reservation a request did not use."""
        if quota.tokens_per_minute and tokens > 0:
            bucket = self._level(tenant, "tokens", quota.tokens_per_minute)
            bucket[0] = min(quota.tokens_per_minute, bucket[0] + tokens)


def retry_after(seconds: float) -> str:
    """Retry-After is whole seconds: round up, so a client that waits exactly that long is admitted."""
    return str(max(1, math.ceil(seconds)))
