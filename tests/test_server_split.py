"""Pasted context -> chunk-caches (server/split.py `pasted_chunks`, `history_chunks`), and how
the server's request conversion uses it: the rules on plain strings, the prompt a pasted RAG
request lays out (the tokenizer only), and live servers on the tiny random Llama reusing
pasted passages across requests and chat turns."""

from __future__ import annotations

import copy
from collections.abc import Callable

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_server import client

from cachecraft.api import chat_request, prompt_token_ids
from cachecraft.model.loader import LoadedModel
from cachecraft.request import Chunk, RagRequest
from cachecraft.reuse.layout import SYSTEM_END, build_layout
from cachecraft.server.config import ServerConfig
from cachecraft.server.convert import to_rag
from cachecraft.server.launch import start_server
from cachecraft.server.protocol import ChatCompletionRequest, CompletionRequest
from cachecraft.server.split import history_chunks, pasted_chunks
from cachecraft.store.config import StoreConfig

PASSAGES = [
    "The Danube rises in the Black Forest and flows east for 2,850 km through ten countries, "
    "more than any other river in the world, before it reaches the Black Sea in Romania. "
    "Vienna, Bratislava, Budapest and Belgrade all stand on its banks, and it was once a "
    "frontier of the Roman Empire.",
    "Marie Curie was the first person to win Nobel Prizes in two sciences: physics in 1903, "
    "shared with Pierre Curie and Henri Becquerel, and chemistry in 1911 for the discovery of "
    "polonium and radium. She founded the Radium Institute in Paris and died there in 1934.",
    "The Great Barrier Reef, off the coast of Queensland, is the largest coral reef system on "
    "Earth: nearly 3,000 reefs and 900 islands over some 344,400 square kilometres. It can be "
    "seen from space and has been a World Heritage Site since 1981; bleaching threatens it.",
]


def rag_prompt(passages: list[str], question: str) -> str:
    """A RAG client's prompt template: an instruction, the passages, the question."""
    context = "\n\n".join(passages)
    return f"Use the context below.\n\n{context}\n\nQuestion: {question}"


def test_each_long_paragraph_is_a_chunk_after_the_preamble() -> None:
    text = rag_prompt(PASSAGES, "Which river?") + "\n\n"
    chunks, rest = pasted_chunks(text, "messages[1]")
    assert [c.text for c in chunks] == ["Use the context below.", *PASSAGES]
    assert [c.id for c in chunks] == [f"messages[1].paragraphs[{k}]" for k in range(4)]
    assert rest == "Question: Which river?\n\n"  # the exact tail: trailing blank lines kept
    # nothing is lost: the chunks and the rest are the text, blank lines between them
    assert "\n\n".join([c.text for c in chunks] + [rest]) == text


def test_short_paragraphs_join_the_next_long_one() -> None:
    text = "\n\n".join(["Sources:", "[1] Curie", PASSAGES[1], "[2] Reef", PASSAGES[2], "Q?"])
    chunks, rest = pasted_chunks(text, "prompt")
    assert [c.text for c in chunks] == [
        "Sources:",  # before the first passage and its label: the preamble
        "[1] Curie\n\n" + PASSAGES[1],  # a label goes with the passage after it, as the
        "[2] Reef\n\n" + PASSAGES[2],  # later passages show: one short line heads each
    ]
    assert [c.id for c in chunks] == [
        "prompt.paragraphs[0]",
        "prompt.paragraphs[1:3]",
        "prompt.paragraphs[3:5]",
    ]
    assert rest == "Q?"
    alone, _ = pasted_chunks("\n\n".join(["Sources:", "[1] Curie", PASSAGES[1], "Q?"]), "m")
    assert [c.text for c in alone] == ["Sources:\n\n[1] Curie", PASSAGES[1]]  # no evidence


def test_a_passage_is_the_same_chunk_wherever_it_is_pasted() -> None:
    a, _ = pasted_chunks("\n\n".join([PASSAGES[0], PASSAGES[1], "Q?"]), "m")
    b, _ = pasted_chunks("\n\n".join([PASSAGES[2], PASSAGES[1], PASSAGES[0], "Q?"]), "m")
    assert {c.text for c in a} <= {c.text for c in b}


