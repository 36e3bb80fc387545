"""`cachecraft bench decode`: the time of one decode step over B sequences, ours vs vLLM.

One clock for both sides (`step_ms`): a step runs from the moment the batch is formed to its
tokens being available, measured offline the same way for us and for vLLM: B prompts of the
same `context` token ids are generated with 1 token and with 1 + `steps` tokens, and the step
is (T(1 + steps) - T(1)) / steps (medians of `repeats` pairs), so scheduling, batch assembly,
sampling and the gaps between steps count on both sides and the prefill cancels. Our engine's
token budget fits every prefill of a batch in one step, as vLLM's prefix-cached prompts do,
so no decode row rides along a later prefill.

Ours is also timed the engine's way (`engine_step_ms`): the median of the engine steps that
decoded exactly B sequences and prefilled nothing (forward and sampling only). Both are
reported; `clocks_disagree` marks the B where they differ by more than `DISAGREE`.

Both sides stay loaded for the whole run and take turns, B by B, `rounds` times: ours, then
vLLM, then ours again... (never at the same time). This VM's speed drifts by 20-30% over
minutes, so one side measured minutes after the other compared the drift as much as the
code; the ratio reported per B is the median of the rounds' ratios.
"""

from __future__ import annotations

import contextlib
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from cachecraft.api import (
    EngineConfig,
    Failed,
    Finished,
    LoadedModel,
    SamplingParams,
    build_stack,
    close_stack,
    load_model,
    memory_config,
    resolve_model_dir,
)
from cachecraft.env import torch_threads, tuning_enabled
from cachecraft.errors import CachecraftError
from cachecraft.request import RagRequest
from cachecraft_bench.peer_vllm import signal_group, vllm_env

DEFAULT_BATCHES = (1, 4, 16, 32)
DEFAULT_ROUNDS = 2
DEFAULT_REPEATS = 3
"""Pairs of offline runs (1 token, 1 + steps tokens) per measurement; medians taken."""
DISAGREE = 0.10
"""Relative gap between the offline and the engine clock past which `clocks_disagree` is set."""


def _prompt_ids(m: LoadedModel, context: int, seed: int) -> list[int]:
    """About `context` token ids of plain text, different for every seed."""
    words = " ".join(
        f"item {seed}-{i} follows item {seed}-{i - 1} in the list." for i in range(context)
    )
    return m.tokenizer(words, add_special_tokens=False)["input_ids"][:context]


