"""Hand-computed checks of the bench metrics (F1/EM/ROUGE-L/KL/bootstrap/percentiles)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from cachecraft_bench.metrics import (
    bootstrap_ci,
    contains_answer,
    exact_match,
    jaccard,
    kl_divergence,
    normalize_answer,
    p50,
    p95,
    rouge_l,
    summarize,
    token_f1,
)


def test_normalize_answer_drops_articles_punctuation_case():
    assert normalize_answer("The  Eiffel-Tower, in Paris!") == "eiffeltower in paris"
    assert normalize_answer("An apple a day") == "apple day"


def test_token_f1_partial_overlap_by_hand():
    # pred tokens {barack, obama, was, president}, gold {barack, obama}: P = 2/4, R = 2/2
    assert token_f1("Barack Obama was president", "Barack Obama") == pytest.approx(2 / 3)
    # max over golds
    assert token_f1("Paris", ["London", "paris."]) == 1.0
    assert token_f1("x", []) == 0.0
    assert token_f1("", "") == 1.0
    assert token_f1("the", "a") == 1.0  # both normalise to empty


def test_exact_match_normalises():
    assert exact_match("The Beatles!", ["beatles"]) == 1.0
    assert exact_match("Beatles band", "The Beatles") == 0.0


def test_contains_answer_whole_words_after_normalising():
    answer = "The lighthouse was designed by Meljor Lumra, and it opened in 1933."
    assert contains_answer(answer, ["meljor lumra"]) == 1.0
    assert contains_answer(answer, ["Tasvik", "1933"]) == 1.0  # any gold answer
    assert contains_answer(answer, ["Lum"]) == 0.0  # part of a word is not the answer
    assert contains_answer(answer, ["Tasvik"]) == 0.0
    assert contains_answer(answer, [""]) == 0.0  # an empty gold is never contained


def test_jaccard():
    assert jaccard("red green blue", "green blue yellow") == pytest.approx(2 / 4)


def test_rouge_l_known_pair():
    # stemmed: pred [the, cat, are, run], ref [a, cat, run]; LCS = [cat, run] -> P 2/4, R 2/3
    expected = 2 * (0.5 * 2 / 3) / (0.5 + 2 / 3)
    assert rouge_l("the cats are running", "a cat runs") == pytest.approx(expected)
    assert rouge_l("", "") == 1.0
    assert rouge_l("something", "") == 0.0
    assert rouge_l("same words here", "same words here") == pytest.approx(1.0)


def test_kl_identical_is_zero_and_two_class_by_hand():
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.5, -1.0, 4.0]])
    assert kl_divergence(logits, logits.clone()) == pytest.approx(0.0, abs=1e-12)
    # P = (0.5, 0.5) from equal logits, Q = (0.8, 0.2) from logits (log 4, 0)
    p, q = np.array([0.0, 0.0]), np.array([math.log(4.0), 0.0])
    expected = 0.5 * math.log(0.5 / 0.8) + 0.5 * math.log(0.5 / 0.2)
    assert kl_divergence(p, q) == pytest.approx(expected)
    # large logits stay finite; bf16 tensors are accepted
    big = torch.tensor([1000.0, 0.0], dtype=torch.bfloat16)
    assert math.isfinite(kl_divergence(big, torch.tensor([0.0, 1000.0])))
    with pytest.raises(ValueError):
        kl_divergence(np.zeros(3), np.zeros(4))


def test_kl_with_masked_logits():
    p = np.array([0.0, -np.inf, 0.0])
    assert kl_divergence(p, np.array([0.0, 0.0, 0.0])) == pytest.approx(math.log(3 / 2))


def test_bootstrap_ci_contains_mean_and_narrows_with_n():
    rng = np.random.default_rng(1)
    small = rng.normal(0.5, 0.2, size=20)
    large = rng.normal(0.5, 0.2, size=2000)
    lo_s, hi_s = bootstrap_ci(small)
    lo_l, hi_l = bootstrap_ci(large)
    assert lo_s <= small.mean() <= hi_s
    assert lo_l <= large.mean() <= hi_l
    assert hi_l - lo_l < (hi_s - lo_s) / 4
    assert bootstrap_ci(small, seed=3) == bootstrap_ci(small, seed=3)
    lo, hi = bootstrap_ci(small, stat=np.median)
    assert lo <= np.median(small) <= hi


def test_summarize_and_percentiles():
    s = summarize([1.0, 2.0, None, 3.0, float("nan")])
    assert s["n"] == 3 and s["mean"] == pytest.approx(2.0)
    assert s["ci95"][0] <= 2.0 <= s["ci95"][1]
    assert summarize([]) == {"mean": None, "ci95": [None, None], "n": 0}
    assert all(math.isnan(v) for v in bootstrap_ci([]))
    values = list(range(1, 101))
    assert p50(values) == pytest.approx(50.5)
    assert p95(values) == pytest.approx(95.05)
    assert p50([]) is None
