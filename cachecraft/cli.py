"""`cachecraft` command line: ask, serve, chunks, models; plus whatever an installed plugin adds
(the lab, `cachecraft_bench`, adds `bench` and `calibrate` through the `cachecraft.commands`
entry point group).

Owns argument parsing and turning CachecraftError into one clear line (exit code 2); the
work itself lives in the library. Subcommands owned elsewhere register their own parsers.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from importlib.metadata import entry_points
from pathlib import Path

from cachecraft.env import set_passive_openmp, tune_allocator

set_passive_openmp()  # before anything imports torch (cachecraft/env.py says why)
tune_allocator()

from cachecraft.config_file import add_reuse_flags, reuse_overrides  # noqa: E402
from cachecraft.errors import CachecraftError  # noqa: E402
from cachecraft.logs import setup_logging  # noqa: E402
from cachecraft.model.cli import add_models_parser  # noqa: E402
from cachecraft.reuse.strategies import DEFAULT_STRATEGY, STRATEGIES  # noqa: E402
from cachecraft.server.cli import add_serve_parser  # noqa: E402
from cachecraft.store.cli import add_chunks_parser  # noqa: E402

PLUGIN_GROUP = "cachecraft.commands"
"""Entry points here are called with the subparsers action and add their own commands."""


def _ask(args: argparse.Namespace) -> int:
    from cachecraft.engine.sampling import SamplingParams
    from cachecraft.llm import LLM
    from cachecraft.request import Chunk, RagRequest

    chunks = []
    for path in args.doc or []:
        p = Path(path)
        if not p.is_file():
            raise CachecraftError(f"document not found: {p}")
        chunks.append(Chunk(p.read_text(encoding="utf-8", errors="replace"), id=p.name))
    store = None
    if args.cache_dir:
        from cachecraft.store.config import StoreConfig
        from cachecraft.store.store import make_store

        # Admit on first sight: whoever asks twice on the command line expects the second
        # answer to reuse the first one's chunk-caches (docs/api.md, "Quick start").
        config = StoreConfig(cache_dir=args.cache_dir, device=args.device, doorkeeper_threshold=1)
        store = make_store(config)
    llm = LLM(
        args.model, dtype=args.dtype, device=args.device, store=store, **reuse_overrides(args)
    )
    request = RagRequest(args.question, chunks, system=args.system)
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    out = llm.generate(request, sampling, mode=args.mode)[0]
    if args.json:
        print(json.dumps({"text": out.text, "report": out.report.to_dict()}, indent=2))
        return 0
    rep = out.report
    print(out.text)
    print(
        f"\n[{rep.mode}] {rep.prompt_tokens} prompt tokens, {rep.tokens_computed} computed "
        f"({100 * rep.computed_fraction:.0f}%), first token after {rep.ttft_ms:.0f} ms",
        file=sys.stderr,
    )
    for c in rep.chunks:
        state = f"hit, CFO {c.cfo:.2f}" if c.is_hit and c.cfo is not None else "miss"
        print(
            f"  {c.label or c.key[:12]}: {state}, {c.tokens_recomputed} recomputed", file=sys.stderr
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cachecraft", description=__doc__.split("\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    ask = sub.add_parser("ask", help="answer a question over documents with chunk-cache reuse")
    ask.add_argument("--doc", action="append", help="a document file (repeatable)")
    ask.add_argument("--question", required=True)
    ask.add_argument("--system", default=None, help="system prompt")
    ask.add_argument("--mode", choices=STRATEGIES.names(), default=DEFAULT_STRATEGY)
    ask.add_argument(
        "--model", default=None, help="HF dir, .gguf or a named model (default: bundled)"
    )
    ask.add_argument(
        "--dtype",
        default=None,
        choices=("float32", "bfloat16", "float16"),
        help="default: bfloat16 on a GPU, float32 on a CPU",
    )
    ask.add_argument("--device", default="cpu")
    ask.add_argument("--cache-dir", default=None, help="keep chunk-caches on disk here")
    ask.add_argument("--config", default=None, help="calibration file (cachecraft calibrate)")
    ask.add_argument("--max-tokens", type=int, default=128)
    ask.add_argument("--temperature", type=float, default=0.0)
    ask.add_argument("--json", action="store_true")
    add_reuse_flags(ask)
    ask.set_defaults(func=_ask)

    for add in (add_serve_parser, add_chunks_parser, add_models_parser):
        add(sub)
    for plugin in entry_points(group=PLUGIN_GROUP):
        plugin.load()(sub)
    return parser


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def stop_on_sigterm() -> None:
    """SIGTERM (what `timeout`, systemd and docker send) unwinds like Ctrl-C, so every
    `finally` / `with` block runs and the processes we started are stopped with us."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    stop_on_sigterm()
    setup_logging(logging.INFO if args.verbose else logging.WARNING)
    try:
        return int(args.func(args) or 0)
    except CachecraftError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
