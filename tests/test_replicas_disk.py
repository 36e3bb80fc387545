"""Two live `cachecraft serve` processes on one machine sharing one --cache-dir and no Redis: a
chunk computed through one is a hit through the other, with the answer of a full prefill; the
doorkeeper's sightings and the hit statistics live once, in the SQLite files beside the disk
tier (`tally.sqlite`, `index.sqlite`), and both processes count into the same rows."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import make_tiny_dir
from test_replicas import DOC, OTHER, Replica, _hits, _text


@pytest.fixture
def disk_replicas(tmp_path: Path) -> Iterator[tuple[Replica, Replica, Path]]:
    model = make_tiny_dir(tmp_path / "model")
    shared = tmp_path / "shared-cache"
    pair = (
        Replica("a", model, tmp_path, None, cache_dir=shared),
        Replica("b", model, tmp_path, None, cache_dir=shared),
    )
    try:
        for r in pair:
            r.wait_ready()
        yield (*pair, shared)
    finally:
        for r in pair:
            r.stop()


def _row(db: Path, sql: str, *args: object) -> tuple | None:
    with sqlite3.connect(db, timeout=30) as conn:
        return conn.execute(sql, args).fetchone()


def _chunk_key(out: dict) -> str:
    return out["usage"]["cachecraft"]["chunks"][0]["key"]


def test_two_replicas_share_one_disk_directory(
    disk_replicas: tuple[Replica, Replica, Path],
) -> None:
    a, b, shared = disk_replicas
    tally = shared / "tally.sqlite"
    full = _text(a.ask([DOC], mode="full"))
    first = a.ask([DOC])  # sighting 1 of the chunk: the doorkeeper refuses it
    assert _hits(first) == [False]
    key = _chunk_key(first)
    second = b.ask([DOC])  # sighting 2, counted by the other process: admitted, to disk
    assert _hits(second) == [False]
    assert _row(tally, "SELECT count FROM sightings WHERE chunk_key=?", key) == (2,)
    third = a.ask([DOC])  # computed through b, a hit through a (read from the shared disk)
    assert _hits(third) == [True]
    fourth = b.ask([DOC])  # and a hit through b
    assert _hits(fourth) == [True]
    assert _text(first) == _text(second) == _text(third) == _text(fourth) == full

    # one variant, one row of hit statistics, with the hits of both processes
    variant_id = third["usage"]["cachecraft"]["chunks"][0]["variant_id"]
    assert fourth["usage"]["cachecraft"]["chunks"][0]["variant_id"] == variant_id
    assert _row(tally, "SELECT COUNT(*) FROM hit_stats WHERE chunk_key=?", key) == (1,)
    assert _row(tally, "SELECT hits FROM hit_stats WHERE variant_id=?", variant_id) == (2,)
    # the hits are no new sightings: still 2, counted once across both processes
    assert _row(tally, "SELECT count FROM sightings WHERE chunk_key=?", key) == (2,)

    # each process goes on with work of its own on the same directory
    for r in (a, b):
        out = r.ask([OTHER])
        assert _hits(out) == [False] and _text(out)
        health = r.health()
        assert health["status"] == "ok" and health["tiers"]["disk"]["is_reachable"] is True
        assert "redis" not in health["tiers"]
    other_key = _chunk_key(out)
    assert _row(tally, "SELECT count FROM sightings WHERE chunk_key=?", other_key) == (2,)


def test_concurrent_requests_on_both_replicas_share_the_files_cleanly(
    disk_replicas: tuple[Replica, Replica, Path],
) -> None:
    """Both processes write the shared index and tally at once: every request answers, and
    neither process ever found a file locked or fell back to counting alone."""
    a, b, shared = disk_replicas
    docs = [
        {"id": f"d{i}", "text": f"Fact {i}: the river number {i} flows {i} miles."}
        for i in range(4)
    ]
    jobs = [(r, [docs[i % 4], docs[(i + 1) % 4]]) for i in range(12) for r in (a, b)]
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda job: job[0].ask(job[1]), jobs))
    assert all(_text(o) for o in outs)
    assert any(any(_hits(o)) for o in outs)  # chunk-caches stored on the shared disk were reused
    for r in (a, b):
        log = r.log.read_text()
        assert "locked" not in log and "unusable" not in log and "Traceback" not in log
    rows = _row(shared / "tally.sqlite", "SELECT COUNT(*), MIN(count) FROM sightings")
    assert rows is not None and rows[0] == 4 and rows[1] >= 2