def test_a_long_line_is_a_paragraph_and_wrapped_lines_are_not() -> None:
    text = "Context:\n" + "\n".join(PASSAGES) + "\nQuestion: Which river?"
    chunks, rest = pasted_chunks(text, "m")
    assert [c.text for c in chunks] == ["Context:", *PASSAGES]
    assert rest == "Question: Which river?"
    # LlamaIndex's question-answering prompt: the first passage is not glued to the heading;
    # a label line still goes with the passage under it
    rule = "---------------------"
    ask = "Given the context information and not prior knowledge, answer the query.\nQuery: Q?"
    body = "\n".join([*PASSAGES[:2], "[3] Reef", PASSAGES[2]])
    text = f"Context information is below.\n{rule}\n{body}\n{rule}\n{ask}\nAnswer: "
    chunks, rest = pasted_chunks(text, "m")
    assert [c.text for c in chunks] == [
        f"Context information is below.\n{rule}",
        *PASSAGES[:2],
        "[3] Reef\n" + PASSAGES[2],
    ]
    assert rest == f"{rule}\n{ask}\nAnswer: "
    wrapped = "\n".join(PASSAGES[0][i : i + 70] for i in range(0, len(PASSAGES[0]), 70))
    chunks, rest = pasted_chunks(f"{wrapped}\n\nQ?", "m")
    assert [c.text for c in chunks] == [wrapped] and rest == "Q?"  # one paragraph of short lines


@pytest.mark.parametrize(
    "head",
    [
        lambda i: "",  # no heading
        lambda i: f"Source {i}\n",  # a title line right above
        lambda i: f"file_path: doc{i}.txt\n\n",  # LlamaIndex's metadata, a blank line between
    ],
)
def test_the_first_passage_is_headed_as_the_later_ones(head: Callable[[int], str]) -> None:
    """LlamaIndex's question-answering template writes its heading straight above the first
    passage: whatever heads each passage (as the later ones show) is that passage's chunk at
    every rank, and the heading alone is the preamble."""
    rule = "---------------------"

    def prompt(order: list[int]) -> str:
        body = "\n\n".join(head(i) + PASSAGES[i] for i in order)
        return f"Context information is below.\n{rule}\n{body}\n{rule}\nQuery: Q?\nAnswer: "

    a, _ = pasted_chunks(prompt([0, 1, 2]), "m")
    b, _ = pasted_chunks(prompt([2, 0, 1]), "m")
    assert a[0].text == b[0].text == f"Context information is below.\n{rule}"
    assert sorted(c.text for c in a[1:]) == sorted(c.text for c in b[1:])
    assert [c.text for c in a[1:]] == [head(i) + PASSAGES[i] for i in (0, 1, 2)]


def test_a_paragraph_keeps_its_indentation_and_leading_blank_lines_are_dropped() -> None:
    code = "    " + PASSAGES[0]
    chunks, rest = pasted_chunks(f" \n\n{PASSAGES[1]}\n \n\n{code}\n\n  Q?", "m")
    assert [c.text for c in chunks] == [PASSAGES[1], code] and rest == "  Q?"


def test_the_last_paragraph_is_always_the_question() -> None:
    chunks, rest = pasted_chunks("\n\n".join(PASSAGES), "prompt")
    assert [c.text for c in chunks] == PASSAGES[:2] and rest == PASSAGES[2]
    chunks, rest = pasted_chunks(PASSAGES[0] + "\n\n \n\t\n\n", "prompt")
    assert chunks == [] and rest == PASSAGES[0] + "\n\n \n\t\n\n"  # blank tail: no question


PARAGRAPH = st.sampled_from(["Q?", "Sources:", "[1] Curie", " ", "x" * 255, *PASSAGES])
SEPARATOR = st.sampled_from(["\n", "\n\n", "\n\n\n", "\n \n", "\n\t\n  \n"])


