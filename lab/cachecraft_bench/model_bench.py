"""`cachecraft bench model`: our prefill vs HF transformers' forward, side by side in one run.

Fair to transformers: both sides compute the logits of the last position only (HF with
`logits_to_keep=1`, as ours does; all n rows would cost HF an n x vocab LM head and a logits
tensor that dominated its peak memory), in the same dtype (HF loaded in ours), and peak memory
is measured the same way for both (`peak_prefill_bytes`, one fresh subprocess each).

Also checks fidelity: max abs logit difference (fp32) and 32 greedy tokens vs HF `generate`,
and the miss path: time to first token of a 5-chunk RAG request whose chunks all miss, in
`cachecraft` and `prefix` mode over `full` (what statistics and bookkeeping cost a miss).
Peak memory of one prefill is measured in a fresh subprocess per (implementation, length), so
neither side inherits the other's freed allocations: `python -m cachecraft_bench.model_bench`.
"""

from __future__ import annotations

import gc
import json
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

from cachecraft.api import (
    LLM,
    LoadedModel,
    SamplingParams,
    greedy_tokens,
    load_model,
    memory_config,
    prefill,
)
from cachecraft.request import Chunk, RagRequest

MISS_MODES = ("full", "prefix", "cachecraft")


def _prompt_ids(m: LoadedModel, n: int) -> torch.Tensor:
    text = " ".join(
        f"Paragraph {i}: the cache of chunk {i} is reused at a new position in a new prompt."
        for i in range(n)
    )
    ids = m.tokenizer(text, add_special_tokens=False)["input_ids"][:n]
    return torch.tensor(ids)


def _ours_prefill(m: LoadedModel, ids: torch.Tensor) -> torch.Tensor:
    return prefill(m, ids)[0]


def load_hf(m: LoadedModel) -> Any:
    """HF transformers' model of `m`'s weights, in `m`'s dtype, for inference."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(m.source, dtype=m.model.dtype).eval()


def hf_prefill(hf: Any, ids: torch.Tensor) -> torch.Tensor:
    """HF's forward over `ids` [n], the logits of the last position only: [1, 1, vocab]."""
    with torch.inference_mode():
        return hf(ids[None], logits_to_keep=1).logits


