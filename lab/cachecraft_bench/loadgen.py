"""Open-loop load generator: replay a trace of HTTP requests against an OpenAI-compatible server.

Each request is sent at its arrival time whatever the state of earlier ones (one asyncio task per
request, unbounded connections), its SSE stream is read to the end, and TTFT, end-to-end latency
and the token counts of the final usage chunk are recorded. `summarize` turns results into rates
and percentiles. Owns no server and no trace construction.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from cachecraft_bench.metrics import p50, p95
from cachecraft_bench.trace import TraceRequest

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestResult:
    """Times are seconds from the start of the run (`*_s`) or durations (`ttft_s`, `e2e_s`)."""

    index: int
    id: str
    scheduled_s: float
    sent_s: float | None = None
    finished_s: float | None = None
    status: int | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    num_output_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    computed_tokens: int | None = None
    work_tokens: float | None = None
    """Full-depth rows the prefill ran: computed tokens plus the probe's rows and the check's
    candidates by the share of layers they ran (our server's report; else computed_tokens)."""
    text: str = ""
    error: str | None = None

    @property
    def is_rejected(self) -> bool:
        return self.status == 429

    @property
    def is_ok(self) -> bool:
        return self.status == 200 and self.error is None and self.e2e_s is not None


def apply_usage(res: RequestResult, usage: dict[str, Any]) -> None:
    """Fill token counts from an OpenAI `usage` object (plus our `usage.cachecraft` report)."""
    if usage.get("prompt_tokens") is not None:
        res.prompt_tokens = int(usage["prompt_tokens"])
    if usage.get("completion_tokens") is not None:
        res.num_output_tokens = int(usage["completion_tokens"])
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        res.cached_tokens = int(details["cached_tokens"])
    report = usage.get("cachecraft") or {}
    if report.get("tokens_computed") is not None:
        res.computed_tokens = int(report["tokens_computed"])
    elif res.prompt_tokens is not None and res.cached_tokens is not None:
        res.computed_tokens = res.prompt_tokens - res.cached_tokens
    fraction, prompt = report.get("layer_fraction"), report.get("prompt_tokens")
    if fraction is not None and prompt is not None:
        res.work_tokens = float(fraction) * int(prompt) + float(report.get("probe_cost") or 0.0)
    else:
        res.work_tokens = None if res.computed_tokens is None else float(res.computed_tokens)


def _chunk_text(event: dict[str, Any]) -> str:
    """The generated text in one chunk: chat `delta.content`/`message.content` or `text`."""
    out = []
    for choice in event.get("choices") or []:
        delta = choice.get("delta") or choice.get("message") or {}
        out.append(delta.get("content") or choice.get("text") or "")
    return "".join(out)


async def _read_stream(resp: httpx.Response, res: RequestResult, t_send: float) -> None:
    num_chunks = 0
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            break
        event = json.loads(payload)
        if "error" in event:
            res.error = str(event["error"])[:200]
            break
        text = _chunk_text(event)
        if text:
            num_chunks += 1
            if res.ttft_s is None:
                res.ttft_s = time.perf_counter() - t_send
            res.text += text
        if event.get("usage"):
            apply_usage(res, event["usage"])
    if not res.num_output_tokens:
        res.num_output_tokens = num_chunks  # no usage chunk: one token per content chunk


async def _send(
    client: httpx.AsyncClient,
    req: TraceRequest,
    res: RequestResult,
    t0: float,
    headers: dict[str, str],
    request_timeout_s: float,
) -> None:
    await asyncio.sleep(max(0.0, t0 + req.arrival_s - time.perf_counter()))
    t_send = time.perf_counter()
    res.sent_s = t_send - t0
    try:
        async with asyncio.timeout(request_timeout_s):
            async with client.stream("POST", req.path, json=req.body, headers=headers) as resp:
                res.status = resp.status_code
                if resp.status_code != 200:
                    detail = (await resp.aread()).decode(errors="replace")[:200]
                    if not res.is_rejected:
                        res.error = f"HTTP {resp.status_code}: {detail}"
                elif req.body.get("stream"):
                    await _read_stream(resp, res, t_send)
                else:
                    data = json.loads(await resp.aread())
                    res.ttft_s = time.perf_counter() - t_send
                    res.text = _chunk_text(data)
                    apply_usage(res, data.get("usage") or {})
    except TimeoutError:
        res.error = f"timed out after {request_timeout_s:g} s"
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        res.error = f"{type(e).__name__}: {e}"[:200]
    t_end = time.perf_counter()
    res.finished_s = t_end - t0
    if res.status == 200 and res.error is None:
        res.e2e_s = t_end - t_send


async def run_trace(
    trace: Sequence[TraceRequest],
    base_url: str,
    api_key: str | None = None,
    request_timeout_s: float = 300.0,
    run_timeout_s: float | None = None,
) -> list[RequestResult]:
    """Send every request of `trace` at its arrival time (open loop) and wait for all of them.

    A request past `request_timeout_s`, or still running when `run_timeout_s` (default: last
    arrival + request timeout) ends the run, is recorded with an error, never raised."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    results = [
        RequestResult(index=i, id=r.id or str(i), scheduled_s=r.arrival_s)
        for i, r in enumerate(trace)
    ]
    if run_timeout_s is None:
        run_timeout_s = max((r.arrival_s for r in trace), default=0.0) + request_timeout_s
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    timeout = httpx.Timeout(request_timeout_s, connect=min(30.0, request_timeout_s))
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout) as client:
        t0 = time.perf_counter()
        tasks = [
            asyncio.create_task(_send(client, req, res, t0, headers, request_timeout_s))
            for req, res in zip(trace, results, strict=True)
        ]
        if not tasks:
            return results
        _, pending = await asyncio.wait(tasks, timeout=run_timeout_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    for res in results:
        if res.finished_s is None:
            res.error = f"run timed out after {run_timeout_s:g} s"
    if pending:
        logger.warning("%d of %d requests cut off by the run timeout", len(pending), len(tasks))
    return results


def replay(
    trace: Sequence[TraceRequest],
    base_url: str,
    api_key: str | None = None,
    request_timeout_s: float = 300.0,
    run_timeout_s: float | None = None,
) -> list[RequestResult]:
    """Blocking `run_trace` (runs its own event loop)."""
    return asyncio.run(run_trace(trace, base_url, api_key, request_timeout_s, run_timeout_s))


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000.0, 2)


def summarize(results: Sequence[RequestResult]) -> dict[str, Any]:
    """Throughput (completed / makespan from the first send to the last completion), TTFT and
    e2e percentiles in ms, token counts and the fraction of prompt tokens computed."""
    ok = [r for r in results if r.is_ok]
    sent = [r.sent_s for r in results if r.sent_s is not None]
    makespan = max((r.finished_s or 0.0 for r in ok), default=0.0) - min(sent, default=0.0)
    known = [r for r in ok if r.prompt_tokens is not None and r.computed_tokens is not None]
    prompt = sum(r.prompt_tokens or 0 for r in known)
    computed = sum(r.computed_tokens or 0 for r in known)
    work = sum(r.work_tokens or 0.0 for r in known)
    lags = [r.sent_s - r.scheduled_s for r in results if r.sent_s is not None]
    return {
        "num_requests": len(results),
        "num_completed": len(ok),
        "num_rejected": sum(r.is_rejected for r in results),
        "num_errors": sum(not r.is_ok and not r.is_rejected for r in results),
        "makespan_s": round(makespan, 3),
        "throughput_rps": round(len(ok) / makespan, 4) if ok and makespan > 0 else 0.0,
        "ttft_ms_p50": _ms(p50(r.ttft_s for r in ok)),
        "ttft_ms_p95": _ms(p95(r.ttft_s for r in ok)),
        "e2e_ms_p50": _ms(p50(r.e2e_s for r in ok)),
        "e2e_ms_p95": _ms(p95(r.e2e_s for r in ok)),
        "output_tokens": sum(r.num_output_tokens for r in ok),
        "prompt_tokens": prompt if known else None,
        "computed_tokens": computed if known else None,
        "computed_fraction": round(computed / prompt, 4) if prompt else None,
        "work_tokens": round(work, 1) if known else None,
        "send_lag_ms_max": _ms(max(lags, default=0.0)),
    }
