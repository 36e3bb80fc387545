"""bench chat on the tiny random Llama: every user turn of a conversation is a request, sent
as the server turns a chat into a RagRequest; reuse modes compute only the newest turns."""

from __future__ import annotations

from cachecraft.model.loader import LoadedModel
from cachecraft_bench.chat import chat_workload
from cachecraft_bench.chat_bench import run_chat_bench

LONG = "The Nile flows north through Egypt into the Mediterranean. " * 10  # > 512 characters
CHATS = [
    [
        ("user", LONG),
        ("assistant", "It flows north. " * 40),
        ("user", "Which sea does it reach?"),
        ("assistant", "The Mediterranean."),
        ("user", "Through which country?"),
    ],
    [("user", "Hello there."), ("assistant", "Hi! " * 150), ("user", "Tell me more.")],
]


def test_reuse_modes_compute_only_the_newest_turns(tiny: LoadedModel) -> None:
    out = run_chat_bench(tiny, ("full", "prefix"), conversations=CHATS, max_tokens=2)
    full, prefix = out["modes"]["full"], out["modes"]["prefix"]
    assert full["requests"] == prefix["requests"] == 5  # one per user turn
    assert full["prompt_tokens"] == prefix["prompt_tokens"]
    assert full["computed_fraction"] == 1.0
    # first turns have no history: everything computed; later turns reuse the closed chunks
    # of the turns before (the first conversation's long opening turn and reply)
    assert prefix["computed_tokens"] < 0.8 * prefix["prompt_tokens"]
    assert set(prefix["ttft_ms_p50_by_user_turn"]) == {"0", "1", "2"}


def test_chat_workload_sends_each_turn_after_the_ones_before() -> None:
    items = chat_workload(30, active=4)
    assert len(items) == 30 and len({it.id for it in items}) == 30
    seen: dict[str, int] = {}
    for it in items:
        conv, turn = it.id.split("/t")
        assert int(turn) > seen.get(conv, -1)  # a conversation's turns in order
        seen[conv] = int(turn)
        # every earlier turn is in the request, as chunks of whole turns (and of the context
        # pasted into a user turn: labels with ".paragraphs"), none empty
        history = [c for c in it.request.chunks if ".paragraphs" not in (c.id or "")]
        assert bool(history) == (int(turn) > 0)
        assert all(c.id and c.id.startswith("messages[") for c in it.request.chunks)
    assert max(seen.values()) >= 2  # conversations went on past their first turn
