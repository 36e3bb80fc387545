"""Whether `bench serve`'s answers are right: each system's answer to each measured request
against a full prefill's answer to the same request (greedy, the same output length), as
token agreement and exact-match rate. Owns the comparison; the full answers come from the
caller (our server replaying the requests in `full` mode after the measured runs).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from cachecraft_bench.item import WorkloadItem

DEFAULT_MAX_CHECKED = 64
"""Distinct prompts answered in full for the check (about a minute of full prefills here)."""

Answers = list[tuple[str, str]]
"""(request id, answer text) of every measured request of one system, in the order served."""


def token_agreement(ids: Sequence[int], ref: Sequence[int]) -> float:
    """The share of positions where two token sequences agree, over the longer one (1.0 for
    two empty ones): a different length counts every missing position as a disagreement."""
    longest = max(len(ids), len(ref))
    if longest == 0:
        return 1.0
    return sum(a == b for a, b in zip(ids, ref, strict=False)) / longest


def agreement_vs_full(
    answers: Mapping[str, Answers],
    full: Mapping[str, str],
    tokenize: Callable[[str], Sequence[int]],
) -> dict[str, Any]:
    """Per system: `exact_match_rate` (answers whose text equals full's), mean
    `token_agreement`, `num_answers` compared, and `per_request` [{id, exact, token_agreement}];
    requests with no full answer are left out (counted as `num_unchecked`)."""
    out: dict[str, Any] = {}
    for system, served in answers.items():
        records = []
        for request_id, text in served:
            ref = full.get(request_id)
            if ref is None:
                continue
            agree = token_agreement(list(tokenize(text)), list(tokenize(ref)))
            records.append(
                {"id": request_id, "exact": text == ref, "token_agreement": round(agree, 4)}
            )
        n = len(records)
        out[system] = {
            "num_answers": n,
            "num_unchecked": len(served) - n,
            "exact_match_rate": round(sum(r["exact"] for r in records) / n, 4) if n else None,
            "token_agreement": (
                round(sum(r["token_agreement"] for r in records) / n, 4) if n else None
            ),
            "per_request": records,
        }
    return out


def check_answers(
    answers: Mapping[str, Answers],
    replay_full: Callable[[list[WorkloadItem]], dict[str, str]],
    measured: Sequence[WorkloadItem],
    model_dir: str | Path | None = None,
    progress: Callable[[str], None] | None = None,
    max_checked: int = DEFAULT_MAX_CHECKED,
) -> dict[str, Any]:
    """The first `max_checked` distinct prompts among the measured requests (in stream
    order; requests with the same prompt share one full answer) once through `replay_full`
    (a full prefill each), then `agreement_vs_full` with the model's tokenizer (`model_dir`,
    else the bundled one) over every measured answer to those prompts."""
    from transformers import AutoTokenizer

    from cachecraft.api import resolve_model_dir

    first: dict[Any, WorkloadItem] = {}
    for it in measured:
        if it.request not in first and len(first) < max_checked:
            first[it.request] = it
    if progress is not None:
        progress(f"answering {len(first)} distinct prompts in full mode for the answer check")
    full = replay_full(list(first.values()))
    by_id = {
        it.id: full[first[it.request].id]
        for it in measured
        if it.request in first and first[it.request].id in full
    }
    tokenizer = AutoTokenizer.from_pretrained(model_dir or resolve_model_dir(None))

    def tokenize(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    return agreement_vs_full(answers, by_id, tokenize)
