"""Serving traces: Poisson arrivals, chat bodies for our server, token-id prompts for vLLM."""

from __future__ import annotations

import numpy as np
import pytest
from transformers import AutoTokenizer

from cachecraft.api import chat_request
from cachecraft.errors import BadRequestError
from cachecraft.model.loader import resolve_model_dir
from cachecraft.request import Chunk, RagRequest
from cachecraft.reuse.layout import build_layout
from cachecraft_bench.item import WorkloadItem
from cachecraft_bench.trace import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    as_served,
    layout_token_ids,
    poisson_arrivals,
    rag_trace,
    vllm_trace,
)


@pytest.fixture(scope="module")
def tokenizer() -> object:
    return AutoTokenizer.from_pretrained(resolve_model_dir(None))


def _items() -> list[WorkloadItem]:
    a = Chunk("Paris\nParis is the capital of France.", "c-paris")
    b = Chunk("Rome\nRome is the capital of Italy, on the Tiber.", "c-rome")
    c = Chunk("Oslo is in Norway.")
    return [
        WorkloadItem("q0", RagRequest("What is the capital of France?", [a, b]), ("Paris",), 0.0),
        WorkloadItem("q1", RagRequest("Which river?", [b, c, a], namespace="t1"), None, 1.5),
        WorkloadItem("q2", RagRequest("Norway?", [c]), None, 4.0),
    ]


def test_poisson_arrivals_deterministic_with_the_right_mean_gap() -> None:
    a = poisson_arrivals(20_000, 4.0, seed=7)
    assert a == poisson_arrivals(20_000, 4.0, seed=7)
    assert a != poisson_arrivals(20_000, 4.0, seed=8)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:], strict=False))
    gaps = np.diff(a)
    assert abs(gaps.mean() - 0.25) < 0.01
    assert abs(gaps.std() - 0.25) < 0.015  # exponential: std == mean
    assert poisson_arrivals(0, 1.0, 0) == [] and poisson_arrivals(1, 1.0, 0) == [0.0]


@pytest.mark.parametrize(("n", "rate"), [(-1, 1.0), (3, 0.0), (3, -2.0)])
def test_poisson_arrivals_rejects_bad_input(n: int, rate: float) -> None:
    with pytest.raises(BadRequestError):
        poisson_arrivals(n, rate, 0)


def test_rag_trace_bodies_carry_documents_mode_and_streaming() -> None:
    items = _items()
    trace = rag_trace(items, rate=2.0, seed=3, mode="cachecraft", max_tokens=12)
    assert [t.arrival_s for t in trace] == poisson_arrivals(3, 2.0, 3)
    assert [t.id for t in trace] == ["q0", "q1", "q2"] and {t.path for t in trace} == {CHAT_PATH}
    body = trace[1].body
    assert body["messages"] == [
        {"role": "system", "content": items[1].request.system},
        {"role": "user", "content": "Which river?"},
    ]
    assert body["documents"] == [
        {"id": "c-rome", "text": items[0].request.chunks[1].text},
        {"text": "Oslo is in Norway."},
        {"id": "c-paris", "text": items[0].request.chunks[0].text},
    ]
    assert body["cachecraft_mode"] == "cachecraft" and body["cache_namespace"] == "t1"
    assert (body["temperature"], body["max_tokens"], body["stream"]) == (0, 12, True)
    assert body["stream_options"] == {"include_usage": True}
    assert "ignore_eos" not in body


def test_rag_trace_without_rate_or_mode_and_namespace_override() -> None:
    trace = rag_trace(_items(), rate=None, seed=0, namespace="run-1", ignore_eos=True)
    assert [t.arrival_s for t in trace] == [0.0, 1.5, 4.0]
    assert all("cachecraft_mode" not in t.body for t in trace)
    assert {t.body["cache_namespace"] for t in trace} == {"run-1"}
    assert all(t.body["ignore_eos"] is True for t in trace)


def test_vllm_prompt_is_the_engine_layout(tokenizer: object) -> None:
    items = _items()
    trace = vllm_trace(items, 2.0, seed=3, tokenizer=tokenizer, model="peer", cache_salt="s1")
    assert [t.arrival_s for t in trace] == [t.arrival_s for t in rag_trace(items, 2.0, 3)]
    for item, req in zip(items, trace, strict=True):
        assert req.path == COMPLETIONS_PATH and req.body["model"] == "peer"
        assert req.body["cache_salt"] == "s1" and req.body["stream"] is True
        layout = build_layout(item.request, tokenizer, fingerprint="x")
        assert req.body["prompt"] == list(layout.token_ids)


