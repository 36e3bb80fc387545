"""`cachecraft serve`: flags map one-to-one to EngineConfig / ServerConfig / StoreConfig fields.

Wire it with `add_serve_parser(subparsers)`; it sets `args.func` to `main_serve`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from cachecraft.config_file import add_reuse_flags, reuse_overrides
from cachecraft.engine.engine import EngineConfig
from cachecraft.errors import BadRequestError, StoreUnavailableError
from cachecraft.logs import setup_logging
from cachecraft.model.loader import DTYPES
from cachecraft.reuse.strategies import STRATEGIES
from cachecraft.server.config import ServerConfig
from cachecraft.store.config import StoreConfig

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
"""uvicorn's levels (`trace` is uvicorn's own, below debug)."""


def port_number(text: str) -> int:
    """argparse type: a TCP port, 0-65535 (a bad one is a usage error, exit 2)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be 0-65535, got {port}")
    return port


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    engine, server, store = EngineConfig(), ServerConfig(), StoreConfig()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port_number, default=8000, help="0: a free port (logged)")
    p.add_argument(
        "--model", default=None, help="HF dir, GGUF file or a named model (default: bundled)"
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=tuple(DTYPES),
        help="weights and compute (default: bfloat16 on a GPU, float32 on a CPU; bfloat16 on "
        "a CPU: ~3x faster prefill with AMX, ~5x slower without; see docs/performance.md)",
    )
    p.add_argument(
        "--device",
        default=store.device,
        help="where the weights, the forward and the memory tier live: cpu, cuda or cuda:N "
        "(on a GPU, host RAM is a second tier, --host-bytes)",
    )
    p.add_argument(
        "--mode", default=engine.mode, choices=STRATEGIES.names(), help="default reuse mode"
    )
    p.add_argument(
        "--api-key",
        dest="api_keys",
        action="append",
        default=[],
        help="accepted bearer key, one tenant each (repeatable; none given: no auth)",
    )
    p.add_argument(
        "--admin-key",
        dest="admin_keys",
        action="append",
        default=[],
        help="the operator's bearer key (repeatable): /metrics and /health's store-wide figures",
    )
    p.add_argument(
        "--public-docs",
        action="store_true",
        help="serve /docs, /redoc and /openapi.json while keys are set (default: off then)",
    )
    p.add_argument(
        "--share-namespace",
        action="store_true",
        help="all API keys share one cache namespace (default: one per key)",
    )
    p.add_argument("--cache-dir", default="./.cachecraft", help="disk tier ('' to disable)")
    p.add_argument("--redis-url", default=None, help="shared Redis tier, e.g. redis://host:6379")
    p.add_argument(
        "--redis-cluster",
        action="store_true",
        help="--redis-url names nodes of a Redis/Valkey cluster (comma-separated startup nodes)",
    )
    p.add_argument(
        "--memory-bytes",
        type=int,
        default=store.memory_bytes,
        help="the first tier, on --device",
    )
    p.add_argument(
        "--host-bytes",
        type=int,
        default=store.host_bytes,
        help="host RAM between the GPU's memory tier and disk (a GPU --device only)",
    )
    p.add_argument("--disk-bytes", type=int, default=store.disk_bytes)
    p.add_argument("--redis-bytes", type=int, default=store.redis_bytes)
    p.add_argument(
        "--redis-prefix",
        default=store.redis_prefix,
        help="key prefix on the shared server (replicas of one model share one prefix)",
    )
    p.add_argument(
        "--doorkeeper-threshold",
        type=int,
        default=store.doorkeeper_threshold,
        help="admit a chunk's cache once it was seen this often (shared by replicas)",
    )
    p.add_argument(
        "--admit-all-below",
        type=float,
        default=store.admit_all_below,
        help="while the largest tier is filled below this share, admit every chunk on first "
        "sight (0: the doorkeeper always decides)",
    )
    p.add_argument("--max-variants-per-chunk", type=int, default=store.max_variants_per_chunk)
    p.add_argument(
        "--max-pinned-bytes-per-key",
        "--max-pinned-bytes-per-namespace",
        dest="max_pinned_bytes_per_namespace",
        metavar="BYTES",
        type=int,
        default=store.max_pinned_bytes_per_namespace,
        help="bytes one API key may pin with POST /v1/chunks, over all its cache_namespace "
        "values (without keys: all clients together; default: no cap)",
    )
    p.add_argument(
        "--storage-dtype", default=store.storage_dtype, choices=("float16", "bfloat16", "float32")
    )
    p.add_argument("--max-queue", type=int, default=engine.max_queue)
    p.add_argument("--max-running", type=int, default=engine.max_running)
    p.add_argument("--token-budget", type=int, default=engine.token_budget)
    p.add_argument(
        "--kv-pool-mib",
        type=int,
        default=engine.kv_pool_mib,
        help="memory of the KV pool that batches decode attention (0: no pool)",
    )
    p.add_argument(
        "--kv-warm-positions",
        type=int,
        default=engine.kv_warm_positions,
        help="positions of every KV pool slot mapped into memory while idle (0: none)",
    )
    p.add_argument(
        "--chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=engine.chunked_prefill,
        help="run a prefill larger than a step's budget in pieces, others decoding between",
    )
    p.add_argument("--max-documents", type=int, default=server.max_documents)
    p.add_argument("--max-document-chars", type=int, default=server.max_document_chars)
    p.add_argument(
        "--max-prompt-chars",
        type=int,
        default=server.max_prompt_chars,
        help="characters of message / prompt / system text per request (413 above)",
    )
    p.add_argument(
        "--max-prompts",
        type=int,
        default=server.max_prompts,
        help="prompts in one completion's prompt list (400 above)",
    )
    p.add_argument(
        "--pasted-chunk-chars",
        type=int,
        default=server.pasted_chunk_chars,
        help="cut context pasted into the last message into chunk-caches at blank lines and "
        "after lines this long, a paragraph this long closing a chunk (0: never)",
    )
    p.add_argument(
        "--raw-completions",
        action="store_true",
        help="read every /v1/completions prompt as given, as vLLM does (no chat template, no "
        "chunk-caches; for evaluation harnesses); token-id prompts and echo are raw anyway",
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=server.max_request_bytes,
        help="request body size (413 above)",
    )
    p.add_argument(
        "--watchdog-s",
        type=float,
        default=server.watchdog_s,
        help="/health answers 503 when one engine step runs longer than this",
    )
    p.add_argument(
        "--metrics-public",
        action="store_true",
        help="serve /metrics and /health's store-wide figures to everyone (default: only to "
        "--admin-key when keys are set)",
    )
    p.add_argument(
        "--shutdown-timeout-s",
        type=float,
        default=server.shutdown_timeout_s,
        help="on SIGTERM/SIGINT, how long open requests may still run",
    )
    p.add_argument("--config", default=None, help="calibration file (default ./cachecraft.json)")
    p.add_argument("--log-level", default="info", type=str.lower, choices=LOG_LEVELS)
    add_reuse_flags(p)
    p.set_defaults(func=main_serve)
    return p


