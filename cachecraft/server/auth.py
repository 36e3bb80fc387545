"""Who is calling: API keys to tenants and cache namespaces, and the admin key.

A tenant is one API key (`key-<hash>`, never the key itself); every cache namespace it uses
(`cache_namespace`, `cache_salt`) lives under it, so what it pins counts against one budget
(`tenant_of`). Without keys, or with `share_namespace`, every caller is the one tenant
"default". Store-wide figures (every tier, every tenant) are the operator's: an admin key
(`admin_keys`) opens them, or `metrics_public`, or a server with no keys at all.
"""

from __future__ import annotations

import hashlib
from enum import Enum
from typing import Annotated

from fastapi import Depends, Request

from cachecraft.server.config import ServerConfig
from cachecraft.server.errors import ApiError
from cachecraft.server.protocol import check_utf8

DEFAULT = "default"


class Access(Enum):
    """What a caller may see: ANONYMOUS (keys are set and it gave none that is valid: alive or
    not, nothing else), TENANT (its own figures), OPERATOR (store-wide figures)."""

    ANONYMOUS = "anonymous"
    TENANT = "tenant"
    OPERATOR = "operator"


def _bearer(request: Request) -> str | None:
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    return key.strip() if scheme.lower() == "bearer" and key.strip() else None


def _tenant_id(key: str) -> str:
    return "key-" + hashlib.blake2b(key.encode(), digest_size=8).hexdigest()


def _config(request: Request) -> ServerConfig:
    return request.app.state.config


def caller_namespace(request: Request) -> str:
    """The caller's base cache namespace (its tenant); 401 without a valid API key when keys
    are set."""
    config = _config(request)
    if not config.api_keys:
        return DEFAULT
    key = _bearer(request)
    if key is None or key not in config.api_keys:
        raise ApiError(401, "missing or invalid API key", "authentication_error", "invalid_api_key")
    return DEFAULT if config.share_namespace else _tenant_id(key)


Namespace = Annotated[str, Depends(caller_namespace)]


def access(request: Request) -> Access:
    """What this caller may see (never raises)."""
    config = _config(request)
    key = _bearer(request)
    if not config.is_secured or config.metrics_public or key in config.admin_keys:
        return Access.OPERATOR
    return Access.TENANT if key in config.api_keys else Access.ANONYMOUS


def require_operator(request: Request) -> None:
    """401 without a key, 403 with a tenant's key: store-wide figures are the operator's."""
    seen = access(request)
    if seen is Access.OPERATOR:
        return
    if seen is Access.ANONYMOUS:
        raise ApiError(401, "missing or invalid API key", "authentication_error", "invalid_api_key")
    raise ApiError(
        403,
        "store-wide figures need the admin key (--admin-key) or --metrics-public",
        "permission_error",
        "admin_key_required",
    )


def tenant_of(namespace: str, config: ServerConfig) -> str:
    """The tenant a (scoped) namespace belongs to: its first segment with per-key namespaces,
    else the one tenant "default" (no keys, or all keys share one namespace)."""
    if not config.api_keys or config.share_namespace:
        return DEFAULT
    return namespace.split("/", 1)[0]


def salted(requested: str | None, salt: str | None) -> str | None:
    """vLLM's `cache_salt` as a namespace of its hash (the salt itself never stored or
    listed), inside the requested namespace when there is one."""
    if salt is None:
        return requested
    digest = "salt-" + hashlib.sha256(salt.encode("utf-8")).hexdigest()[:32]
    return digest if requested is None else f"{requested}/{digest}"


def scoped(base: str, requested: str | None) -> str:
    """`requested` inside the caller's base namespace."""
    if requested is None:
        return base
    return requested if base == DEFAULT else f"{base}/{requested}"


def checked_query(value: str | None) -> str | None:
    """Query strings are not validated by pydantic's str type: refuse lone surrogates here."""
    if value is None:
        return None
    try:
        return check_utf8(value)
    except ValueError as e:
        raise ApiError(400, f"cache_namespace: {e}", "invalid_request_error") from None
