"""Named models: joining split parts, verifying size and hash, and the error before a pull."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from cachecraft.errors import ModelLoadError
from cachecraft.model.loader import resolve_model_dir
from cachecraft.model.named import (
    NAMED_MODELS,
    ModelPart,
    NamedModel,
    find_parts,
    join_parts,
    pull,
)


def _parts(tmp_path: Path) -> tuple[list[Path], bytes]:
    data = bytes(range(256)) * 300 + b"tail"
    pieces = [data[:20_000], data[20_000:50_000], data[50_000:]]
    paths = []
    for i, piece in enumerate(pieces, start=1):
        path = tmp_path / f"part{i:02d}.bin"
        path.write_bytes(piece)
        paths.append(path)
    return paths, data


def test_join_in_order_with_the_right_hash(tmp_path: Path) -> None:
    parts, data = _parts(tmp_path)
    target = tmp_path / "out" / "m.gguf"
    seen: list[int] = []
    got = join_parts(parts, target, len(data), hashlib.sha256(data).hexdigest(), seen.append)
    assert got == target and target.read_bytes() == data
    assert sum(seen) == len(data)


def test_wrong_hash_is_refused_and_leaves_no_file(tmp_path: Path) -> None:
    parts, data = _parts(tmp_path)
    out = tmp_path / "out"
    swapped = [parts[1], parts[0], parts[2]]  # the right bytes in the wrong order
    with pytest.raises(ModelLoadError, match="sha256"):
        join_parts(swapped, out / "m.gguf", len(data), hashlib.sha256(data).hexdigest())
    assert list(out.iterdir()) == []


def test_wrong_size_is_refused_before_writing(tmp_path: Path) -> None:
    parts, data = _parts(tmp_path)
    out = tmp_path / "out"
    with pytest.raises(ModelLoadError, match="bytes"):
        join_parts(parts[:2], out / "m.gguf", len(data), hashlib.sha256(data).hexdigest())
    assert not out.exists() or list(out.iterdir()) == []


def test_pull_finds_parts_by_path_in_installed_packages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parts, data = _parts(tmp_path)
    site = tmp_path / "site"
    model_parts = []
    for i, path in enumerate(parts, start=1):
        pkg = site / f"made_up_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise ImportError('must not be imported')\n")
        (pkg / "data" / path.name).write_bytes(path.read_bytes())
        model_parts.append(ModelPart(f"made-up-part{i}==1", pkg.name, f"data/{path.name}"))
    monkeypatch.syspath_prepend(str(site))
    model = NamedModel(
        "made-up", "test", tuple(model_parts), len(data), hashlib.sha256(data).hexdigest(), "none"
    )
    monkeypatch.setitem(NAMED_MODELS, model.name, model)
    found, missing = find_parts(model)
    assert missing == [] and [p.name for p in found] == ["part01.bin", "part02.bin", "part03.bin"]
    got = pull("made-up", tmp_path / "cache", install=False)
    assert got == tmp_path / "cache" / "named" / "made-up.gguf" and got.read_bytes() == data


def test_a_named_model_not_pulled_says_how_to_pull_it(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="cachecraft models pull qwen2.5-coder-1.5b"):
        resolve_model_dir("qwen2.5-coder-1.5b", tmp_path)


def test_models_list_names_each_model_and_whether_pulled(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from cachecraft.cli import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # an empty cache: nothing pulled
    assert main(["models", "list", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["qwen2.5-coder-1.5b"]["pulled"] is False
    assert rows["qwen2.5-coder-1.5b"]["bytes"] == 1_117_320_768
    assert main(["ask", "--model", "qwen2.5-coder-1.5b", "--question", "?"]) == 2
    assert "cachecraft models pull qwen2.5-coder-1.5b" in capsys.readouterr().err