class OursDecode:
    """Our engine, built once, timing decode steps at any B up to `max_batch`."""

    def __init__(
        self, m: LoadedModel, max_batch: int, context: int, steps: int, repeats: int
    ) -> None:
        self.m, self.context, self.steps, self.repeats = m, context, steps, repeats
        self.config = EngineConfig(
            # every prefill of a batch in one step: vLLM's cached prompts prefill in one too
            token_budget=max(2048, max_batch * (context + 8)),
            max_running=max_batch,
            max_queue=max_batch,
            mode="full",
        )
        self.stack = build_stack(loaded=m, store=memory_config(1 << 20), engine=self.config)

    def _generate(self, b: int, max_tokens: int) -> float:
        """Seconds from submitting `b` prompts (the batch formed) to all `max_tokens` tokens of
        every one of them being available."""
        engine = self.stack.engine
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        prompts = [_prompt_ids(self.m, self.context, 1000 * b + i) for i in range(b)]
        t0 = time.perf_counter()
        handles = [engine.submit(RagRequest("", prompt_ids=ids), sampling) for ids in prompts]
        for h in handles:
            while True:
                event = h.get(timeout=1800)
                if isinstance(event, Failed):
                    raise CachecraftError(f"decode bench request failed: {event.error}")
                if isinstance(event, Finished):
                    break
        return time.perf_counter() - t0

    def measure_offline(self, b: int) -> float | None:
        """(T(1 + steps) - T(1)) / steps in ms at `b` sequences: the clock vLLM's side uses."""
        self._generate(b, 1)  # one-off costs (first use of these shapes) out of the pairs
        one, many = [], []
        for _ in range(self.repeats):
            one.append(self._generate(b, 1))
            many.append(self._generate(b, 1 + self.steps))
        ms = 1000 * (statistics.median(many) - statistics.median(one)) / self.steps
        return round(ms, 1) if ms > 0 else None

    def measure(self, b: int) -> float | None:
        """Median engine step time (ms) with exactly `b` sequences decoding (forward and
        sampling; the engine's own clock)."""
        engine = self.stack.engine
        first = len(engine.recent_steps)
        # the whole batch prefills in one step (the token budget), then `steps` steps with all b
        admit_steps = -(-b * (self.context + 64) // self.config.token_budget) + 1
        self._generate(b, self.steps + 1 + admit_steps)
        times = [
            s.ms
            for s in list(engine.recent_steps)[first:]
            if s.num_prefills == 0 and s.num_decodes == b
        ]
        return round(statistics.median(times), 1) if times else None

    def close(self) -> None:
        close_stack(self.stack)


_VLLM_SCRIPT = r"""
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

def main():
    cfg = json.loads(sys.argv[1])
    llm = LLM(model=cfg["model_dir"], dtype="float32", block_size=32, enforce_eager=True,
              enable_prefix_caching=True, max_num_seqs=max(cfg["batches"]),
              max_model_len=cfg["context"] + cfg["steps"] + 64, seed=0)
    print("READY", flush=True)
    for line in sys.stdin:  # one batch size per line; the step time comes back
        b = int(line)
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in cfg["prompts"][:b]]
        def run(n):
            t0 = time.perf_counter()
            llm.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0),
                         use_tqdm=False)
            return time.perf_counter() - t0
        run(1)  # prefill once (or hit the prefix cache); later calls hit it
        one, many = [], []
        for _ in range(cfg["repeats"]):
            one.append(run(1))
            many.append(run(1 + cfg["steps"]))
        one.sort(); many.sort()
        ms = 1000 * (many[len(many) // 2] - one[len(one) // 2]) / cfg["steps"]
        print("RESULT " + json.dumps(round(ms, 1) if ms > 0 else None), flush=True)

if __name__ == "__main__":
    main()
"""


class VllmDecode:
    """vLLM in a subprocess from its own venv, loaded once, timing decode steps on request
    (one batch size per line on its stdin, one RESULT line back)."""

    def __init__(
        self,
        m: LoadedModel,
        batches: Sequence[int],
        context: int,
        steps: int,
        threads: int,
        python: str | Path,
        repeats: int = DEFAULT_REPEATS,
        timeout_s: float = 1200.0,
    ) -> None:
        python = Path(python).absolute()
        if not python.exists():
            raise CachecraftError(f"no peer venv at {python}: run `make peer-vllm` first")
        self.timeout_s = timeout_s
        prompts = [_prompt_ids(m, context, 1000 * max(batches) + i) for i in range(max(batches))]
        cfg = {
            "model_dir": str(
                resolve_model_dir(None) if m.name == "SmolLM2-135M-Instruct" else m.source
            ),
            "batches": list(batches),
            "context": context,
            "steps": steps,
            "repeats": repeats,
            "prompts": prompts,
        }
        self._tmp = tempfile.TemporaryDirectory(prefix="cachecraft-vllm-decode-")
        tmp = Path(self._tmp.name)
        script = tmp / "vllm_decode.py"
        script.write_text(_VLLM_SCRIPT)
        self._tail: deque[str] = deque(maxlen=20)  # its last output lines, for errors
        self.proc = subprocess.Popen(
            [str(python), str(script), json.dumps(cfg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            # the OpenMP and allocator tuning this process runs with, the same for vLLM
            env=vllm_env(threads, 2, tmp / "cache", tuned=tuning_enabled()),
            cwd=tmp,
            start_new_session=True,
        )
        try:
            self._read_until("READY")
        except BaseException:
            self.close()
            raise

    def _read_until(self, tag: str) -> str:
        """The rest of the next output line starting with `tag` (killed past the timeout)."""
        assert self.proc.stdout is not None
        timer = threading.Timer(self.timeout_s, signal_group, (self.proc.pid, signal.SIGKILL))
        timer.start()
        try:
            for line in self.proc.stdout:
                if line.startswith(tag):
                    return line[len(tag) :].strip()
                self._tail.append(line.rstrip())
        finally:
            timer.cancel()
        code = self.proc.wait()
        tail = "\n".join(self._tail)
        raise CachecraftError(f"vLLM decode run failed (exit {code}):\n{tail}")

    def measure(self, b: int) -> float | None:
        """vLLM's decode step time (ms) at `b` sequences, on the offline clock."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{b}\n")
        self.proc.stdin.flush()
        return json.loads(self._read_until("RESULT "))

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                assert self.proc.stdin is not None
                self.proc.stdin.close()  # its loop ends
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=60)
        # its own session: the engine core and workers it started go with it
        signal_group(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._tmp.cleanup()


def run_decode_bench(
    m: LoadedModel,
    batches: Sequence[int] = DEFAULT_BATCHES,
    context: int = 512,
    steps: int = 16,
    threads: int = 1,
    peer: str | None = None,
    peer_python: str | Path = ".peer-venv/bin/python",
    rounds: int = DEFAULT_ROUNDS,
    progress: Callable[[str], None] | None = None,
    repeats: int = DEFAULT_REPEATS,
) -> dict[str, Any]:
    """Both sides with `threads` threads, taking turns B by B, `rounds` times (see the
    module doc). `step_ms` holds each side's median over the rounds on the offline clock,
    `engine_step_ms` ours on the engine's; `step_ratio_vs_vllm` is the median of the rounds'
    offline ratios. `progress(line)`: one line of news per measurement (the CLI prints it)."""
    if not batches or any(b < 1 for b in batches):
        raise CachecraftError(f"batch sizes must be >= 1, got {list(batches)}")
    if context < 8 or steps < 2:
        raise CachecraftError("--context must be >= 8 and --steps >= 2")
    if rounds < 1 or repeats < 1:
        raise CachecraftError(f"--rounds and --repeats must be >= 1, got {rounds}, {repeats}")
    if peer not in (None, "vllm"):
        raise CachecraftError(f"unknown peer {peer!r}; choose vllm")
    if peer == "vllm" and not Path(peer_python).exists():  # before loading anything
        raise CachecraftError(f"no peer venv at {peer_python}: run `make peer-vllm` first")
    t0 = time.perf_counter()
    sides = ["ours"] + ([] if peer is None else ["vllm"])
    per_round: dict[str, dict[str, list[float | None]]] = {
        side: {str(b): [] for b in batches} for side in sides
    }
    engine_rounds: dict[str, list[float | None]] = {str(b): [] for b in batches}
    with contextlib.ExitStack() as stack:
        with torch_threads(threads):  # the engine's step thread takes this count
            ours = OursDecode(m, max(batches), context, steps, repeats)
        stack.callback(ours.close)
        measures = {"ours": ours.measure_offline}
        if peer == "vllm":
            if progress is not None:
                progress("starting vLLM (about a minute)")
            vllm = VllmDecode(m, batches, context, steps, threads, peer_python, repeats)
            stack.callback(vllm.close)
            measures["vllm"] = vllm.measure
        for b in batches:
            for r in range(rounds):
                for side in sides:
                    ms = measures[side](b)
                    per_round[side][str(b)].append(ms)
                    if progress is not None:
                        progress(f"{side} B={b} round {r + 1}/{rounds}: {ms} ms")
                engine_rounds[str(b)].append(ours.measure(b))
    step_ms = {side: {b: _median(v) for b, v in per_b.items()} for side, per_b in per_round.items()}
    engine_ms = {b: _median(v) for b, v in engine_rounds.items()}
    result: dict[str, Any] = {
        "config": {
            "model": m.name,
            "batches": list(batches),
            "context": context,
            "steps": steps,
            "threads": threads,
            "rounds": rounds,
            "repeats": repeats,
            "peer": peer,
            "clock": "offline: (T(1 + steps tokens) - T(1 token)) / steps, batch formed to "
            "tokens available, both sides",
        },
        "step_ms": step_ms,
        "rounds_ms": per_round,
        "engine_step_ms": {"ours": engine_ms},
        "engine_rounds_ms": {"ours": engine_rounds},
        "clocks_disagree": {
            b: clocks_disagree(step_ms["ours"][b], engine_ms[b]) for b in engine_ms
        },
    }
    if peer == "vllm":
        result["step_ratio_vs_vllm"] = {
            b: _median(
                [
                    round(o / v, 3) if o and v else None
                    for o, v in zip(per_round["ours"][b], per_round["vllm"][b], strict=True)
                ]
            )
            for b in per_round["ours"]
        }
    result["tokens_per_s"] = {
        side: {b: (round(1000 * int(b) / ms, 1) if ms else None) for b, ms in per_b.items()}
        for side, per_b in step_ms.items()
    }
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    return result


def clocks_disagree(offline_ms: float | None, engine_ms: float | None) -> bool | None:
    """Whether the two clocks of one B differ by more than `DISAGREE` of the engine's (None
    when either is missing)."""
    if not offline_ms or not engine_ms:
        return None
    return abs(offline_ms - engine_ms) > DISAGREE * engine_ms


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(statistics.median(known), 3) if known else None


def add_bench_decode_parser(subparsers: Any) -> Any:
    parser = subparsers.add_parser("decode", help="decode step time at batch sizes B (vs vLLM)")
    parser.add_argument("--batches", default=",".join(map(str, DEFAULT_BATCHES)))
    parser.add_argument("--context", type=int, default=512, help="prompt tokens per sequence")
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed per B")
    parser.add_argument("--threads", type=int, default=1, help="threads for each side")
    parser.add_argument(
        "--rounds",
        type=int,
        default=DEFAULT_ROUNDS,
        help="turns each side takes per B (medians reported)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=DEFAULT_REPEATS,
        help="pairs of offline runs (1 and 1 + steps tokens) per measurement (medians taken)",
    )
    parser.add_argument("--peer", choices=("vllm",), default=None)
    parser.add_argument("--peer-python", default=".peer-venv/bin/python")
    parser.add_argument("--model", default=None)
    parser.add_argument("--json", action="store_true")
    parser.set_defaults(func=main_decode_bench)
    return parser


def main_decode_bench(args: Any) -> int:
    try:
        batches = [int(x) for x in args.batches.split(",") if x.strip()]
    except ValueError:
        raise CachecraftError(
            f"--batches takes integers like 1,4,16, got {args.batches!r}"
        ) from None
    result = run_decode_bench(
        load_model(args.model),
        batches,
        args.context,
        args.steps,
        args.threads,
        args.peer,
        args.peer_python,
        args.rounds,
        lambda line: print(f"[bench decode] {line}", file=sys.stderr, flush=True),
        args.repeats,
    )
    if args.json:
        print(json.dumps(result, indent=2))  # CLI output
        return 0
    print(
        f"decode step, {args.context}-token context, {args.threads} thread(s), "
        f"median of {args.rounds} round(s), ms (tokens/s); offline clock on both sides, "
        "ours on the engine's clock beside it"
    )
    for b in result["step_ms"]["ours"]:
        row = [f"B={b:>3}"]
        for side, per_b in result["step_ms"].items():
            ms = per_b.get(b)
            tps = result["tokens_per_s"][side].get(b)
            row.append(f"{side} {ms} ({tps})")
        row.append(f"ours engine clock {result['engine_step_ms']['ours'][b]}")
        if "step_ratio_vs_vllm" in result:
            row.append(f"ours/vllm {result['step_ratio_vs_vllm'][b]}")
        print("  ".join(row))
    return 0
