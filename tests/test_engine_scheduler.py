"""Scheduler scenarios (torch-free, microseconds): budget, cap, FCFS, abort, backpressure."""

from __future__ import annotations

import pytest

from cachecraft.engine.request import SeqState, Status
from cachecraft.engine.scheduler import QueueFull, Scheduler


def seq(rid: str, rows: int, max_tokens: int = 4) -> SeqState:
    return SeqState(rid, num_prompt_tokens=rows, num_prefill_rows=rows, max_tokens=max_tokens)


def step(s: Scheduler) -> tuple[list[str], list[str]]:
    out = s.schedule()
    for rid in out.prefill_ids:
        s.prefilled(rid)
    s.check_integrity()
    return out.prefill_ids, out.decode_ids


def test_budget_counts_prefill_rows_and_one_per_decode() -> None:
    s = Scheduler(token_budget=10, max_running=4, max_queue=8)
    for rid, rows in (("a", 6), ("b", 4), ("c", 3)):
        s.add(seq(rid, rows))
    assert step(s) == (["a", "b"], [])  # 6 + 4 = 10; c waits
    # two decodes leave 8 rows: c (3) fits now
    assert step(s) == (["c"], ["a", "b"])
    assert step(s) == ([], ["a", "b", "c"])


def test_fcfs_never_skips_the_head() -> None:
    s = Scheduler(token_budget=10, max_running=4, max_queue=8)
    s.add(seq("big", 8))
    s.add(seq("a", 1))
    assert step(s) == (["big", "a"], [])
    s.add(seq("next", 9))  # 2 decodes leave 8: the head does not fit
    s.add(seq("small", 1))  # ... and the small one behind it must wait too
    assert step(s) == ([], ["big", "a"])
    s.finish("a", "stop")
    assert step(s) == (["next"], ["big"])
    assert s.num_waiting == 1


def test_oversized_request_runs_alone() -> None:
    s = Scheduler(token_budget=8, max_running=4, max_queue=8)
    s.add(seq("huge", 50))
    s.add(seq("a", 2))
    assert step(s) == (["huge"], [])  # over budget, but alone in its step: no starvation
    assert step(s) == (["a"], ["huge"])


def test_oversized_request_waits_behind_other_prefills() -> None:
    s = Scheduler(token_budget=8, max_running=4, max_queue=8)
    s.add(seq("a", 2))
    s.add(seq("huge", 50))
    assert step(s) == (["a"], [])
    assert step(s) == (["huge"], ["a"])


def test_running_cap() -> None:
    s = Scheduler(token_budget=100, max_running=2, max_queue=8)
    for rid in "abc":
        s.add(seq(rid, 1))
    assert step(s) == (["a", "b"], [])
    assert step(s) == ([], ["a", "b"])
    assert s.finish("b", "length") is not None
    assert step(s) == (["c"], ["a"])


def test_abort_waiting_and_running() -> None:
    s = Scheduler(token_budget=100, max_running=1, max_queue=8)
    s.add(seq("a", 1))
    s.add(seq("b", 1))
    s.add(seq("c", 1))
    assert step(s) == (["a"], [])
    aborted = s.abort("b")
    assert aborted is not None and aborted.status is Status.ABORTED
    assert s.abort("a") is not None
    assert s.abort("nope") is None
    assert step(s) == (["c"], [])
    assert s.num_running == 1 and s.num_waiting == 0


def test_backpressure() -> None:
    s = Scheduler(token_budget=4, max_running=1, max_queue=2)
    s.add(seq("a", 1))
    s.add(seq("b", 1))
    with pytest.raises(QueueFull):
        s.add(seq("c", 1))
    step(s)  # a leaves the queue
    s.add(seq("c", 1))
    assert s.num_waiting == 2


def test_finish_records_reason_and_bad_config() -> None:
    s = Scheduler(token_budget=4, max_running=1, max_queue=2)
    s.add(seq("a", 1))
    step(s)
    done = s.finish("a", "stop")
    assert done is not None and done.finish_reason == "stop" and done.is_finished
    assert not s.has_work()
    with pytest.raises(ValueError):
        Scheduler(token_budget=2, max_running=4)


def test_a_splittable_prefill_runs_in_pieces_beside_the_decodes() -> None:
    s = Scheduler(token_budget=10, max_running=4, max_queue=8)
    s.add(seq("a", 3))
    assert step(s) == (["a"], [])
    long = seq("long", 25)
    long.can_split = True
    s.add(long)
    done = []
    for _ in range(3):  # the decode of a goes on while long's prefill advances 9 rows a step
        out = s.schedule()
        assert out.decode_ids == ["a"]
        if out.prefill_ids:
            assert out.prefill_ids == ["long"]
            long.num_done_rows += out.prefill_rows[0]
            done.append(out.prefill_rows[0])
            if long.num_rows_left == 0:
                s.prefilled("long")
        s.check_integrity()
    assert done == [9, 9, 7]
    assert s.schedule().decode_ids == ["a", "long"]


def test_prefills_under_way_go_before_new_ones() -> None:
    s = Scheduler(token_budget=10, max_running=4, max_queue=8)
    first = seq("first", 14)
    first.can_split = True
    s.add(first)
    out = s.schedule()
    assert (out.prefill_ids, out.prefill_rows) == (["first"], [10])
    first.num_done_rows = 10
    s.add(seq("next", 5))  # not splittable: waits until 5 rows are left in a step
    out = s.schedule()
    assert (out.prefill_ids, out.prefill_rows) == (["first", "next"], [4, 5])


def test_no_splitting_when_the_scheduler_is_told_not_to() -> None:
    s = Scheduler(token_budget=10, max_running=4, max_queue=8, split_prefills=False)
    big = seq("big", 25)
    big.can_split = True
    s.add(big)
    out = s.schedule()  # oversize and alone: the whole prefill in one step, as before
    assert (out.prefill_ids, out.prefill_rows) == (["big"], [25])


def test_postpone_puts_a_started_request_back_at_the_head() -> None:
    s = Scheduler(token_budget=10, max_running=4, max_queue=8)
    for rid in ("a", "b", "c"):
        s.add(seq(rid, 3))
    out = s.schedule()
    assert out.prefill_ids == ["a", "b", "c"]
    s.postpone("c")
    s.postpone("b")  # the engine postpones in reverse: the queue keeps their order
    s.prefilled("a")
    s.check_integrity()
    assert [x.request_id for x in s.waiting] == ["b", "c"]
    assert [x.request_id for x in s.running] == ["a"]
    assert step(s) == (["b", "c"], ["a"])
    with pytest.raises(ValueError, match="started"):
        s.postpone("a")  # decoding
    with pytest.raises(KeyError):
        s.postpone("nobody")