def main_serve(args: argparse.Namespace) -> int:
    from cachecraft.llm import configure
    from cachecraft.server.launch import serve  # heavy imports only when serving

    reuse, strategies = configure(reuse_overrides(args))  # a strategy's parameters too

    # `cachecraft` already configured logging (WARNING, or INFO with -v): --log-level wins here
    setup_logging(args.log_level.upper())
    cache_dir = args.cache_dir or None
    if cache_dir is not None:
        try:
            Path(cache_dir).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreUnavailableError(
                f"cannot create the cache directory {cache_dir}: {e}"
            ) from None
    try:  # a bad flag value is one line naming the setting, not a traceback
        server = ServerConfig(
            api_keys=tuple(args.api_keys),
            admin_keys=tuple(args.admin_keys),
            public_docs=args.public_docs,
            max_prompts=args.max_prompts,
            share_namespace=args.share_namespace,
            max_documents=args.max_documents,
            max_document_chars=args.max_document_chars,
            max_prompt_chars=args.max_prompt_chars,
            pasted_chunk_chars=args.pasted_chunk_chars,
            raw_completions=args.raw_completions,
            max_request_bytes=args.max_request_bytes,
            watchdog_s=args.watchdog_s,
            metrics_public=args.metrics_public,
            shutdown_timeout_s=args.shutdown_timeout_s,
        )
        store = StoreConfig(
            memory_bytes=args.memory_bytes,
            host_bytes=args.host_bytes,
            disk_bytes=args.disk_bytes,
            redis_bytes=args.redis_bytes,
            cache_dir=cache_dir,
            redis_url=args.redis_url,
            redis_cluster=args.redis_cluster,
            redis_prefix=args.redis_prefix,
            doorkeeper_threshold=args.doorkeeper_threshold,
            admit_all_below=args.admit_all_below,
            max_variants_per_chunk=args.max_variants_per_chunk,
            storage_dtype=args.storage_dtype,
            max_pinned_bytes_per_namespace=args.max_pinned_bytes_per_namespace,
            device=args.device,
        )
        engine = EngineConfig(
            token_budget=args.token_budget,
            max_running=args.max_running,
            max_queue=args.max_queue,
            mode=args.mode,
            kv_pool_mib=args.kv_pool_mib,
            kv_warm_positions=args.kv_warm_positions,
            chunked_prefill=args.chunked_prefill,
        )
    except ValueError as e:
        raise BadRequestError(f"bad setting: {e}") from None
    serve(
        args.mode,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        reuse=reuse,
        strategies=strategies,
        server=server,
        store=store,
        engine=engine,
    )
    return 0
