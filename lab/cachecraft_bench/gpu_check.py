"""The GPU session's model checks (issue 53), one shape at a time: `python -m
cachecraft_bench.gpu_check --shape llama-8b --device cuda --dtype bfloat16 --out DIR`.

Per shape (random weights: speed only), into DIR/<shape>.json:
* TTFT of one request of 5 x 1,000-token chunks, every chunk a hit, in full / prefix /
  cachecraft, with each one's host overhead (TTFT minus the forward passes);
* an all-miss request's TTFT in cachecraft and prefix over full (paired per request);
* the decode step at B=32 over 1,000-token contexts and its tokens/s.
Each part is timed and an error in one is recorded in the JSON, not fatal to the others.
scripts/gpu_check.sh runs it for the 1B and 8B shapes, then `bench serve`.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from cachecraft.api import SHAPES, LoadedModel, load_model
from cachecraft_bench.decode_bench import run_decode_bench
from cachecraft_bench.host_overhead import host_overhead
from cachecraft_bench.model_bench import miss_ttft


def _part(out: dict[str, Any], name: str, run: Callable[[], Any]) -> None:
    """out[name] = run() and its seconds, or the error that stopped it."""
    t0 = time.perf_counter()
    try:
        out[name] = run()
    except Exception as e:  # one part failing must not lose the others' figures
        out[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
    out[f"{name}_s"] = round(time.perf_counter() - t0, 1)


def check_shape(
    m: LoadedModel, repeats: int, chunk_tokens: int, decode_batch: int, decode_steps: int
) -> dict[str, Any]:
    """The three parts of the module doc for one loaded model."""
    out: dict[str, Any] = {"model": m.name, "device": str(m.model.device)}
    if m.model.device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(m.model.device)
    _part(out, "hits", lambda: host_overhead(m, repeats, chunk_tokens=chunk_tokens))
    _part(out, "misses", lambda: miss_ttft(m, max(2, repeats // 2), chunk_tokens=chunk_tokens))
    _part(
        out,
        "decode",
        lambda: run_decode_bench(
            m, (decode_batch,), context=chunk_tokens, steps=decode_steps, rounds=1
        ),
    )
    hits = out.get("hits", {}).get("host_overhead_detail")
    if hits:
        full = hits["full"]["ttft_ms"]
        out["hit_ttft_over_full"] = {
            mode: round(hits[mode]["ttft_ms"] / full, 3) for mode in ("prefix", "cachecraft")
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=SHAPES, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chunk-tokens", type=int, default=1000)
    parser.add_argument("--decode-batch", type=int, default=32)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--out", type=Path, required=True, help="directory for <shape>.json")
    args = parser.parse_args()
    t0 = time.perf_counter()
    m = load_model(f"shape:{args.shape}", args.dtype, args.device)
    load_s = round(time.perf_counter() - t0, 1)
    out = check_shape(m, args.repeats, args.chunk_tokens, args.decode_batch, args.decode_steps)
    out.update(shape=args.shape, dtype=args.dtype, load_s=load_s)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.shape}.json"
    path.write_text(json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in out.items() if k != "decode"}, indent=1)[:4000])


if __name__ == "__main__":
    main()
