"""Quality and summary metrics: SQuAD-style F1/EM, gold contained in the answer, ROUGE-L, KL from logits, bootstrap CIs.

Pure functions over strings and arrays; no model, no I/O.
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Callable, Iterable
from functools import lru_cache
from typing import Any

import numpy as np
from rouge_score import rouge_scorer

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, drop punctuation and articles, squeeze whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _golds(golds: str | Iterable[str]) -> list[str]:
    return [golds] if isinstance(golds, str) else list(golds)


def _f1(pred: str, gold: str) -> float:
    p, g = normalize_answer(pred).split(), normalize_answer(gold).split()
    if not p or not g:
        return float(p == g)
    common = sum((Counter(p) & Counter(g)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(p), common / len(g)
    return 2 * precision * recall / (precision + recall)


def token_f1(pred: str, golds: str | Iterable[str]) -> float:
    """SQuAD token F1 of `pred`, the max over the gold answers (0.0 when there are none)."""
    return max((_f1(pred, g) for g in _golds(golds)), default=0.0)


def exact_match(pred: str, golds: str | Iterable[str]) -> float:
    """1.0 when `pred` equals one gold answer after normalisation, else 0.0."""
    norm = normalize_answer(pred)
    return float(any(norm == normalize_answer(g) for g in _golds(golds)))


def contains_answer(pred: str, golds: str | Iterable[str]) -> float:
    """1.0 when a gold answer, normalised, appears in the normalised `pred` as whole words (a
    chat model answers in sentences: F1 and EM punish the words around a right answer)."""
    text = f" {normalize_answer(pred)} "
    return float(any((g := normalize_answer(gold)) and f" {g} " in text for gold in _golds(golds)))


def jaccard(pred: str, ref: str) -> float:
    """Jaccard similarity of the normalised token sets (the paper's metric for short answers)."""
    a, b = set(normalize_answer(pred).split()), set(normalize_answer(ref).split())
    return 1.0 if not a and not b else len(a & b) / len(a | b)


@lru_cache(maxsize=1)
def _rouge() -> rouge_scorer.RougeScorer:
    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)


def rouge_l(pred: str, ref: str) -> float:
    """ROUGE-L F-measure (rouge-score, Porter stemmer); two empty texts score 1.0."""
    if not pred.strip() and not ref.strip():
        return 1.0
    return float(_rouge().score(ref, pred)["rougeL"].fmeasure)


def _as_float64(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor; bf16 has no numpy dtype, so upcast first
        import torch

        x = x.detach().to(torch.float64).cpu().numpy()
    return np.asarray(x, dtype=np.float64)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def kl_divergence(p_logits: Any, q_logits: Any) -> float:
    """KL(P || Q) in nats from logits over the last axis (P: the full-recompute reference, Q: the
    mode under test), averaged over any leading axes. Accepts torch tensors or numpy arrays."""
    p, q = _as_float64(p_logits), _as_float64(q_logits)
    if p.shape != q.shape:
        raise ValueError(f"logit shapes differ: {p.shape} vs {q.shape}")
    log_p, log_q = _log_softmax(p), _log_softmax(q)
    # p * (log p - log q) with p = 0 contributes 0, even where log q is -inf
    with np.errstate(invalid="ignore"):
        terms = np.where(log_p > -np.inf, np.exp(log_p) * (log_p - log_q), 0.0)
    kl = terms.sum(axis=-1)
    return float(max(np.mean(kl), 0.0))


def _clean(values: Iterable[float | None]) -> np.ndarray:
    vals = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    return np.asarray(vals, dtype=np.float64)


def bootstrap_ci(
    values: Iterable[float | None],
    n_boot: int = 1000,
    seed: int = 0,
    stat: Callable[[np.ndarray], float] = np.mean,
    level: float = 0.95,
) -> tuple[float, float]:
    """Percentile bootstrap confidence interval of `stat` (None/NaN values dropped; NaNs when
    nothing is left)."""
    vals = _clean(values)
    if vals.size == 0:
        return (math.nan, math.nan)
    rng = np.random.default_rng(seed)
    samples = vals[rng.integers(0, vals.size, size=(n_boot, vals.size))]
    stats = samples.mean(axis=1) if stat is np.mean else np.array([stat(s) for s in samples])
    tail = (1.0 - level) / 2 * 100
    lo, hi = np.percentile(stats, [tail, 100 - tail])
    return (float(lo), float(hi))


def summarize(values: Iterable[float | None], n_boot: int = 1000, seed: int = 0) -> dict:
    """{"mean", "ci95": [lo, hi], "n"} (JSON-ready; mean and bounds are None when n == 0)."""
    vals = _clean(values)
    if vals.size == 0:
        return {"mean": None, "ci95": [None, None], "n": 0}
    lo, hi = bootstrap_ci(vals, n_boot=n_boot, seed=seed)
    return {"mean": float(vals.mean()), "ci95": [lo, hi], "n": int(vals.size)}


def percentile(values: Iterable[float | None], q: float) -> float | None:
    """The q-th percentile (0-100, linear interpolation) or None when there are no values."""
    vals = _clean(values)
    return float(np.percentile(vals, q)) if vals.size else None


def p50(values: Iterable[float | None]) -> float | None:
    return percentile(values, 50)


def p95(values: Iterable[float | None]) -> float | None:
    return percentile(values, 95)
