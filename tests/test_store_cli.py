"""`cachecraft chunks ls|stats|rm|clear` over a disk store directory."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from store_helpers import make_variant

from cachecraft.errors import StoreUnavailableError
from cachecraft.store.cli import add_chunks_parser, chunks_command
from cachecraft.store.config import StoreConfig
from cachecraft.store.store import TieredStore


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    parser = argparse.ArgumentParser()
    add_chunks_parser(parser.add_subparsers())
    args = parser.parse_args(argv)
    assert args.func(args) == 0
    return capsys.readouterr().out


@pytest.fixture
def cache_dir(tmp_path: Path) -> str:
    store = TieredStore(StoreConfig(cache_dir=str(tmp_path), doorkeeper_threshold=1))
    a = make_variant("a")
    for v in (a, make_variant("a", s_old=("b",)), make_variant("b")):
        store.offer(v)
    store.record_hit(a.variant_id, 0.5)
    store.close()
    return str(tmp_path)


def test_ls_and_stats_json(cache_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    rows = json.loads(run(["chunks", "ls", "--cache-dir", cache_dir, "--json"], capsys))
    assert sorted(r["chunk_key"] for r in rows) == ["a", "a", "b"]
    assert sum(r["hits"] for r in rows) == 1
    stats = json.loads(run(["chunks", "stats", "--cache-dir", cache_dir, "--json"], capsys))
    assert stats["num_variants"] == 3 and stats["num_chunks"] == 2 and stats["hits"] == 1
    assert stats["bytes"] == sum(p.stat().st_size for p in Path(cache_dir).glob("*.safetensors"))


def test_tables_render(cache_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert "chunk_key" in run(["chunks", "ls", "--cache-dir", cache_dir], capsys)
    assert "num_variants" in run(["chunks", "stats", "--cache-dir", cache_dir], capsys)


def test_rm_and_clear(cache_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    out = json.loads(run(["chunks", "rm", "a", "--cache-dir", cache_dir, "--json"], capsys))
    assert out == {"removed": 2, "not_found": []}
    assert [r["chunk_key"] for r in chunks_command("ls", cache_dir)] == ["b"]  # type: ignore[union-attr]
    out = json.loads(run(["chunks", "clear", "--cache-dir", cache_dir, "--json"], capsys))
    assert out == {"removed": 1}
    assert chunks_command("ls", cache_dir) == []
    assert list(Path(cache_dir).glob("*.safetensors")) == []


def test_missing_directory_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(StoreUnavailableError, match="no chunk-cache directory"):
        chunks_command("ls", str(tmp_path / "nope"))


def test_rm_names_the_keys_it_did_not_find(
    cache_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A mistyped key was answered `{"removed": 0}` like any other: nothing said which key
    matched nothing."""
    argv = ["chunks", "rm", "b", "nope", "b", "--cache-dir", cache_dir]
    assert json.loads(run([*argv, "--json"], capsys)) == {"removed": 1, "not_found": ["nope"]}
    assert "nope" in run(argv, capsys)  # the table too; b is gone by now
