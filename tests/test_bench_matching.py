"""How a baseline gets cachecraft's budget: scaling per-chunk budgets to a total, EPIC's one k,
and the FLOPs search over a made-up arm whose FLOPs grow with its budget."""

from __future__ import annotations

import pytest

from cachecraft_bench.matching import scaled, uniform, uniform_k


def test_scaled_budgets_add_up_within_each_chunk() -> None:
    budgets, sizes = [None, 2, 6, 0], [10, 4, 8, 5]
    for total in range(0, 18):
        out = scaled(budgets, sizes, total)
        assert out[0] is None
        assert sum(b for b in out if b is not None) == min(total, 17)
        assert all(b is None or 0 <= b <= n for b, n in zip(out, sizes, strict=True))
    assert scaled(budgets, sizes, 4) == [None, 1, 3, 0]  # in proportion to the budgets
    assert scaled([None, 0, 0], [3, 2, 6], 4) == [None, 1, 3]  # all 0: to the sizes
    assert scaled([1, 1], [2, 2], 99) == [2, 2]  # never past a chunk


def test_epics_one_k_for_every_chunk() -> None:
    budgets, sizes = [None, 5, 1, 3], [10, 8, 2, 20]
    assert uniform_k(budgets, sizes, 9) == 3  # 3 + 2 + 3 = 8 and 4 + 2 + 4 = 10: the smaller
    assert uniform_k(budgets, sizes, 0) == 0
    assert uniform_k(budgets, sizes, 1000) == 20  # every reused token
    assert uniform(budgets, sizes, 4) == [None, 4, 2, 4]


@pytest.mark.parametrize("target", [3, 10, 11])
def test_uniform_k_is_the_closest(target: int) -> None:
    budgets, sizes = [1, 1, 1], [2, 5, 9]
    k = uniform_k(budgets, sizes, target)
    best = min(abs(sum(min(j, n) for n in sizes) - target) for j in range(10))
    assert abs(sum(min(k, n) for n in sizes) - target) == best
