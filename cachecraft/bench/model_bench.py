"""`cachecraft bench model`: our prefill vs HF transformers' forward, side by side in one run.

Also checks fidelity: max abs logit difference (fp32) and 32 greedy tokens vs HF `generate`.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from cachecraft.bench.memory import peak_rss
from cachecraft.engine.generate import decode
from cachecraft.engine.sampling import SamplingParams
from cachecraft.model.kv import KVCache
from cachecraft.model.loader import LoadedModel
from cachecraft.model.step import SeqWork


def _prompt_ids(m: LoadedModel, n: int) -> torch.Tensor:
    text = " ".join(
        f"Paragraph {i}: the cache of chunk {i} is reused at a new position in a new prompt."
        for i in range(n)
    )
    ids = m.tokenizer(text, add_special_tokens=False)["input_ids"][:n]
    return torch.tensor(ids)


def _ours_prefill(m: LoadedModel, ids: torch.Tensor) -> torch.Tensor:
    kv = KVCache(m.arch, len(ids), m.model.dtype, m.model.device)
    return m.model.forward_step([SeqWork(kv, ids, torch.arange(len(ids)))])[0].logits


def _time(fn: Any, repeats: int) -> tuple[float, int]:
    fn()  # warm-up
    times = []
    with peak_rss() as mem:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times), mem.peak_delta_bytes


def run_model_bench(
    m: LoadedModel, lengths: tuple[int, ...] = (512, 1024, 2048), repeats: int = 5
) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(m.source, dtype=torch.float32).eval()
    msgs = [{"role": "user", "content": "Explain in two sentences why caching helps."}]
    chat = torch.tensor(
        m.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False)
    )
    kv = KVCache(m.arch, len(chat) + 32, torch.float32, "cpu")
    ours = m.model.forward_step([SeqWork(kv, chat, torch.arange(len(chat)), logits_for="all")])[0]
    with torch.inference_mode():
        ref = hf(chat[None]).logits[0]
        ref_tokens = hf.generate(
            chat[None], max_new_tokens=32, min_new_tokens=32, do_sample=False, eos_token_id=None
        )[0, len(chat) :].tolist()
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    our_tokens = list(decode(m.model, kv, ours.logits[-1], params))

    rows = {}
    for n in lengths:
        ids = _prompt_ids(m, n)
        with torch.inference_mode():
            t_hf, mem_hf = _time(lambda ids=ids: hf(ids[None]).logits, repeats)
        t_ours, mem_ours = _time(lambda ids=ids: _ours_prefill(m, ids), repeats)
        rows[str(len(ids))] = {
            "ours_ms": round(1000 * t_ours, 1),
            "hf_ms": round(1000 * t_hf, 1),
            "speedup": round(t_hf / t_ours, 3),
            "ours_peak_mib": round(mem_ours / 2**20, 1),
            "hf_peak_mib": round(mem_hf / 2**20, 1),
        }
    return {
        "model": m.name,
        "threads": torch.get_num_threads(),
        "repeats": repeats,
        "max_abs_logit_diff": float((ours.logits - ref).abs().max()),
        "greedy_match": our_tokens == ref_tokens,
        "prefill_speedup_vs_hf": {k: v["speedup"] for k, v in rows.items()},
        "prefill": rows,
    }
