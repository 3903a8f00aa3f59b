"""Incremental detokenization and stop strings, with a toy character tokenizer."""

from __future__ import annotations

from hybridspec.engine.detokenizer import IncrementalDetokenizer


class CharTokenizer:
    """Token i is chr(ord('a') + i); token 26 is a space; 27 half of a two-token 'é'."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        out = []
        for i, t in enumerate(ids):
            if t == 27:
                out.append("é" if i + 1 < len(ids) and ids[i + 1] == 28 else "\ufffd")
            elif t == 28:
                continue
            else:
                out.append(" " if t == 26 else chr(ord("a") + t))
        return "".join(out)


def ids(text: str) -> list[int]:
    return [26 if c == " " else ord(c) - ord("a") for c in text]


def test_text_accumulates_token_by_token() -> None:
    detok = IncrementalDetokenizer(CharTokenizer(), ids("xy"), ())
    for t in ids("hello world"):
        assert not detok.append(t)
    assert detok.text == "hello world"
    assert detok.stream_text() == "hello world"


def test_stop_string_cuts_text_and_reports_stop() -> None:
    detok = IncrementalDetokenizer(CharTokenizer(), [0], ("lo w",))
    hits = [detok.append(t) for t in ids("hello world")[:7]]
    assert hits == [False] * 6 + [True]
    assert detok.text == "hel"


def test_stream_withholds_a_possible_stop_prefix() -> None:
    detok = IncrementalDetokenizer(CharTokenizer(), [0], ("cat",))
    for t in ids("abca"):
        detok.append(t)
    assert detok.stream_text() == "ab"  # "ca" could begin "cat"
    detok.append(ids("b")[0])
    assert detok.stream_text() == "cab"  # "cab" cannot
    assert detok.stream_text(final=True) == ""


def test_unfinished_multibyte_character_waits_for_next_token() -> None:
    detok = IncrementalDetokenizer(CharTokenizer(), [0], ())
    detok.append(27)
    assert detok.text == ""
    detok.append(28)
    assert detok.text == "é"