def _time(fn: Any, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _status_kib(field: str) -> int | None:
    """A `VmRSS`/`VmHWM`-style line of /proc/self/status in KiB (None off Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS; False where unsupported.
    Without it the peak of one prefill hides under the model load's (ru_maxrss never falls:
    loading and dequantizing the GGUF peaks far above a prefill, so the growth read 0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_since(run: Any) -> int:
    """Peak RSS growth in bytes while `run()` runs, over the RSS just before it."""
    gc.collect()
    base = _status_kib("VmRSS")
    if base is not None and _reset_peak_rss():
        run()
        peak = _status_kib("VmHWM")
        assert peak is not None
        return max(0, peak - base) * 1024
    # fallback: sample RSS on a thread every millisecond (misses sub-millisecond spikes)
    import threading

    page = resource.getpagesize()

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page

    start, top, done = rss(), [0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            top[0] = max(top[0], rss())
            done.wait(0.001)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        run()
    finally:
        done.set()
        watcher.join()
    return max(0, max(top[0], rss()) - start)


def peak_prefill_bytes(kind: str, n: int, spec: str | None = None) -> int:
    """Peak RSS growth of one prefill of n tokens (`ours` or `hf`) over the RSS just before it,
    after the model loaded and one short warm-up prefill (one-time library and allocator
    set-up is not counted)."""
    m = load_model(spec)
    ids, warm = _prompt_ids(m, n), _prompt_ids(m, 32)
    if kind == "hf":
        hf = load_hf(m)
        del m.model  # only HF's weights stay resident

        def run(x: torch.Tensor) -> None:
            hf_prefill(hf, x)
    else:

        def run(x: torch.Tensor) -> None:
            _ours_prefill(m, x)

    run(warm)
    return _peak_since(lambda: run(ids))


def _peak_in_subprocess(kind: str, n: int, spec: str | None) -> int | None:
    cmd = [sys.executable, "-m", "cachecraft_bench.model_bench", kind, str(n)]
    cmd += [spec] if spec else []
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        return None
    return int(json.loads(done.stdout.strip().splitlines()[-1])["peak_bytes"])


def _miss_request(m: LoadedModel, seed: int, chunk_tokens: int) -> RagRequest:
    """Five chunks of about `chunk_tokens` tokens no store has seen (new words per seed)."""
    chunks = []
    for c in range(5):
        words = " ".join(
            f"Record {seed}.{c}.{i} says the value {seed * 7 + c * 3 + i} was logged."
            for i in range(chunk_tokens)
        )
        ids = m.tokenizer(words, add_special_tokens=False)["input_ids"][:chunk_tokens]
        chunks.append(Chunk(m.tokenizer.decode(ids), id=f"r{seed}-{c}"))
    return RagRequest("Which value was logged first?", chunks)


def miss_ttft(m: LoadedModel, repeats: int = 5, chunk_tokens: int = 200) -> dict[str, Any]:
    """Median TTFT (plan, KV assembly, prefill, first token, as the engine reports it; commit
    excluded as the engine does it after the token went out) per mode, each run on a fresh LLM
    and store (nothing cached: not the chunks, not the system prefix), modes interleaved
    request by request in a rotating order (no mode always runs first after a new request's
    text).

    miss_ttft_ratio is paired: per request, the mode's TTFT over `full`'s on the same request
    (run back to back), median over requests. On a shared machine the load drifts between
    requests; the pairs cancel that drift, which a ratio of the per-mode medians does not
    (on a run here those medians put `prefix` at 0.81x `full`, and `prefix` computes exactly
    what `full` does). The ratio of the medians is reported beside it."""
    one_token = SamplingParams(max_tokens=1)

    def once(request: RagRequest, mode: str) -> float:
        # memory_config admits everything: statistics are collected
        llm = LLM(m, store=memory_config(1 << 30))
        return llm.generate(request, one_token, mode)[0].report.ttft_ms / 1000

    once(_miss_request(m, -1, 32), "cachecraft")  # warm-up
    times: dict[str, list[float]] = {mode: [] for mode in MISS_MODES}
    for r in range(repeats):
        request = _miss_request(m, r, chunk_tokens)
        for i in range(len(MISS_MODES)):
            mode = MISS_MODES[(r + i) % len(MISS_MODES)]
            times[mode].append(once(request, mode))
    ms = {mode: round(1000 * statistics.median(t), 1) for mode, t in times.items()}

    def paired(mode: str) -> float:
        ratios = [a / b for a, b in zip(times[mode], times["full"], strict=True)]
        return round(statistics.median(ratios), 3)

    return {
        "ttft_ms": ms,
        "miss_ttft_ratio": {
            "cachecraft_over_full": paired("cachecraft"),
            "prefix_over_full": paired("prefix"),
        },
        "miss_ttft_ratio_of_medians": {
            "cachecraft_over_full": round(ms["cachecraft"] / ms["full"], 3),
            "prefix_over_full": round(ms["prefix"] / ms["full"], 3),
        },
    }


def run_model_bench(
    m: LoadedModel, lengths: tuple[int, ...] = (512, 1024, 2048), repeats: int = 5
) -> dict[str, Any]:
    hf = load_hf(m)
    msgs = [{"role": "user", "content": "Explain in two sentences why caching helps."}]
    chat = torch.tensor(
        m.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False)
    )
    ours_logits, kv = prefill(m, chat, extra_capacity=32, all_logits=True)
    with torch.inference_mode():
        ref = hf(chat[None]).logits[0]
        ref_tokens = hf.generate(
            chat[None], max_new_tokens=32, min_new_tokens=32, do_sample=False, eos_token_id=None
        )[0, len(chat) :].tolist()
    our_tokens = greedy_tokens(m, kv, ours_logits[-1], 32)

    rows = {}
    for n in lengths:
        ids = _prompt_ids(m, n)
        t_hf = _time(lambda ids=ids: hf_prefill(hf, ids), repeats)
        t_ours = _time(lambda ids=ids: _ours_prefill(m, ids), repeats)
        spec = None if m.name == "SmolLM2-135M-Instruct" else str(m.source)
        mem_ours = _peak_in_subprocess("ours", n, spec)
        mem_hf = _peak_in_subprocess("hf", n, spec)
        rows[str(len(ids))] = {
            "ours_ms": round(1000 * t_ours, 1),
            "hf_ms": round(1000 * t_hf, 1),
            "speedup": round(t_hf / t_ours, 3),
            "ours_peak_mib": None if mem_ours is None else round(mem_ours / 2**20, 1),
            "hf_peak_mib": None if mem_hf is None else round(mem_hf / 2**20, 1),
        }
    miss = miss_ttft(m, repeats)
    return {
        "model": m.name,
        "dtype": str(m.model.dtype).removeprefix("torch."),
        "hf_logits": "last position only (logits_to_keep=1), as ours",
        "threads": torch.get_num_threads(),
        "repeats": repeats,
        "miss_ttft_ms": miss["ttft_ms"],
        "miss_ttft_ratio": miss["miss_ttft_ratio"],
        "miss_ttft_ratio_of_medians": miss["miss_ttft_ratio_of_medians"],
        "max_abs_logit_diff": float((ours_logits - ref).abs().max()),
        "greedy_match": our_tokens == ref_tokens,
        "prefill_speedup_vs_hf": {k: v["speedup"] for k, v in rows.items()},
        "prefill": rows,
    }


if __name__ == "__main__":
    _kind, _n = sys.argv[1], int(sys.argv[2])
    _spec = sys.argv[3] if len(sys.argv) > 3 else None
    print(json.dumps({"peak_bytes": peak_prefill_bytes(_kind, _n, _spec)}))
