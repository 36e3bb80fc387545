"""How a request's own text becomes chunk-caches: a chat's earlier turns (`history_chunks`)
and context pasted into the last message or a completion's prompt (`pasted_chunks`).

Clients that use the `documents` field say where each chunk begins and ends. Most clients do
not: a chat sends its whole conversation again every turn, and a RAG client (LangChain's or
LlamaIndex's prompt templates, a hand-written one) pastes its retrieved passages into one
message, separated by blank lines or one passage a line. Both rules cut only where the text
itself does (a turn, a paragraph), so the same turn or passage is the same chunk, with the
same key, in every request that carries it, wherever it stands.
"""

from __future__ import annotations

import re

from cachecraft.request import Chunk

HISTORY_CHUNK_CHARS = 512
"""Earlier turns are gathered, from the first on, into chunks of at least this many characters
(a turn is never split): one short turn ("ok", "thanks") is too small to be worth a
chunk-cache of its own, and a long chat stays a few dozen chunks. Where a chunk ends depends
only on the turns before, so the next request of a conversation closes the same chunks."""

LONG_TURN_CHARS = 512
"""A user turn whose text (after its pasted context) is this long (~110 tokens, more than the
80 a question needs to lend blocks) is laid out in the history as it was as the question
(`Chunk.as_question`): the blocks it lent then are reused, not computed a second time."""

PASTED_CHUNK_CHARS = 256
"""A paragraph of pasted text this long (~60 tokens) closes a chunk; shorter ones (a title, a
source label) join the next long one, those before the first long one (an instruction) are a
chunk of their own, but for the lines that head every passage (`pasted_chunks`). So where a
chunk ends depends on its own paragraphs (the first passage's: also on how the others are
headed), and a passage pasted after different ones is still the same chunk."""

TRAILING_BREAK = re.compile(r"(?:\n\s*)?\Z")
"""The line break (and blank lines) a slice ends in, if any."""

NEWLINES = re.compile(r"\n(?:[^\S\n]*\n)*")
"""A newline and any empty or blank lines after it (the next line's indentation is its own)."""


def _breaks(text: str, min_chars: int) -> list[tuple[int, int]]:
    """Where `text` breaks into paragraphs: at blank lines, and before and after a line of at
    least `min_chars` (a passage written on one line, as `"\n".join(passages)` pastes them,
    right under a heading such as LlamaIndex's "Context information is below.\n-----")."""
    newlines = list(NEWLINES.finditer(text))
    starts = [0] + [m.end() for m in newlines]
    ends = [m.start() for m in newlines] + [len(text)]
    long = [len(text[a:b].strip()) >= min_chars for a, b in zip(starts, ends, strict=True)]
    return [
        m.span() for i, m in enumerate(newlines) if "\n" in m.group()[1:] or long[i] or long[i + 1]
    ]


def history_chunks(
    turns: list[tuple[int, str, str]],
    pasted_chars: int = PASTED_CHUNK_CHARS,
    max_chars: int | None = None,
) -> list[Chunk]:
    """A conversation's earlier turns, (index in `messages`, role, text) in order, as chunks
    of whole turns written "role: text" (`HISTORY_CHUNK_CHARS`), labelled by the messages they
    hold. A user turn's pasted context (`pasted_chunks`) is cut into the very chunks it made
    when that turn was the question, ahead of "user: " and the rest of the turn; they close
    the turns gathered before them, as the end of the history closed them then. A tool
    result (retrieved passages, most often) is cut the same way, so a passage a tool returned
    is the same chunk in any conversation. A user turn left long after that
    (`LONG_TURN_CHARS`: a long message with no paragraphs to cut) is laid out as it was as
    the question (`Chunk.as_question`), so the token blocks it lent then are reused.

    They are chunk-caches like documents: the conversation's next request sends them again,
    unchanged, in the same order, after the same system prompt, so its closed chunks are
    reused exactly (nothing recomputed) and only the last, still open one and the question are
    computed, as a prefix cache serves a chat. They go before the documents: a conversation
    only grows at its end, while the documents may change with every question."""
    out: list[Chunk] = []
    texts: list[str] = []
    size = first = last = 0

    def close() -> None:
        nonlocal texts, size
        label = f"messages[{first}]" if first == last else f"messages[{first}:{last + 1}]"
        out.append(Chunk("\n".join(texts), label))
        texts, size = [], 0

    for i, role, text in turns:
        if role in ("user", "tool"):
            pasted, text = pasted_chunks(text, f"messages[{i}]", pasted_chars, max_chars)
            long = role == "user" and len(text.strip()) >= LONG_TURN_CHARS
            if (pasted or long) and texts:
                close()
            out.extend(pasted)
            if long:  # laid out as it was when it was the question: its blocks are reused
                out.append(Chunk(text, f"messages[{i}]", as_question=True))
                continue
        if not texts:
            first = i
        texts.append(f"{role}: {text}")
        size += len(texts[-1])
        last = i
        if size >= HISTORY_CHUNK_CHARS:
            close()
    if texts:
        close()
    return out


