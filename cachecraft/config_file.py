"""The calibration/config file (`./cachecraft.json` by default): read, write, its "reuse"
section as ReuseConfig overrides, and the command-line flags of the same fields (one flag per
field). Which settings object a name belongs to is decided once, by `llm.split_settings`.
`cachecraft calibrate` (the lab) writes the file through `write_config`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from pathlib import Path
from typing import Any

from cachecraft.config import ReuseConfig, field_names
from cachecraft.errors import BadRequestError

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


def write_config(
    path: str | Path | None,
    alpha: float,
    settings: dict[str, Any] | None = None,
    **calibration: Any,
) -> Path:
    """Set reuse.alpha (and the other reuse `settings` calibrated) in the config file, other
    keys kept, and record how they were calibrated."""
    p = Path(path) if path is not None else DEFAULT_CONFIG_PATH
    data = read_config(p) if p.is_file() else {}
    reuse = data.get("reuse")
    data["reuse"] = {
        **(reuse if isinstance(reuse, dict) else {}),
        "alpha": float(alpha),
        **(settings or {}),
    }
    if calibration:
        data["calibration"] = calibration
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    tmp.replace(p)  # atomic: a reader never sees half a file
    return p


def load_reuse_overrides(path: str | Path | None = None) -> dict[str, Any]:
    """The "reuse" section of the config file: ReuseConfig field -> value ({} without a file;
    `llm.reuse_config` checks the names and values). Reuse options written at the top level
    (ignored there otherwise; other top-level keys are the file owner's and stay) raise
    BadRequestError naming them."""
    data = read_config(path)
    known = field_names(ReuseConfig)
    misplaced = sorted(set(data) & known)
    if misplaced:
        raise BadRequestError(
            f'config file: {misplaced} at the top level; reuse options go under "reuse" '
            f'({{"reuse": {{"{misplaced[0]}": ...}}}})'
        )
    reuse = data.get("reuse", {})
    if not isinstance(reuse, dict):
        raise BadRequestError("config file: 'reuse' must be an object")
    return dict(reuse)


def merge_overrides(from_file: dict[str, Any], **flags: Any) -> dict[str, Any]:
    """File values overridden by the flags that were given (None = not given)."""
    return {**from_file, **{k: v for k, v in flags.items() if v is not None}}


def add_reuse_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per ReuseConfig field (--alpha, --refresh-repeats/--no-refresh-repeats, ...),
    each defaulting to None so that only the flags given override the config file."""
    group = parser.add_argument_group("reuse options (override the config file)")
    hints = typing.get_type_hints(ReuseConfig)
    for f in dataclasses.fields(ReuseConfig):
        hint = hints[f.name]
        kw: dict[str, Any] = {"dest": f"reuse_{f.name}", "default": None}
        if hint is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["metavar"] = f.name.upper()
            kw["type"] = int if int in (hint, *typing.get_args(hint)) else float
        doc = (f"ReuseConfig.{f.name}", f"default {f.default!r}")
        group.add_argument("--" + f.name.replace("_", "-"), help=", ".join(doc), **kw)


def reuse_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The config file's (`args.config`) reuse section, then the reuse flags given."""
    flags = {
        f.name: getattr(args, f"reuse_{f.name}", None) for f in dataclasses.fields(ReuseConfig)
    }
    return merge_overrides(load_reuse_overrides(getattr(args, "config", None)), **flags)
