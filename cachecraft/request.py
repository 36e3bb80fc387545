"""RagRequest and Chunk: what a caller hands to `LLM.generate` (validated on construction)."""

from __future__ import annotations

from dataclasses import dataclass, field

from cachecraft.errors import BadRequestError

DEFAULT_SYSTEM = "You are a helpful assistant. Answer the question using the documents."


def _check_unicode(what: str, text: str) -> None:
    """A lone surrogate ("\\ud800") cannot be encoded, so no tokenizer can take it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRequestError(
            f"{what} is not valid Unicode (a lone surrogate at position {e.start})"
        ) from None


@dataclass(frozen=True, slots=True)
class Chunk:
    """One retrieved passage. `id` is a label for reports, never the cache key.

    `as_question`: laid out as a question is (`Question: ` and the text, its leading token
    blocks chunk slots of their own, `reuse/layout.py`): a long user turn in a chat's history
    then gives the very blocks it lent when it was the question."""

    text: str
    id: str | None = None
    as_question: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.text, str):
            raise BadRequestError(f"chunk text must be a string, got {type(self.text).__name__}")
        if not self.text.strip():
            raise BadRequestError("chunk text is empty")
        if self.id is not None and not isinstance(self.id, str):
            raise BadRequestError(f"chunk id must be a string, got {type(self.id).__name__}")
        _check_unicode("chunk text", self.text)


@dataclass(frozen=True, slots=True)
class RagRequest:
    """[system prefix][chunk 1]...[chunk k][question]. No chunks is fine; no question is not.

    `system_chunks`: context the system message carries after `system` (retrieved passages a
    client put there): chunk-caches like `chunks`, laid out inside the system turn.

    `raw`: `question` is the whole prompt, read as given (no chat template, no system prompt,
    no `Question: `; tokenized as vLLM tokenizes a completion's prompt), as a plain language
    model continues it; no chunks. `prompt_ids`: a raw prompt given as token ids (implies
    `raw`; `question` is then only a label, and may be empty)."""

    question: str
    chunks: tuple[Chunk, ...] = field(default_factory=tuple)
    system: str = DEFAULT_SYSTEM
    namespace: str = "default"
    system_chunks: tuple[Chunk, ...] = field(default_factory=tuple)
    raw: bool = False
    prompt_ids: tuple[int, ...] = ()

    def __init__(
        self,
        question: str,
        chunks: list[Chunk] | tuple[Chunk, ...] | list[str] = (),
        system: str | None = None,
        namespace: str = "default",
        system_chunks: list[Chunk] | tuple[Chunk, ...] | list[str] = (),
        *,
        raw: bool = False,
        prompt_ids: list[int] | tuple[int, ...] = (),
    ) -> None:
        ids = _token_ids(prompt_ids)
        if not isinstance(question, str) or not (question.strip() or ids):
            raise BadRequestError("the question is empty")
        items = _chunk_tuple(chunks, "chunks")
        if system is not None and not isinstance(system, str):
            raise BadRequestError("system must be a string")
        if not isinstance(namespace, str) or not namespace:
            raise BadRequestError("namespace must be a non-empty string")
        _check_unicode("the question", question)
        if system is not None:
            _check_unicode("system", system)
        _check_unicode("namespace", namespace)
        object.__setattr__(self, "question", question)
        object.__setattr__(self, "chunks", items)
        object.__setattr__(self, "system", DEFAULT_SYSTEM if system is None else system)
        object.__setattr__(self, "namespace", namespace)
        object.__setattr__(self, "system_chunks", _chunk_tuple(system_chunks, "system_chunks"))
        object.__setattr__(self, "raw", bool(raw or ids))
        object.__setattr__(self, "prompt_ids", ids)
        if self.raw and (self.chunks or self.system_chunks):
            raise BadRequestError("a raw prompt has no chunks (it is read as given)")


def _token_ids(ids: object) -> tuple[int, ...]:
    if isinstance(ids, str | bytes) or not isinstance(ids, list | tuple):
        raise BadRequestError("prompt_ids must be a list of token ids")
    if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
        raise BadRequestError("prompt_ids: give token ids >= 0")
    return tuple(ids)


def _chunk_tuple(chunks: object, what: str) -> tuple[Chunk, ...]:
    if isinstance(chunks, str | bytes) or not isinstance(chunks, list | tuple):
        raise BadRequestError(f"{what} must be a list of Chunk or str")
    return tuple(c if isinstance(c, Chunk) else Chunk(c) for c in chunks)
