"""GET/HEAD /health, GET/POST /ping (vLLM's; SageMaker's POST), GET /version, GET /metrics.

/health says whether the engine is alive and not stuck (503 otherwise, so a supervisor can
restart us) and whether the store is degraded (a tier unreachable: requests still answer,
misses recompute). Store-wide figures are the operator's; a tenant sees its own."""

from __future__ import annotations

import asyncio
import importlib.metadata
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from cachecraft.server.auth import Access, access, caller_namespace, require_operator
from cachecraft.server.state import ServerState, State

router = APIRouter()


def liveness_problem(state: ServerState) -> tuple[str | None, Any]:
    """Why the engine is not serving (None: it is), and its liveness record."""
    live = state.engine.liveness()
    if not live.is_alive:
        return "the engine step thread is not running", live
    if live.busy_s is not None and live.busy_s > state.config.watchdog_s:
        return f"the engine has been busy for {live.busy_s:.0f} s (watchdog_s)", live
    return None, live


def tenant_stats(state: ServerState, tenant: str) -> dict[str, Any]:
    """One tenant's figures over all its namespaces (and salts): chunks registered, pins."""
    registry, owner = state.registry, state.owner
    keys = {key for ns, key in registry.entries() if owner(ns) == tenant}
    pinned = {key for ns, key in registry.pins().values() if owner(ns) == tenant}
    return {
        "num_chunks": len(keys),
        "num_pinned": len(pinned),
        "pinned_bytes": state.store.pinned().nbytes(pinned),
    }


# one route per method, so each has an operation ID of its own in the OpenAPI schema
@router.get("/health")
@router.head("/health")
@router.get("/ping")
@router.post("/ping")
async def health(request: Request, state: State) -> JSONResponse:
    """200 while the step thread is alive and no unit of its work has run longer than
    `watchdog_s` (status "ok", or "degraded" while a store tier is unreachable: requests are
    answered, misses recompute); 503 "unavailable" (with the reason) otherwise. Also
    `HEAD /health` (uptime checkers) and vLLM's `/ping` (GET or POST: SageMaker's).

    What else it says depends on the caller (server/auth.py): nothing more without a key when
    keys are set; the model and the caller's own figures (`tenant`) with an API key; every
    tier's and the engine's figures for the operator (admin key, --metrics-public, or a server
    without keys)."""
    engine = state.engine
    problem, live = liveness_problem(state)
    tiers = await asyncio.to_thread(state.store.health)  # may ping Redis
    down = [t.name for t in tiers if not t.is_reachable]
    if problem is None and down:
        problem_or_note = "a store tier is unreachable: requests are answered, misses recompute"
    else:
        problem_or_note = problem
    body: dict[str, Any] = {
        "status": "unavailable" if problem else "degraded" if down else "ok",
        "reason": problem_or_note,
    }
    seen = access(request)
    if seen is not Access.ANONYMOUS:
        body["model"] = state.loaded.name
        body["mode"] = engine.config.mode
    if seen is Access.TENANT:
        tenant = caller_namespace(request)
        body["tenant"] = await asyncio.to_thread(tenant_stats, state, tenant)
    elif seen is Access.OPERATOR:
        body |= {
            "tiers": {t.name: t._asdict() for t in tiers},
            "dtype": str(state.loaded.model.dtype).removeprefix("torch."),
            "num_waiting": engine.num_waiting,
            "num_running": engine.num_running,
            "num_steps": live.num_steps,
            "num_failed_requests": live.num_failed_requests,
        }
    return JSONResponse(body, status_code=200 if problem is None else 503)


@router.get("/version")
async def version() -> dict[str, str]:
    """vLLM's: the server's version (a client probes it to tell what it talks to)."""
    return {"version": importlib.metadata.version("cachecraft")}


@router.get("/metrics", dependencies=[Depends(require_operator)])
async def metrics(state: State) -> Response:
    """Prometheus text: store-wide and engine-wide figures, the operator's (server/auth.py)."""
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")