@settings(deadline=None)  # correctness only: a busy machine must not fail it on time
@given(
    st.lists(st.tuples(PARAGRAPH, SEPARATOR), min_size=1, max_size=9),
    st.integers(0, 400),
    st.booleans(),
)
def test_cutting_keeps_the_text_and_every_long_paragraph_ends_a_chunk(
    parts: list[tuple[str, str]], max_chars: int, keep_question: bool
) -> None:
    text = "".join(p + sep for p, sep in parts[:-1]) + parts[-1][0]
    cap = max_chars or None
    chunks, rest = pasted_chunks(text, "m", max_chars=cap, keep_question=keep_question)
    # chunks are slices of the text, in order, and the rest is its tail
    at = 0
    for c in chunks:
        found = text.index(c.text, at)
        assert text[at:found].strip() == "" and c.text.strip()
        assert max_chars == 0 or len(c.text) <= max_chars
        at = found + len(c.text)
    assert text.endswith(rest) and text[at : len(text) - len(rest)].strip() == ""
    if max_chars:
        return
    if not keep_question:  # uncapped, a system message is all chunks or not cut at all
        assert not rest.strip() if chunks else rest == text
    if any(sep == "\n" for _, sep in parts[:-1]):
        return  # a short line and the next are one paragraph: the parts are not paragraphs
    # each long paragraph but the question's ends a chunk of its own
    non_blank = [p for p, _ in parts if p.strip()]
    longs = [p for p in (non_blank[:-1] if keep_question else non_blank) if len(p) >= 256]
    if keep_question:
        assert rest.strip() or not non_blank
        trailing = 0
    elif longs:  # all of it is chunks, the short paragraphs after the last long one too
        assert not rest.strip()
        trailing = int(non_blank[-1] is not longs[-1] and len(non_blank[-1]) < 256)
    else:
        assert (chunks, rest) == ([], text)  # not cut at all
        return
    preamble = len(chunks) - len(longs) - trailing
    assert preamble in (0, 1)  # the short paragraphs before the first long one
    ends = chunks[preamble : len(chunks) - trailing]
    assert all(c.text.endswith(p) for c, p in zip(ends, longs, strict=True))


@pytest.mark.parametrize(
    ("text", "kwargs"),
    [
        (" ".join(PASSAGES) + " Q?", {}),  # no blank line: one paragraph
        ("\n\n".join([*PASSAGES, "Q?"]), {"min_chars": 0}),  # switched off
        ("\n\n".join([" " * 400 + "\nx", "Q?"]), {}),  # long only in white space
    ],
)
def test_no_chunks(text: str, kwargs: dict[str, int]) -> None:
    assert pasted_chunks(text, "prompt", **kwargs) == ([], text)


def test_an_oversized_chunk_and_all_after_it_stay_in_the_question() -> None:
    long = PASSAGES[1] * 3
    text = "\n\n".join([PASSAGES[0], long, PASSAGES[2], "Q?"])
    chunks, rest = pasted_chunks(text, "prompt", max_chars=len(long) - 1)
    assert [c.text for c in chunks] == [PASSAGES[0]]  # order kept: nothing after the big one
    assert rest == "\n\n".join([long, PASSAGES[2], "Q?"])


def test_a_system_message_is_all_chunks_or_none() -> None:
    """The context a client puts in its system message: every paragraph is in a chunk, the
    short ones after the last passage (an instruction) one of their own."""
    text = "\n\n".join(["Answer from the context.", *PASSAGES[:2], "Say so if unsure."])
    chunks, rest = pasted_chunks(text, "system", keep_question=False)
    assert [c.text for c in chunks] == [
        "Answer from the context.",
        *PASSAGES[:2],
        "Say so if unsure.",
    ]
    assert [c.id for c in chunks] == [f"system.paragraphs[{k}]" for k in range(4)]
    assert rest == ""
    chunks, rest = pasted_chunks("\n\n".join(PASSAGES), "system", keep_question=False)
    assert [c.text for c in chunks] == PASSAGES and rest == ""
    short = "You are a helpful assistant.\n\nBe brief."
    assert pasted_chunks(short, "system", keep_question=False) == ([], short)


def test_system_context_becomes_system_chunks() -> None:
    system = "\n\n".join(["Use the context.", *PASSAGES[:2]])
    body = {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Who?"}]
    }
    rag = to_rag(ChatCompletionRequest(model="m", **body), "default")
    assert [c.text for c in rag.system_chunks] == ["Use the context.", *PASSAGES[:2]]
    assert rag.system == "" and rag.chunks == () and rag.question == "Who?"
    whole = to_rag(
        ChatCompletionRequest(model="m", **body), "d", ServerConfig(max_document_chars=200)
    )
    assert whole.system == system and whole.system_chunks == ()  # a passage too big: not cut
    off = to_rag(ChatCompletionRequest(model="m", **body), "d", ServerConfig(pasted_chunk_chars=0))
    assert off.system == system and off.system_chunks == ()


