"""bench chat: multi-turn conversations sent turn after turn as a chat client sends them.

Each user turn of a conversation is one request carrying every earlier turn (`bench/chat.py`),
turned into a RagRequest exactly as the server does (`api.chat_request`: earlier turns become
chunk-caches). Conversations come from ShareGPT (the bundled offline package) unless given.
Modes take turns conversation by conversation, each with its own LLM and store, so they see
the same machine; reported per mode: prompt tokens, tokens computed (the probe's cost
included), TTFT (the engine's), overall and by user turn.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from cachecraft.api import LLM, LoadedModel, SamplingParams, chat_request, load_model
from cachecraft.errors import CachecraftError
from cachecraft_bench.chat import SYSTEM, Conversation, sharegpt_conversations
from cachecraft_bench.modes import LAB_MODES as MODES


def run_chat_bench(
    loaded: LoadedModel,
    modes: Sequence[str] = ("full", "prefix", "cachecraft"),
    conversations: Sequence[Conversation] | None = None,
    num_conversations: int = 12,
    max_turns: int = 8,
    max_chars: int = 600,
    max_tokens: int = 8,
    system: str = SYSTEM,
    progress: Any = None,
) -> dict[str, Any]:
    """Every user turn of every conversation in every mode (see the module doc).
    `progress(done, total)`, if given, is called after each request."""
    if conversations is None:
        conversations = sharegpt_conversations(num_conversations, 2, max_turns, max_chars)
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    llms = {mode: LLM(loaded) for mode in modes}
    rows: dict[str, list[tuple[int, int, float, float]]] = {m: [] for m in modes}
    total = len(modes) * sum(sum(r == "user" for r, _ in c) for c in conversations)
    done = 0
    for i, turns in enumerate(conversations):
        order = list(modes) if i % 2 == 0 else list(reversed(modes))
        for mode in order:
            messages: list[dict[str, str]] = [{"role": "system", "content": system}]
            user_turn = 0
            for role, text in turns:
                messages.append({"role": role, "content": text})
                if role != "user":
                    continue
                rag = chat_request(messages, namespace=f"bench-chat-{mode}")
                report = llms[mode].generate(rag, sampling, mode)[0].report
                computed = report.tokens_computed + report.probe_cost
                rows[mode].append((user_turn, report.prompt_tokens, computed, report.ttft_ms))
                user_turn += 1
                done += 1
                if progress is not None:
                    progress(done, total)
    return {
        "config": {
            "modes": list(modes),
            "conversations": len(conversations),
            "max_turns": max_turns,
            "max_chars": max_chars,
            "max_tokens": max_tokens,
        },
        "modes": {mode: _summary(r) for mode, r in rows.items()},
    }


def _summary(rows: list[tuple[int, int, float, float]]) -> dict[str, Any]:
    prompt = sum(r[1] for r in rows)
    computed = sum(r[2] for r in rows)
    ttft = [r[3] for r in rows]
    by_turn: dict[int, list[float]] = {}
    for turn, _, _, ms in rows:
        by_turn.setdefault(turn, []).append(ms)
    return {
        "requests": len(rows),
        "prompt_tokens": prompt,
        "computed_tokens": round(computed, 1),
        "computed_fraction": round(computed / prompt, 4) if prompt else None,
        "ttft_ms_p50": round(statistics.median(ttft), 1) if ttft else None,
        "ttft_ms_mean": round(statistics.mean(ttft), 1) if ttft else None,
        "ttft_ms_p50_by_user_turn": {
            str(t): round(statistics.median(v), 1) for t, v in sorted(by_turn.items())
        },
    }


def add_bench_chat_parser(subparsers: Any) -> Any:
    parser = subparsers.add_parser(
        "chat", help="multi-turn chats sent turn by turn as a chat client sends them"
    )
    parser.add_argument("--modes", default="full,prefix,cachecraft")
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--max-turns", type=int, default=8, help="turns kept per conversation")
    parser.add_argument("--max-chars", type=int, default=600, help="characters kept per turn")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--json", action="store_true")
    parser.set_defaults(func=main_chat_bench)
    return parser


def main_chat_bench(args: Any) -> int:
    from cachecraft_bench.strategies import register

    register()  # the baselines too
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if not modes or unknown:
        raise CachecraftError(f"--modes: choose among {', '.join(MODES)}, got {args.modes!r}")
    if min(args.conversations, args.max_turns, args.max_chars, args.max_tokens) < 1:
        raise CachecraftError(
            "--conversations, --max-turns, --max-chars, --max-tokens must be >= 1"
        )
    loaded = load_model(args.model, dtype=args.dtype)
    with tqdm(desc="bench chat", unit="req", file=sys.stderr) as bar:

        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        result = run_chat_bench(
            loaded,
            modes,
            num_conversations=args.conversations,
            max_turns=args.max_turns,
            max_chars=args.max_chars,
            max_tokens=args.max_tokens,
            progress=progress,
        )
    if args.json:
        print(json.dumps(result, indent=2))  # CLI output
        return 0
    print(f"{result['config']['conversations']} conversations, every user turn a request")
    for mode, row in result["modes"].items():
        print(
            f"  {mode:>12}: {row['requests']} requests, computed {row['computed_fraction']:.3f} "
            f"of {row['prompt_tokens']} prompt tokens, TTFT p50 {row['ttft_ms_p50']} ms, "
            f"mean {row['ttft_ms_mean']} ms; p50 by user turn {row['ttft_ms_p50_by_user_turn']}"
        )
    return 0
