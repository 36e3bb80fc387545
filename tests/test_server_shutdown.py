"""`cachecraft serve` stops when told to (issue 13, defect 12): after the probe's engine-killing
request (a seed past 2^64), SIGTERM with a long stream in flight ends the process within
`--shutdown-timeout-s` plus slack, instead of waiting for the stream, or forever when the
engine could never finish it (what happened before)."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_ends_serve_with_a_stream_in_flight(tiny_dir: Path) -> None:
    port = _free_port()
    cmd = [sys.executable, "-m", "cachecraft.cli", "serve", "--model", str(tiny_dir)]
    cmd += ["--port", str(port), "--cache-dir", "", "--shutdown-timeout-s", "1"]
    cmd += ["--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        # a stream that would run for thousands of tokens
        body = {
            "model": "cachecraft",
            "messages": [{"role": "user", "content": "Tell me everything."}],
            "max_tokens": 4000,
            "ignore_eos": True,
            "stream": True,
        }
        bomb = {**body, "stream": False, "temperature": 0.7, "seed": 2**64, "max_tokens": 2}
        # now a 400; it used to kill the step thread, so nothing below was ever answered
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(url + "/v1/chat/completions", json=bomb, timeout=10)
        got_tokens = threading.Event()

        def stream() -> None:
            try:
                with httpx.stream(
                    "POST", url + "/v1/chat/completions", json=body, timeout=120
                ) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                            got_tokens.set()
            except httpx.HTTPError:
                pass  # the server went away mid-stream: expected

        reader = threading.Thread(target=stream, daemon=True)
        reader.start()
        got_tokens.wait(10)  # a dead engine never sends one; SIGTERM must still work
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        assert time.monotonic() - t0 < 20
        reader.join(30)
        assert got_tokens.is_set()  # the engine was alive and streaming when we stopped it
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
