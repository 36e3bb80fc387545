"""The calibration/config file (`./cachecraft.json` by default): read, write, and its "reuse"
section as ReuseConfig overrides. Sits next to `config` so that no product module imports
`bench` to read it; `cachecraft calibrate` (bench) writes it through `write_config`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from cachecraft.config import ReuseConfig
from cachecraft.errors import BadRequestError

STORE_SETTINGS = frozenset({"storage_dtype", "max_variants_per_chunk"})
"""Settings that were once reuse options and now belong to StoreConfig (a clear error)."""
DEFAULT_CONFIG_PATH = Path("cachecraft.json")
"""Where `cachecraft calibrate` writes and every command looks by default (the working dir)."""


def read_config(path: str | Path | None = None) -> dict[str, Any]:
    """The config file as a dict; {} when `path` is None and the default file does not exist."""
    p = Path(path) if path is not None else DEFAULT_CONFIG_PATH
    if not p.is_file():
        if path is None:
            return {}
        raise BadRequestError(f"config file {p} does not exist")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadRequestError(f"config file {p} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise BadRequestError(f"config file {p} must hold a JSON object")
    return data


def write_config(path: str | Path | None, alpha: float, **calibration: Any) -> Path:
    """Set reuse.alpha in the config file (other keys kept) and record how it was calibrated."""
    p = Path(path) if path is not None else DEFAULT_CONFIG_PATH
    data = read_config(p) if p.is_file() else {}
    reuse = data.get("reuse")
    data["reuse"] = {**(reuse if isinstance(reuse, dict) else {}), "alpha": float(alpha)}
    if calibration:
        data["calibration"] = calibration
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    tmp.replace(p)  # atomic: a reader never sees half a file
    return p


def load_reuse_overrides(path: str | Path | None = None) -> dict[str, Any]:
    """The "reuse" section of the config file: ReuseConfig field -> value ({} without a file).
    Unknown fields, and reuse options written at the top level (ignored there otherwise; other
    top-level keys are the file owner's and stay), raise BadRequestError naming them."""
    data = read_config(path)
    known = {f.name for f in dataclasses.fields(ReuseConfig)}
    misplaced = sorted(set(data) & known)
    if misplaced:
        raise BadRequestError(
            f'config file: {misplaced} at the top level; reuse options go under "reuse" '
            f'({{"reuse": {{"{misplaced[0]}": ...}}}})'
        )
    reuse = data.get("reuse", {})
    if not isinstance(reuse, dict):
        raise BadRequestError("config file: 'reuse' must be an object")
    unknown = sorted(set(reuse) - known)
    moved = [k for k in unknown if k in STORE_SETTINGS]
    if moved:
        raise BadRequestError(
            f"config file: {', '.join(moved)} is a store setting, not a reuse one "
            f"(give it to the store, e.g. `cachecraft serve --{moved[0].replace('_', '-')}`)"
        )
    if unknown:
        raise BadRequestError(f"config file: unknown reuse option(s) {unknown}")
    return dict(reuse)


def merge_overrides(from_file: dict[str, Any], **flags: Any) -> dict[str, Any]:
    """File values overridden by the flags that were given (None = not given)."""
    return {**from_file, **{k: v for k, v in flags.items() if v is not None}}
