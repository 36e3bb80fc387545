"""TextStream: incremental detokenization with stop strings (the server and `answer` share it).

A stop string ends the answer just before its first occurrence (or right after it, with
`include_stop`: vLLM's `include_stop_str_in_output`); text that could still turn into one is
held back until it cannot, so a streamed answer never shows part of a stop string. Special
tokens are left out of the text unless `skip_special` is False (vLLM's `skip_special_tokens`).
"""

from __future__ import annotations

from typing import Any


class TextStream:
    """Incremental detokenization: the new text after each token. Text is held back while it
    ends inside a multi-byte character or with the start of a stop string; once a stop string
    appears the text ends before it (`stopped`) and later tokens are ignored."""

    def __init__(
        self,
        tokenizer: Any,
        stops: tuple[str, ...] = (),
        include_stop: bool = False,
        skip_special: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.stops = tuple(s for s in stops if s)
        self.include_stop = include_stop
        self.skip_special = skip_special
        self.ids: list[int] = []
        self.sent = ""
        self.stopped = False

    def add(self, token_id: int) -> str:
        if self.stopped:
            return ""
        self.ids.append(token_id)
        text = self._decode()
        if text.endswith("\ufffd"):
            return ""
        found = [(i, -len(s)) for s in self.stops if (i := text.find(s)) >= 0]
        if found:  # the earliest stop string; of two there, the longer
            cut, minus_len = min(found)
            self.stopped, text = True, text[: cut - minus_len if self.include_stop else cut]
        else:
            text = text[: len(text) - self._held(text)]
        if len(text) <= len(self.sent):
            return ""
        delta, self.sent = text[len(self.sent) :], text
        return delta

    def _held(self, text: str) -> int:
        """Length of the longest end of `text` that begins some stop string."""
        held = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), held, -1):
                if stop.startswith(text[-n:]):
                    held = n
                    break
        return held

    def _final(self) -> str:
        """All text at the end; a multi-byte character cut by the end of the answer (a
        `length` finish) is dropped rather than shown as U+FFFD."""
        return self._decode().rstrip("\ufffd")

    def _decode(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special).lstrip()

    def flush(self) -> str:
        """At the end: the text held back for a stop string that never came."""
        if self.stopped:
            return ""
        text = self._final()
        delta, self.sent = text[len(self.sent) :], text
        return delta

    def final_text(self) -> str:
        if self.stopped:
            return self.sent if self.include_stop else self.sent.rstrip()
        return self._final().strip()
