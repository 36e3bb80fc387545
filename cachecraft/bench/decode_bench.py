"""`cachecraft bench decode`: the time of one decode step over B sequences, ours vs vLLM.

Ours runs through the engine the server runs (scheduler, one forward step, sampling): B
requests of about `context` prompt tokens each decode together, and a step counts when it
decoded exactly B sequences and prefilled nothing (median over those steps). vLLM (the peer,
from its own venv, prefix caching on, same thread count) decodes the same B prompts as token
ids: its step is (T(1 + steps tokens) - T(1 token)) / steps over repeated, prefix-cached
prompts, so both timings hold the same short cached prefill and cancel it.
"""

from __future__ import annotations

import json
import logging
import statistics
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

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
from cachecraft.bench.peer_vllm import vllm_env
from cachecraft.errors import CachecraftError
from cachecraft.request import RagRequest

logger = logging.getLogger(__name__)

DEFAULT_BATCHES = (1, 4, 16, 32)


def _prompt_ids(m: LoadedModel, context: int, seed: int) -> list[int]:
    """About `context` token ids of plain text, different for every seed."""
    words = " ".join(
        f"item {seed}-{i} follows item {seed}-{i - 1} in the list." for i in range(context)
    )
    return m.tokenizer(words, add_special_tokens=False)["input_ids"][:context]


