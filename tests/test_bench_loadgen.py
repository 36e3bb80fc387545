"""The open-loop load generator against a fake OpenAI-compatible SSE server started here."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fake_openai import CHUNK_DELAY_S, NUM_CHUNKS, serve_fake

from cachecraft_bench.loadgen import RequestResult, apply_usage, replay, summarize
from cachecraft_bench.trace import TraceRequest


@pytest.fixture(scope="module")
def fake_url() -> Iterator[str]:
    with serve_fake() as url:
        yield url


def _chat(arrival: float, **extra: object) -> TraceRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True, **extra}
    return TraceRequest(arrival_s=arrival, body=body)


def test_streams_record_ttft_e2e_and_usage(fake_url: str) -> None:
    results = replay([_chat(0.0), _chat(0.02)], fake_url, request_timeout_s=10)
    for r in results:
        assert r.is_ok, r.error
        assert r.ttft_s is not None and r.e2e_s is not None
        assert CHUNK_DELAY_S * 0.9 <= r.ttft_s < r.e2e_s
        assert r.e2e_s >= NUM_CHUNKS * CHUNK_DELAY_S * 0.9
        assert r.text == "t0 t1 t2 t3 "
        assert (r.prompt_tokens, r.cached_tokens, r.computed_tokens) == (100, 60, 30)
        assert r.num_output_tokens == NUM_CHUNKS
    s = summarize(results)
    assert (s["num_completed"], s["num_rejected"], s["num_errors"]) == (2, 0, 0)
    assert s["computed_fraction"] == 0.3
    assert s["ttft_ms_p50"] < s["e2e_ms_p50"] <= s["e2e_ms_p95"]
    assert 0 < s["throughput_rps"] <= 2 / (NUM_CHUNKS * CHUNK_DELAY_S)


def test_open_loop_slow_responses_do_not_delay_later_sends(fake_url: str) -> None:
    """The fake answers none of ten requests before all ten arrived: an open loop sends each
    at its time whatever the earlier ones do and completes them all; a closed loop (the
    second sent only after the first completed) would never get an answer."""
    trace = [_chat(0.05 * i, gate=["open-loop", 10]) for i in range(10)]
    results = replay(trace, fake_url, request_timeout_s=30)
    assert all(r.is_ok for r in results), [r.error for r in results]
    for r in results:
        assert r.sent_s is not None and r.sent_s >= r.scheduled_s  # never before its time
    assert max(r.sent_s or 0.0 for r in results) < min(r.finished_s or 0.0 for r in results)
    lag = max((r.sent_s or 0.0) - r.scheduled_s for r in results)
    assert summarize(results)["send_lag_ms_max"] == pytest.approx(1000 * lag, abs=0.01)


def test_429_counts_as_rejected_and_500_as_error(fake_url: str) -> None:
    trace = [_chat(0.0, reject=True), _chat(0.0, fail=True), _chat(0.0)]
    results = replay(trace, fake_url, request_timeout_s=10)
    assert results[0].is_rejected and results[0].error is None and not results[0].is_ok
    assert results[1].status == 500 and "boom" in (results[1].error or "")
    s = summarize(results)
    assert (s["num_completed"], s["num_rejected"], s["num_errors"]) == (1, 1, 1)


def test_request_timeout_and_unreachable_server_are_errors(fake_url: str) -> None:
    slow = replay([_chat(0.0, delay_s=5.0)], fake_url, request_timeout_s=0.3)
    assert slow[0].error is not None and "timed out" in slow[0].error
    dead = replay([_chat(0.0)], "http://127.0.0.1:9", request_timeout_s=2)
    assert dead[0].error is not None and dead[0].status is None
    assert summarize(slow + dead)["num_errors"] == 2


def test_run_timeout_cuts_off_the_run(fake_url: str) -> None:
    """A request that is never answered (its gate never opens) ends with the run's timeout,
    not its own (30 s, named differently in the error)."""
    never = _chat(0.0, gate=["never", 2])
    results = replay([never], fake_url, request_timeout_s=30, run_timeout_s=0.5)
    assert results[0].error is not None and "run timed out after 0.5 s" in results[0].error


def test_completions_stream_and_non_stream(fake_url: str) -> None:
    body = {"prompt": [1, 2, 3], "max_tokens": 2, "cache_salt": "completions-test"}
    trace = [
        TraceRequest(0.0, {**body, "stream": True}, path="/v1/completions"),
        TraceRequest(0.3, {**body, "stream": True}, path="/v1/completions"),
        TraceRequest(0.0, {**body, "prompt": [7, 8]}, path="/v1/completions"),
    ]
    cold, warm, plain = replay(trace, fake_url, request_timeout_s=10)
    assert cold.text == warm.text == plain.text == "ab"
    assert (cold.prompt_tokens, cold.cached_tokens, cold.computed_tokens) == (3, 0, 3)
    assert (warm.prompt_tokens, warm.cached_tokens, warm.computed_tokens) == (3, 2, 1)
    assert plain.prompt_tokens == 2 and plain.computed_tokens is None


def test_summary_of_nothing_completed() -> None:
    s = summarize([RequestResult(index=0, id="a", scheduled_s=0.0, status=429)])
    assert s["throughput_rps"] == 0.0 and s["e2e_ms_p50"] is None
    assert s["computed_fraction"] is None and s["num_rejected"] == 1


def test_work_tokens_count_the_probe_and_partial_layers() -> None:
    """Our report's layer share and probe cost give the rows the prefill ran at full depth;
    a server without them (vLLM) did exactly its computed tokens."""
    ours = RequestResult(index=0, id="a", scheduled_s=0.0)
    report = {"tokens_computed": 40, "prompt_tokens": 100, "layer_fraction": 0.45}
    apply_usage(ours, {"prompt_tokens": 100, "cachecraft": {**report, "probe_cost": 3.5}})
    assert ours.computed_tokens == 40 and ours.work_tokens == pytest.approx(48.5)
    peer = RequestResult(index=1, id="b", scheduled_s=0.0)
    apply_usage(peer, {"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 70}})
    assert peer.computed_tokens == 30 and peer.work_tokens == 30.0
    for r, t in ((ours, 1.0), (peer, 2.0)):
        r.status, r.sent_s, r.finished_s, r.e2e_s = 200, 0.0, t, t
    s = summarize([ours, peer])
    assert s["computed_tokens"] == 70 and s["work_tokens"] == 78.5