def test_a_pasted_trace_sends_what_the_server_cuts_and_vllm_the_same_tokens(
    tokenizer: object,
) -> None:
    """`--client pasted`: no documents field, the passages in the user message; vLLM's prompt
    is the layout of what our server makes of that message."""
    long = Chunk("The Danube flows east through ten countries to the Black Sea. " * 5, "d")
    items = [WorkloadItem("q", RagRequest("Which sea?", [long, _items()[0].request.chunks[0]]))]
    (ours,) = rag_trace(items, None, 0, client="pasted")
    assert ours.body["documents"] == []
    messages = ours.body["messages"]
    assert [m["role"] for m in messages] == ["system", "user"]
    assert long.text in messages[1]["content"] and "Which sea?" in messages[1]["content"]
    served = chat_request(messages)
    # the long passage is a chunk of its own; the short one (after the last long one) stays
    # in the question with the template's end
    assert [c.text for c in served.chunks][1:] == [long.text]
    assert served == as_served(items[0].request, "pasted")
    (peer,) = vllm_trace(items, None, 0, tokenizer=tokenizer, client="pasted")
    assert peer.body["prompt"] == layout_token_ids(served, tokenizer)


def test_a_system_trace_puts_the_passages_in_the_system_message(tokenizer: object) -> None:
    """`--client system`: LangChain's retrieval-chain prompt; the server cuts the system
    message into chunks (its instruction and each passage), vLLM gets their layout."""
    long = Chunk("The Danube flows east through ten countries to the Black Sea. " * 5, "d")
    items = [WorkloadItem("q", RagRequest("Which sea?", [long, long.text.upper()]))]
    (ours,) = rag_trace(items, None, 0, client="system")
    assert ours.body["documents"] == []
    system, user = ours.body["messages"]
    assert long.text in system["content"] and user["content"] == "Which sea?"
    served = as_served(items[0].request, "system")
    assert [c.text for c in served.system_chunks][1:] == [long.text, long.text.upper()]
    assert served.chunks == () and served.question == "Which sea?"
    (peer,) = vllm_trace(items, None, 0, tokenizer=tokenizer, client="system")
    assert peer.body["prompt"] == layout_token_ids(served, tokenizer)


def test_a_llamaindex_trace_heads_its_first_passage_like_the_others(tokenizer: object) -> None:
    passages = [f"{t}\n{t} is a city. " + "It has a long history. " * 12 for t in ("Rome", "Oslo")]
    items = [WorkloadItem("q", RagRequest("Which is older?", passages))]
    (ours,) = rag_trace(items, None, 0, client="llamaindex")
    user = ours.body["messages"][1]["content"]
    assert user.startswith("Context information is below.") and ours.body["documents"] == []
    served = as_served(items[0].request, "llamaindex")
    # the heading alone; each titled passage a chunk of its own, the first one too
    heading = "Context information is below.\n---------------------"
    assert [c.text for c in served.chunks] == [heading, *passages]  # trailing spaces kept
    (peer,) = vllm_trace(items, None, 0, tokenizer=tokenizer, client="llamaindex")
    assert peer.body["prompt"] == layout_token_ids(served, tokenizer)


def test_layout_ids_follow_the_rule_independently(tokenizer: object) -> None:
    """Head of the template, each chunk alone as text + "\\n\\n", "Question: q" + template tail:
    the same text as the template rendered around the whole user message."""
    req = _items()[1].request
    ids = layout_token_ids(req, tokenizer)
    user = "".join(c.text + "\n\n" for c in req.chunks) + "Question: " + req.question
    messages = [{"role": "system", "content": req.system}, {"role": "user", "content": user}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(ids) == rendered

    def enc(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    head, _, tail = rendered.partition(user)
    expected = enc(head)
    for c in req.chunks:
        expected += enc(c.text + "\n\n")
    expected += enc("Question: " + req.question + tail)
    assert ids == expected
    # a chunk's ids do not depend on where it sits
    rome = enc(req.chunks[0].text + "\n\n")
    first = layout_token_ids(_items()[0].request, tokenizer)
    assert any(first[i : i + len(rome)] == rome for i in range(len(first)))
