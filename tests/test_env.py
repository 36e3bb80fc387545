"""Process settings: OpenMP waiting and glibc's allocator, each leaving the user's choice alone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from cachecraft import env


def test_passive_openmp_sets_defaults_but_keeps_user_values(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setenv("GOMP_SPINCOUNT", "7")
    env.set_passive_openmp()
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    assert os.environ["GOMP_SPINCOUNT"] == "7"


def test_allocator_left_alone_when_the_user_tuned_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert env.tune_allocator() is False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt is Linux-only")
def test_allocator_tuned_in_a_fresh_process() -> None:
    """In a process of its own (the setting is process-wide): mallopt accepts both values,
    and a large tensor still allocates and computes."""
    code = (
        "from cachecraft import env; import torch; "
        "ok = env.tune_allocator(); x = torch.ones(1 << 20) * 2; "
        "print(ok, float(x.sum()))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={}
    ).stdout.split()
    assert out == ["True", str(float(2 << 20))]