def test_system_chunks_lay_out_inside_the_system_turn(tiny: LoadedModel) -> None:
    """The prompt is the chat template's rendering of the client's system message (with a
    blank line after its last chunk); the template's end of the system turn is a slot."""
    tokenizer = tiny.tokenizer
    system = "\n\n".join(["Use the context.", *PASSAGES[:2]])
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Who?"}]
    rag = chat_request(messages)
    layout = build_layout(rag, tokenizer, fingerprint="f")
    labels = [*(f"system.paragraphs[{k}]" for k in range(3)), SYSTEM_END]
    assert [c.label for c in layout.chunks] == labels
    rendered = [{"role": "system", "content": system + "\n\n"}, *messages[1:]]
    rendered[1] = {"role": "user", "content": "Question: Who?"}
    want = tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(layout.token_ids) == want
    # the same passage is the same chunk-cache in the system message and in a user message
    pasted = build_layout(RagRequest("Who?", [PASSAGES[1]]), tokenizer, fingerprint="f")
    assert pasted.chunks[0].key == layout.chunks[2].key
    # a template that does not render the system message first: the chunks open the user turn
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = (
        "{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}{% endif %}{% endfor %}"
    )
    fallback = build_layout(rag, plain, fingerprint="f")
    assert [c.key for c in fallback.chunks] == [c.key for c in layout.chunks[:3]]
    assert plain.decode(fallback.token_ids) == system + "\n\nQuestion: Who?"


def test_history_cuts_a_user_turn_as_it_was_cut_when_it_was_the_question() -> None:
    asked = rag_prompt(PASSAGES[:2], "Who?")
    now, question = pasted_chunks(asked, "messages[2]")
    turns = [(0, "user", "Hi."), (1, "assistant", "Hello."), (2, "user", asked)]
    before = history_chunks(turns[:2])
    assert [c.id for c in before] == ["messages[0:2]"]  # the open chunk when turn 2 was asked
    after = history_chunks([*turns, (3, "assistant", "Curie.")])
    assert after[: len(before)] == before  # closed by the pasted context as by the end then
    assert after[len(before) : -1] == now
    assert after[-1] == Chunk(f"user: {question}\nassistant: Curie.", "messages[2:4]")
    # a tool's result is cut too; an assistant's reply never
    passages = "\n\n".join(PASSAGES)
    tool = history_chunks(
        [(0, "user", "Find it."), (1, "tool", passages), (2, "assistant", passages)]
    )
    assert [c.text for c in tool] == [
        "user: Find it.",
        *PASSAGES[:2],
        f"tool: {PASSAGES[2]}\nassistant: {passages}",
    ]
    # a turn without pasted context is gathered as before
    plain = history_chunks([(0, "user", "Hi."), (1, "assistant", "Hello."), (2, "user", "Hm.")])
    assert [c.text for c in plain] == ["user: Hi.\nassistant: Hello.\nuser: Hm."]


def test_a_pasted_rag_prompt_lays_out_as_its_documents_would(tiny: LoadedModel) -> None:
    """Passages pasted with blank lines between them, the question last, make the prompt
    that the same passages sent as `documents` make: same chunks, same token ids."""
    documents = RagRequest("Which river?", [Chunk(p) for p in PASSAGES], system="Be brief.")
    pasted = chat_request(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "\n\n".join([*PASSAGES, "Which river?"])},
        ]
    )
    assert [c.text for c in pasted.chunks] == PASSAGES and pasted.question == "Which river?"
    tokenizer = tiny.tokenizer
    assert prompt_token_ids(pasted, tokenizer) == prompt_token_ids(documents, tokenizer)


def test_a_question_that_says_question_gets_no_second_lead(tiny: LoadedModel) -> None:
    asked, plain = RagRequest("Question: Who?", PASSAGES[:1]), RagRequest("Who?", PASSAGES[:1])
    assert prompt_token_ids(asked, tiny.tokenizer) == prompt_token_ids(plain, tiny.tokenizer)


def test_text_parts_are_paragraphs() -> None:
    parts = [{"type": "text", "text": t} for t in [*PASSAGES, "Which river?"]]
    rag = chat_request([{"role": "user", "content": parts}])
    assert [c.text for c in rag.chunks] == PASSAGES and rag.question == "Which river?"


def test_documents_then_pasted_chunks_and_the_switch() -> None:
    body = CompletionRequest(prompt=rag_prompt(PASSAGES[:2], "Who?"), documents=[{"text": "D."}])
    rag = to_rag(body, "default")
    labels = [None, *(f"prompt.paragraphs[{k}]" for k in range(3))]
    assert [c.id for c in rag.chunks] == labels
    assert rag.question == "Question: Who?"
    off = to_rag(body, "default", ServerConfig(pasted_chunk_chars=0))
    assert [c.text for c in off.chunks] == ["D."] and off.question == body.prompt
    with pytest.raises(ValueError, match="pasted_chunk_chars"):
        ServerConfig(pasted_chunk_chars=-1)