def ours_step_ms(
    m: LoadedModel, batches: Sequence[int], context: int, steps: int
) -> dict[str, float | None]:
    """Median engine step time (ms) with exactly B sequences decoding, per B."""
    top = max(batches)
    config = EngineConfig(token_budget=max(2048, top), max_running=top, max_queue=top, mode="full")
    stack = build_stack(loaded=m, store=memory_config(1 << 20), engine=config)
    engine = stack.engine
    out: dict[str, float | None] = {}
    try:
        for b in batches:
            first = len(engine.recent_steps)
            # long enough that the first request still decodes when the last one's prefill
            # is done (prefills share the token budget), then `steps` steps with all B
            admit_steps = -(-b * (context + 64) // config.token_budget) + 1
            sampling = SamplingParams(max_tokens=steps + 1 + admit_steps, ignore_eos=True)
            handles = []
            for i in range(b):
                text = m.tokenizer.decode(_prompt_ids(m, context, 1000 * b + i))
                handles.append(engine.submit(RagRequest(text, []), sampling))
            for h in handles:
                while True:
                    event = h.get(timeout=1800)
                    if isinstance(event, Failed):
                        raise CachecraftError(f"decode bench request failed: {event.error}")
                    if isinstance(event, Finished):
                        break
            times = [
                s.ms
                for s in list(engine.recent_steps)[first:]
                if s.num_prefills == 0 and s.num_decodes == b
            ]
            out[str(b)] = round(statistics.median(times), 1) if times else None
            logger.info("ours B=%d: %s ms over %d steps", b, out[str(b)], len(times))
    finally:
        close_stack(stack)
    return out


_VLLM_SCRIPT = r"""
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

def main():
    cfg = json.loads(sys.argv[1])
    llm = LLM(model=cfg["model_dir"], dtype="float32", block_size=32, enforce_eager=True,
              enable_prefix_caching=True, max_num_seqs=max(cfg["batches"]),
              max_model_len=cfg["context"] + cfg["steps"] + 64, seed=0)
    out = {}
    for b in cfg["batches"]:
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in cfg["prompts"][:b]]
        def run(n):
            t0 = time.perf_counter()
            llm.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0),
                         use_tqdm=False)
            return time.perf_counter() - t0
        run(1)  # prefill once; later calls hit the prefix cache
        one, many = [], []
        for _ in range(cfg["repeats"]):
            one.append(run(1))
            many.append(run(1 + cfg["steps"]))
        one.sort(); many.sort()
        out[str(b)] = round(1000 * (many[len(many) // 2] - one[len(one) // 2]) / cfg["steps"], 1)
    print("RESULT " + json.dumps(out), flush=True)

if __name__ == "__main__":
    main()
"""


def vllm_step_ms(
    m: LoadedModel,
    batches: Sequence[int],
    context: int,
    steps: int,
    threads: int,
    python: str | Path,
    repeats: int = 3,
    timeout_s: float = 1200.0,
) -> dict[str, float | None]:
    """vLLM's decode step time (ms) per B, from its own venv in a subprocess."""
    python = Path(python).absolute()
    if not python.exists():
        raise CachecraftError(f"no peer venv at {python}: run `make peer-vllm` first")
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
    with tempfile.TemporaryDirectory(prefix="cachecraft-vllm-decode-") as tmp:
        script = Path(tmp) / "vllm_decode.py"
        script.write_text(_VLLM_SCRIPT)
        env = vllm_env(threads, 2, Path(tmp) / "cache")
        done = subprocess.run(
            [str(python), str(script), json.dumps(cfg)],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp,
            timeout=timeout_s,
            start_new_session=True,
        )
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    tail = "\n".join((done.stdout + done.stderr).splitlines()[-20:])
    raise CachecraftError(f"vLLM decode run failed (exit {done.returncode}):\n{tail}")


def run_decode_bench(
    m: LoadedModel,
    batches: Sequence[int] = DEFAULT_BATCHES,
    context: int = 512,
    steps: int = 16,
    threads: int = 1,
    peer: str | None = None,
    peer_python: str | Path = ".peer-venv/bin/python",
) -> dict[str, Any]:
    """Both sides with `threads` threads; vLLM runs after ours (never at the same time)."""
    if not batches or any(b < 1 for b in batches):
        raise CachecraftError(f"batch sizes must be >= 1, got {list(batches)}")
    if context < 8 or steps < 2:
        raise CachecraftError("--context must be >= 8 and --steps >= 2")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    try:
        step_ms: dict[str, dict[str, float | None]] = {
            "ours": ours_step_ms(m, batches, context, steps)
        }
    finally:
        torch.set_num_threads(before)
    result: dict[str, Any] = {
        "config": {
            "model": m.name,
            "batches": list(batches),
            "context": context,
            "steps": steps,
            "threads": threads,
            "peer": peer,
        },
        "step_ms": step_ms,
    }
    if peer == "vllm":
        step_ms["vllm"] = vllm_step_ms(m, batches, context, steps, threads, peer_python)
        result["step_ratio_vs_vllm"] = {
            b: (round(ours / theirs, 3) if ours and theirs else None)
            for b, ours, theirs in (
                (k, step_ms["ours"].get(k), step_ms["vllm"].get(k)) for k in step_ms["ours"]
            )
        }
    elif peer is not None:
        raise CachecraftError(f"unknown peer {peer!r}; choose vllm")
    result["tokens_per_s"] = {
        side: {b: (round(1000 * int(b) / ms, 1) if ms else None) for b, ms in per_b.items()}
        for side, per_b in step_ms.items()
    }
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    return result


def add_bench_decode_parser(subparsers: Any) -> Any:
    parser = subparsers.add_parser("decode", help="decode step time at batch sizes B (vs vLLM)")
    parser.add_argument("--batches", default=",".join(map(str, DEFAULT_BATCHES)))
    parser.add_argument("--context", type=int, default=512, help="prompt tokens per sequence")
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed per B")
    parser.add_argument("--threads", type=int, default=1, help="threads for each side")
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
    )
    if args.json:
        print(json.dumps(result, indent=2))  # CLI output
        return 0
    print(f"decode step, {args.context}-token context, {args.threads} thread(s), ms (tokens/s)")
    for b in result["step_ms"]["ours"]:
        row = [f"B={b:>3}"]
        for side, per_b in result["step_ms"].items():
            ms = per_b.get(b)
            tps = result["tokens_per_s"][side].get(b)
            row.append(f"{side} {ms} ({tps})")
        if "step_ratio_vs_vllm" in result:
            row.append(f"ours/vllm {result['step_ratio_vs_vllm'][b]}")
        print("  ".join(row))
    return 0
