"""`cachecraft chunks ls|stats|rm|clear|reindex --cache-dir DIR`: inspect, prune or repair a
disk store.

Owns argument parsing and output (rich table or --json) for the chunk-cache directory; all
work is done by `DiskTier`. `ls` and `stats` open it read-only: they never create, recover,
checkpoint or truncate anything. `rm` and `clear` never touch the server's chunk registry
(the store knows nothing of the server): servers drop the rows of chunks no longer stored
themselves (`server/chunks.py`). Wire it with `add_chunks_parser(subparsers)`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cachecraft.errors import StoreUnavailableError
from cachecraft.store.disk import DiskTier

READ_ONLY = ("ls", "stats")


def add_chunks_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `chunks` with sub-commands ls, stats, rm CHUNK_KEY..., clear; sets `func`."""
    parser = subparsers.add_parser("chunks", help="inspect or prune the chunk-cache directory")
    sub = parser.add_subparsers(dest="chunks_command", required=True)
    for name, help_text in (
        ("ls", "list stored variants"),
        ("stats", "totals of the directory"),
        ("rm", "remove every variant of the given chunk keys (servers stop listing them)"),
        ("clear", "remove every variant (servers stop listing them)"),
        (
            "reindex",
            "verify every file against its own header and rebuild the index from the sound "
            "ones (files that fail are moved to quarantine/, never deleted)",
        ),
    ):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--cache-dir", required=True, help="the store's cache_dir")
        p.add_argument("--json", action="store_true", help="print JSON instead of a table")
        if name == "rm":
            p.add_argument("chunk_keys", nargs="+")
        p.set_defaults(func=main_chunks)
    return parser


def chunks_command(command: str, cache_dir: str, chunk_keys: list[str] | None = None) -> object:
    """Run one sub-command; returns what it prints (rows, a totals dict, or a removal count;
    `rm` also names the keys it found no variant of)."""
    if not Path(cache_dir).is_dir():
        raise StoreUnavailableError(f"no chunk-cache directory at {cache_dir}")
    # capacity is irrelevant here: nothing is written but removals and index rows
    tier = DiskTier(cache_dir, capacity_bytes=1 << 62, read_only=command in READ_ONLY)
    try:
        if command == "ls":
            return tier.rows()
        if command == "stats":
            rows = tier.rows()
            return {
                "cache_dir": str(cache_dir),
                "num_variants": len(rows),
                "num_chunks": len({r["chunk_key"] for r in rows}),
                "bytes": sum(int(r["file_size"]) for r in rows),  # type: ignore[call-overload]
                "hits": sum(int(r["hits"]) for r in rows),  # type: ignore[call-overload]
                "unindexed_files": tier.num_unindexed_files(),
                "quarantined_files": tier.num_quarantined(),
            }
        if command == "rm":  # each key once; the ones with no variant are named
            counts = {k: tier.remove_chunk(k) for k in dict.fromkeys(chunk_keys or [])}
            missing = [k for k, n in counts.items() if n == 0]
            return {"removed": sum(counts.values()), "not_found": missing}
        if command == "clear":
            return {"removed": tier.clear()}
        if command == "reindex":
            return {"recovered": tier.recovery._asdict(), **tier.reindex()._asdict()}
        raise ValueError(f"unknown chunks command {command!r}")
    finally:
        tier.close()


def main_chunks(args: argparse.Namespace) -> int:
    result = chunks_command(args.chunks_command, args.cache_dir, getattr(args, "chunk_keys", None))
    if args.json:
        print(json.dumps(result, indent=2))  # CLI output
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if args.chunks_command == "ls":
        table = Table(title=f"chunk-caches in {args.cache_dir}")
        cols = ("chunk_key", "variant_id", "s_old", "num_tokens", "file_size", "hits", "mean_cfo")
        for col in cols:
            table.add_column(col, justify="left" if col in cols[:3] else "right")
        for r in result:  # type: ignore[union-attr]
            mean_cfo = f"{r['cfo_sum'] / r['hits']:.3f}" if r["hits"] else "-"
            table.add_row(
                str(r["chunk_key"]),
                str(r["variant_id"]),
                ",".join(r["s_old"]) or "-",
                str(r["num_tokens"]),
                str(r["file_size"]),
                str(r["hits"]),
                mean_cfo,
            )
        console.print(table)
    else:
        table = Table(title=f"chunks {args.chunks_command}: {args.cache_dir}")
        table.add_column("field")
        table.add_column("value", justify="right")
        for key, value in result.items():  # type: ignore[union-attr]
            table.add_row(key, ", ".join(value) if isinstance(value, list) else str(value))
        console.print(table)
    return 0