def test_passages_pasted_in_a_new_order_are_reused(tiny: LoadedModel) -> None:
    """A RAG client that pastes its passages into the message: the second request pastes the
    first one's two passages in another order after a new one, and the server reuses the
    instruction in front of them exactly and both passages at their new positions; the new
    one was precomputed through /v1/chunks as a document, and is the same chunk-cache."""
    exact = StoreConfig(storage_dtype="float32")

    def ask(url: str, passages: list[str], question: str) -> openai.types.chat.ChatCompletion:
        return client(url).chat.completions.create(
            model="cachecraft",
            messages=[{"role": "user", "content": rag_prompt(passages, question)}],
            max_tokens=6,
            temperature=0,
        )

    with start_server("cachecraft", loaded=tiny, store=exact) as base:
        first = ask(base, PASSAGES[:2], "Who won two Nobel Prizes?")
        chunks = first.usage.model_extra["cachecraft"]["chunks"]
        assert len(chunks) == 3 and not any(c["is_hit"] for c in chunks)
        precomputed = httpx.post(base + "/v1/chunks", json={"documents": [{"text": PASSAGES[2]}]})
        assert precomputed.status_code == 200
        second = ask(base, [PASSAGES[2], PASSAGES[1], PASSAGES[0]], "Where is the reef?")
        report = second.usage.model_extra["cachecraft"]["chunks"]
        assert [c["is_hit"] for c in report] == [True, True, True, True]
        preamble = report[0]
        assert preamble["is_exact"] and preamble["tokens_recomputed"] == 0  # same place
        hits = [c for c in report if c["is_hit"]]
        assert all(c["tokens_recomputed"] < c["num_tokens"] for c in hits)
        reused = sum(c["num_tokens"] - c["tokens_recomputed"] for c in hits)
        assert second.usage.prompt_tokens_details.cached_tokens >= reused


def test_a_chat_reuses_the_context_pasted_into_its_earlier_turn_exactly(tiny: LoadedModel) -> None:
    """The next request of a RAG chat carries the earlier turn's pasted passages in its
    history: cut as they were then, at the same place, so reused exactly."""
    exact = StoreConfig(storage_dtype="float32")
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": rag_prompt(PASSAGES[:2], "Who won two Nobel Prizes?")},
        {"role": "assistant", "content": "Marie Curie."},
        {"role": "user", "content": "In which years?"},
    ]
    with start_server("cachecraft", loaded=tiny, store=exact) as base:

        def turn(n: int) -> list[dict[str, object]]:
            return (
                client(base)
                .chat.completions.create(
                    model="cachecraft", messages=chat[:n], max_tokens=4, temperature=0
                )
                .usage.model_extra["cachecraft"]["chunks"]
            )

        first = turn(2)
        assert [c["label"] for c in first] == [f"messages[1].paragraphs[{k}]" for k in range(3)]
        second = turn(4)
        assert [c["label"] for c in second] == [c["label"] for c in first] + ["messages[1:3]"]
        for c in second[:3]:
            assert c["is_hit"] and c["is_exact"] and c["tokens_recomputed"] == 0


def test_context_in_the_system_message_is_reused(tiny: LoadedModel) -> None:
    """LangChain's retrieval chain puts the passages in the system message: the server reuses
    them in a new order, and exactly in the chat's next turn."""
    exact = StoreConfig(storage_dtype="float32")

    def system(passages: list[str]) -> dict[str, str]:
        context = "\n\n".join(passages)
        return {"role": "system", "content": f"Answer from the context.\n\n{context}"}

    with start_server("cachecraft", loaded=tiny, store=exact) as base:

        def ask(messages: list[dict[str, str]]) -> list[dict[str, object]]:
            reply = client(base).chat.completions.create(
                model="cachecraft", messages=messages, max_tokens=4, temperature=0
            )
            return reply.usage.model_extra["cachecraft"]["chunks"]

        first = [system(PASSAGES[:2]), {"role": "user", "content": "Who won two Nobel Prizes?"}]
        report = ask(first)
        assert [c["label"] for c in report] == [
            *(f"system.paragraphs[{k}]" for k in range(3)),
            SYSTEM_END,
        ]
        assert not any(c["is_hit"] for c in report)
        report = ask([system(PASSAGES[::-1]), {"role": "user", "content": "Where is the reef?"}])
        assert [c["is_hit"] for c in report] == [True, False, True, True, True]
        assert report[0]["is_exact"] and report[0]["tokens_recomputed"] == 0
        chat = [
            *first,
            {"role": "assistant", "content": "Curie."},
            {"role": "user", "content": "When?"},
        ]
        report = ask(chat)
        assert all(c["is_hit"] and c["tokens_recomputed"] == 0 for c in report[:4])
