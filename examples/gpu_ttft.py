"""Time to first token of `full`, `prefix` and `cachecraft` on any device, a GPU above all.

A RAG session: a pool of chunks; every request takes `--chunks` of them in a new order with a
new question. Each mode gets its own store over the same model: the warm-up requests fill it,
then the mode answers the same measured requests (one token each), its TTFT taken by the
engine (submit to first token). `--shape` picks the bundled model or a model of a named shape
with random weights and the bundled tokenizer: speed needs no trained weights. Quality does,
and is not reported here; with random weights attention is nearly uniform, so cachecraft's
choices (and how much it recomputes) differ from a trained model's.

    .venv/bin/python examples/gpu_ttft.py --device cuda --shape llama-1b --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from cachecraft.engine.sampling import SamplingParams
from cachecraft.llm import LLM
from cachecraft.model.loader import LoadedModel, load_model
from cachecraft.model.shapes import SHAPES
from cachecraft.request import Chunk, RagRequest
from cachecraft.store.config import StoreConfig

WORDS = [
    "river",
    "mountain",
    "city",
    "engine",
    "harbor",
    "forest",
    "bridge",
    "tower",
    "market",
    "library",
    "garden",
    "station",
    "valley",
    "island",
    "castle",
    "museum",
    "canal",
    "desert",
    "meadow",
    "temple",
    "factory",
    "village",
    "lighthouse",
    "railway",
    "orchard",
    "glacier",
    "volcano",
    "monastery",
    "palace",
    "stadium",
    "quarry",
    "vineyard",
    "windmill",
]


def chunk_texts(loaded: LoadedModel, n: int, tokens: int, rng: random.Random) -> list[str]:
    """`n` texts of exactly `tokens` tokens each (made of words, cut at the token count)."""
    out = []
    for i in range(n):
        words = [f"Passage {i}."] + [rng.choice(WORDS) for _ in range(tokens)]
        ids = loaded.tokenizer(" ".join(words), add_special_tokens=False)["input_ids"][:tokens]
        out.append(loaded.tokenizer.decode(ids))
    return out


def session(
    texts: list[str], per_request: int, warm: int, measured: int, seed: int
) -> tuple[list[RagRequest], list[RagRequest]]:
    """Warm-up requests that cover every chunk, then measured ones in new orders."""
    rng = random.Random(seed)
    chunks = [Chunk(t, id=f"c{i}") for i, t in enumerate(texts)]

    def ask(i: int, picks: list[Chunk]) -> RagRequest:
        return RagRequest(f"Question {i}: which passage names a {rng.choice(WORDS)}?", picks)

    order = list(range(len(chunks)))
    warmup = []
    for i in range(warm):
        rng.shuffle(order)
        warmup.append(ask(i, [chunks[j] for j in order[:per_request]]))
    warmup += [
        ask(warm + k, chunks[k : k + per_request]) for k in range(0, len(chunks), per_request)
    ]
    return warmup, [ask(100 + i, rng.sample(chunks, per_request)) for i in range(measured)]


def time_mode(
    loaded: LoadedModel, mode: str, warmup: list[RagRequest], measured: list[RagRequest]
) -> dict[str, float]:
    """Median TTFT (ms), mean prompt tokens and computed fraction of `measured` in `mode`,
    after `warmup`; chunk-caches kept on the model's device, in its dtype when that is 16-bit."""
    dtype = str(loaded.model.dtype).removeprefix("torch.")
    store = StoreConfig(
        memory_bytes=16 << 30,
        device=str(loaded.model.device),
        storage_dtype="bfloat16" if dtype == "bfloat16" else "float16",
    )
    llm = LLM(loaded, store=store)
    one = SamplingParams(max_tokens=1)
    for request in warmup:
        llm.generate(request, one, mode)
    ttft, computed, prompt = [], [], []
    for request in measured:
        report = llm.generate(request, one, mode)[0].report
        ttft.append(report.ttft_ms)
        computed.append(report.computed_fraction)
        prompt.append(report.prompt_tokens)
    return {
        "ttft_ms_p50": round(statistics.median(ttft), 2),
        "ttft_ms_min": round(min(ttft), 2),
        "prompt_tokens": round(statistics.fmean(prompt)),
        "computed_fraction": round(statistics.fmean(computed), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--shape", default="bundled", choices=["bundled", *SHAPES])
    parser.add_argument("--modes", default="full,prefix,cachecraft")
    parser.add_argument("--chunks", type=int, default=5, help="chunks per request")
    parser.add_argument("--pool", type=int, default=10, help="distinct chunks in the session")
    parser.add_argument("--chunk-tokens", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=4, help="extra warm-up requests")
    parser.add_argument("--requests", type=int, default=12, help="measured requests")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    t0 = time.perf_counter()
    spec = None if args.shape == "bundled" else f"shape:{args.shape}"  # random weights
    loaded = load_model(spec, args.dtype, args.device)
    load_s = time.perf_counter() - t0
    rng = random.Random(args.seed)
    texts = chunk_texts(loaded, args.pool, args.chunk_tokens, rng)
    warmup, measured = session(texts, args.chunks, args.warmup, args.requests, args.seed)
    results = {m: time_mode(loaded, m, warmup, measured) for m in args.modes.split(",")}
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    out = {
        "device": name,
        "shape": args.shape,
        "dtype": args.dtype,
        "chunks": args.chunks,
        "chunk_tokens": args.chunk_tokens,
        "requests": args.requests,
        "load_s": round(load_s, 1),
        "modes": results,
    }
    full = results.get("full", {}).get("ttft_ms_p50")
    print(f"{name}, {args.shape} {args.dtype}, {args.chunks} x {args.chunk_tokens} tokens")
    for mode, r in results.items():
        ratio = f"  full/{mode} {full / r['ttft_ms_p50']:.2f}x" if full else ""
        print(
            f"  {mode:11s} TTFT p50 {r['ttft_ms_p50']:9.2f} ms  min {r['ttft_ms_min']:9.2f} ms"
            f"  computed {r['computed_fraction']:.3f}{ratio}"
        )
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