def _num_lines(text: str, a: int, b: int) -> int:
    """Non-blank lines in text[a:b]."""
    return sum(1 for line in text[a:b].split("\n") if line.strip())


def _last_lines(text: str, a: int, b: int, n: int) -> int:
    """Where the last `n` non-blank lines of text[a:b] begin (b when n is 0, a when there are
    fewer)."""
    pos = b
    for _ in range(n):
        end = a + len(text[a:pos].rstrip())  # the end of the last non-blank line before pos
        if end <= a:
            return a
        pos = max(a, text.rfind("\n", a, end) + 1)
    return pos


def _label_size(
    text: str, starts: list[int], ends: list[int], longs: list[int], blank: list[bool]
) -> int:
    """How many short lines head a passage in this text: the most common count of non-blank
    lines between one long paragraph and the next (a title, a metadata line, a source label;
    ties: the smaller, so no heading is glued to a passage on mixed evidence). With one long
    paragraph only, the lines of its own block (since the last blank line) above it."""
    counts = [_num_lines(text, ends[p], starts[q]) for p, q in zip(longs, longs[1:], strict=False)]
    if counts:
        return max(set(counts), key=lambda c: (counts.count(c), -c))
    k = longs[0]
    top = max((j for j in range(k) if blank[j]), default=-1) + 1  # first paragraph of its block
    return _num_lines(text, starts[top], starts[k])


def pasted_chunks(
    text: str,
    where: str,
    min_chars: int = PASTED_CHUNK_CHARS,
    max_chars: int | None = None,
    *,
    keep_question: bool = True,
) -> tuple[list[Chunk], str]:
    """(chunks, rest): the paragraphs of `text` (`_breaks`) before its last one as chunks, the
    rest as the question. A paragraph of at least `min_chars` closes a chunk together with the
    shorter ones just before it (a title, a source label), and the short text before the first
    long one is a chunk of its own (a preamble: the client's instruction, the same in every
    request; glued to the first passage it would make that passage a new chunk wherever it is
    pasted first) except for its last lines when the later passages are headed by as many
    short lines (`_label_size`): those head the first passage too, so each passage is the
    same chunk at every rank. Short paragraphs after the last long one, and the last
    paragraph, stay in the question. A chunk over `max_chars` (the server's
    `max_document_chars`) and everything after it stay in the question too.

    Chunks are exact slices of `text` and the rest is its exact tail; the line break after a
    chunk becomes the layout's one blank line. Labels name the paragraphs:
    `messages[3].paragraphs[0:2]`. `min_chars` 0: no chunks.

    `keep_question` False (a system message: all context, no question): the last paragraph
    is cut like the others and the short ones after the last long one are a last chunk, so
    the rest is empty unless `max_chars` stopped the cutting; text without a long paragraph
    is still not cut at all."""
    if min_chars <= 0:
        return [], text
    breaks = _breaks(text, min_chars)
    ends = [a for a, _ in breaks] + [len(text)]
    starts = [0] + [b for _, b in breaks]
    blank = ["\n" in text[a + 1 : b] for a, b in breaks] + [False]  # a blank line follows k
    sizes = [len(text[a:b].strip()) for a, b in zip(starts, ends, strict=True)]
    last = max((k for k, n in enumerate(sizes) if n), default=0)
    stop = last if keep_question else last + 1
    longs = [k for k in range(stop) if sizes[k] >= min_chars]
    chunks: list[Chunk] = []
    first = 0  # the first paragraph not yet in a chunk

    def close(a: int, k: int, b: int | None = None) -> bool:
        """A chunk from position a (in paragraph `first`) to the end of paragraph k (or to b)."""
        body = text[a : ends[k] if b is None else b]
        body = body[: len(body) - len(TRAILING_BREAK.search(body).group())]  # up to its line end
        lead = len(body) - len(body.lstrip())
        body = body[body.rfind("\n", 0, lead) + 1 :]  # no leading blank line; indentation kept
        if max_chars is not None and len(body) > max_chars:
            return False
        label = f"paragraphs[{k}]" if first == k else f"paragraphs[{first}:{k + 1}]"
        chunks.append(Chunk(body, f"{where}.{label}"))
        return True

    for k in longs:
        if not chunks:  # the preamble, then the first passage with the lines that head it
            cut = _last_lines(
                text, starts[first], starts[k], _label_size(text, starts, ends, longs, blank)
            )
            if text[starts[first] : cut].strip():
                pre = max(j for j in range(k) if starts[j] < cut)  # the preamble's last
                if not close(starts[first], pre, cut):
                    break
            first = max(j for j in range(k + 1) if starts[j] <= cut)
            if not close(cut, k):
                break
            first = k + 1
            continue
        if not close(starts[first], k):
            break
        first = k + 1
    else:  # no break: with keep_question False, the short paragraphs after the last long one
        if not keep_question and chunks and first <= last and close(starts[first], last):
            first = last + 1
    return chunks, text[starts[first] :] if first < len(starts) else ""
