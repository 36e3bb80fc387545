"""GET/HEAD /health, GET/POST /ping (vLLM's; SageMaker's POST), GET /version, GET /metrics.

/health says whether the engine is alive and not stuck (503 otherwise, so a supervisor can
restart us) and whether the store is degraded (a tier unreachable: requests still answer,
misses recompute)."""

from __future__ import annotations

import asyncio
import importlib.metadata
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from cachecraft.server.auth import caller_namespace
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


# one route per method, so each has an operation ID of its own in the OpenAPI schema
@router.get("/health")
@router.head("/health")
@router.get("/ping")
@router.post("/ping")
async def health(state: State) -> JSONResponse:
    """200 while the step thread is alive and no unit of its work has run longer than
    `watchdog_s`; 503 (with the reason) otherwise. Also `HEAD /health` (uptime checkers)
    and vLLM's `/ping` (GET or POST: SageMaker's)."""
    engine = state.engine
    problem, live = liveness_problem(state)
    tiers = await asyncio.to_thread(state.store.health)  # may ping Redis
    body = {
        "status": "ok" if problem is None else "unavailable",
        "reason": problem,
        "tiers": {t.name: t._asdict() for t in tiers},
        "model": state.loaded.name,
        "dtype": str(state.loaded.model.dtype).removeprefix("torch."),
        "mode": engine.config.mode,
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


def metrics_access(request: Request) -> None:
    if not request.app.state.config.metrics_public:
        caller_namespace(request)  # raises 401 without a valid key (when keys are configured)


@router.get("/metrics", dependencies=[Depends(metrics_access)])
async def metrics(state: State) -> Response:
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")
