"""The chat workload: multi-turn ShareGPT conversations as a chat client sends them.

Each user turn is one request whose `messages` hold the system prompt, every earlier turn (the
dataset's own assistant replies, as a client sends back what it was told) and the new
question; `chat_request` turns it into the RagRequest the server makes of it (earlier turns
become chunk-caches). Used by `bench chat` (turn by turn) and `bench serve --workload chat`.
"""

from __future__ import annotations

from cachecraft.api import chat_request
from cachecraft_bench.item import WorkloadItem
from cachecraft_bench.sharegpt import conversation_turns
from cachecraft_bench.sources import iter_sharegpt

SYSTEM = "You are a helpful assistant."

Conversation = list[tuple[str, str]]
"""(role, text) turns, role "user" or "assistant", starting with a user turn."""


def sharegpt_conversations(
    num: int, min_user_turns: int, max_turns: int, max_chars: int
) -> list[Conversation]:
    """The first `num` ShareGPT conversations that open with the user and hold at least
    `min_user_turns` user turns within their first `max_turns` turns, each turn cut to
    `max_chars` characters (so that a conversation fits a small model's context)."""
    out: list[Conversation] = []
    for record in iter_sharegpt():
        turns = [
            ("user" if role == "User" else "assistant", text[:max_chars])
            for role, text in conversation_turns(record)[:max_turns]
        ]
        if not turns or turns[0][0] != "user" or not all(_encodes(t) for _, t in turns):
            continue
        if sum(r == "user" for r, _ in turns) < min_user_turns:
            continue
        out.append(turns)
        if len(out) == num:
            break
    return out


def chat_workload(
    n: int, active: int = 6, max_turns: int = 8, max_chars: int = 600
) -> list[WorkloadItem]:
    """`n` requests of ShareGPT chats as a chat service receives them (`bench serve --workload
    chat`): `active` conversations at a time take turns, each sending its next user turn with
    every earlier turn (a conversation's turn t + 1 always comes after its turn t), and one
    that has no user turn left is replaced by the next conversation. Each request is the
    RagRequest the server makes of that chat (`chat_request`); its gold answer is the reply
    the dataset gives."""
    pool = iter(sharegpt_conversations(max(2 * n, active), 2, max_turns, max_chars))
    live: list[tuple[int, Conversation, int]] = []  # (conversation number, turns, next turn)
    started = 0
    items: list[WorkloadItem] = []
    while len(items) < n:
        while len(live) < active:
            conv = next(pool, None)
            if conv is None:
                break
            live.append((started, conv, 0))
            started += 1
        if not live:
            break
        c, turns, t = live.pop(0)
        while t < len(turns) and turns[t][0] != "user":
            t += 1
        if t >= len(turns):
            continue
        messages = [{"role": "system", "content": SYSTEM}]
        messages += [{"role": r, "content": text} for r, text in turns[: t + 1]]
        reply = turns[t + 1][1] if t + 1 < len(turns) else None
        items.append(
            WorkloadItem(f"chat{c}/t{t}", chat_request(messages), (reply,) if reply else None)
        )
        live.append((c, turns, t + 1))
    return items


def _encodes(text: str) -> bool:
    """Whether `text` is valid Unicode (some ShareGPT records hold lone surrogates, which the
    server refuses with a 400)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
