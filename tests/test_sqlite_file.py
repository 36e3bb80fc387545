"""Opening one new SQLite file from several processes at the same instant (`open_shared`): two
replicas started on one empty cache directory. Real processes, real files."""

from __future__ import annotations

import multiprocessing as mp
import sqlite3
from pathlib import Path

import pytest

from cachecraft.store.sqlite_file import is_busy, open_shared

PROCESSES = 3
ROUNDS = 60
"""Without the retry about 7% of rounds of three processes saw one refused at once (measured
200 rounds, any busy timeout): 60 rounds pass on the old code with probability ~1%."""


def _setup(db: sqlite3.Connection) -> None:
    db.execute("CREATE TABLE IF NOT EXISTS chunks (key TEXT PRIMARY KEY, n INTEGER)")
    db.execute("CREATE TABLE IF NOT EXISTS pins (id TEXT PRIMARY KEY)")


def _open_and_write(path: str, start: mp.synchronize.Barrier, name: str) -> None:
    start.wait()
    db = open_shared(Path(path), 10.0, _setup)
    db.execute("INSERT INTO chunks VALUES (?, 1)", (name,))
    db.close()


def test_processes_opening_one_new_file_together_all_get_it(tmp_path: Path) -> None:
    ctx = mp.get_context("fork")
    for r in range(ROUNDS):
        path = tmp_path / f"round{r}.sqlite"
        start = ctx.Barrier(PROCESSES)
        procs = [
            ctx.Process(target=_open_and_write, args=(str(path), start, f"p{i}"))
            for i in range(PROCESSES)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        assert [p.exitcode for p in procs] == [0] * PROCESSES, f"round {r}"
        with sqlite3.connect(path) as db:
            assert db.execute("SELECT COUNT(*) FROM chunks").fetchone() == (PROCESSES,)
            assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)


def test_a_lock_held_past_the_wait_and_other_errors_still_raise(tmp_path: Path) -> None:
    path = tmp_path / "held.sqlite"
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    other.execute("CREATE TABLE t (x)")
    with pytest.raises(sqlite3.OperationalError) as refused:
        open_shared(path, 0.3, _setup)
    assert is_busy(refused.value)
    other.execute("ROLLBACK")
    other.close()

    def broken(db: sqlite3.Connection) -> None:
        db.execute("CREATE TABLE chunks (")

    with pytest.raises(sqlite3.OperationalError) as bad:
        open_shared(path, 5.0, broken)
    assert not is_busy(bad.value)
