"""TextStream at the end of an answer cut by `length` (issue 13, defect 11): a multi-byte
character whose last bytes were never generated is dropped, never shown as U+FFFD."""

from __future__ import annotations

from cachecraft.engine.text import TextStream
from cachecraft.model.loader import LoadedModel


def test_a_cut_multibyte_character_is_dropped_not_replaced(tiny: LoadedModel) -> None:
    tok = tiny.tokenizer
    ids = tok("Answer: 龘", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids[:-1]).endswith("\ufffd")  # the last byte token completes the char
    stream = TextStream(tok)
    shown = "".join(stream.add(i) for i in ids[:-1]) + stream.flush()
    assert shown == "Answer: "  # before the fix: "Answer: \ufffd"
    assert stream.final_text() == "Answer:"
    whole = TextStream(tok)
    assert "".join(whole.add(i) for i in ids) + whole.flush() == "Answer: 龘"


def test_include_stop_keeps_the_earliest_stop_string(tiny: LoadedModel) -> None:
    tok = tiny.tokenizer
    ids = tok("one two. three", add_special_tokens=False)["input_ids"]
    for include, want in ((False, "one two"), (True, "one two.")):
        stream = TextStream(tok, (". ", "three", "."), include_stop=include)
        shown = "".join(stream.add(i) for i in ids) + stream.flush()
        assert stream.stopped and shown == want and stream.final_text() == want
