"""Process settings: OpenMP waiting and glibc's allocator, each leaving the user's choice alone;
one OpenMP team computes."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from cachecraft import env
from cachecraft.api import EngineConfig, LoadedModel, build_stack, close_stack


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


_COUNT_TEAMS = """
import os, sys, torch
from cachecraft.model.loader import load_model

def threads():
    return len(os.listdir("/proc/self/task"))

torch.set_num_threads(2)
base = threads()
load_model(sys.argv[1])
after_load = threads()
count = torch.get_num_threads()
torch.ones(1 << 22).mul_(2)  # large enough for a parallel region: its second thread appears
print(base, after_load, count, threads())
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_loading_starts_no_openmp_team(tiny_dir: Path) -> None:
    """In a process of its own: loading the model on a 2-thread thread leaves no OpenMP worker
    behind, the thread's count is restored, and its first parallel product does start a
    worker (so the count would see one)."""
    out = subprocess.run(
        [sys.executable, "-c", _COUNT_TEAMS, str(tiny_dir)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": "2"},
    ).stdout.split()
    base, after_load, count, after_product = map(int, out)
    assert after_load == base
    assert count == 2
    assert after_product == base + 1


def test_engine_step_thread_keeps_its_creators_thread_count(tiny: LoadedModel) -> None:
    """Another thread lowering torch's count lowers the count new threads start with; the
    engine's step thread still runs with the count of the thread that made the engine."""
    want = torch.get_num_threads()
    helper = threading.Thread(target=torch.set_num_threads, args=(1,))
    helper.start()
    helper.join()
    try:
        stack = build_stack("full", loaded=tiny, engine=EngineConfig(mode="full"))
        try:
            got = stack.engine.call(torch.get_num_threads).result(timeout=60)
        finally:
            close_stack(stack)
    finally:
        torch.set_num_threads(want)  # the count new threads start with, for later tests
    assert got == want == stack.engine.num_threads


def test_a_child_gets_our_tuning_or_none_of_it() -> None:
    base = {"PATH": "/bin", "OMP_WAIT_POLICY": "ACTIVE", "MALLOC_TRIM_THRESHOLD_": "5"}
    tuned = env.tuned_child_env(base, True)
    assert tuned["OMP_WAIT_POLICY"] == "PASSIVE" and tuned["GOMP_SPINCOUNT"] == str(env.SPIN_COUNT)
    assert tuned["MALLOC_MMAP_THRESHOLD_"] == str(env.MMAP_THRESHOLD)
    assert tuned["MALLOC_TRIM_THRESHOLD_"] == str(env.TRIM_THRESHOLD)
    bare = env.tuned_child_env(base, False)
    assert bare == {"PATH": "/bin", "CACHECRAFT_TUNING": "off"}


def test_tuning_off_leaves_openmp_and_the_allocator_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHECRAFT_TUNING", "off")
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    env.set_passive_openmp()
    assert "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ
    assert env.tune_allocator() is False
