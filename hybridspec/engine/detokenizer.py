"""Incremental detokenization and stop-string detection on committed tokens.

Decoding the whole output after every token costs O(n) per token. Instead, as in TGI and vLLM,
only a short window is decoded: ``ids[prefix_offset:]`` against ``ids[prefix_offset:read_offset]``;
the difference is the new text. A window ending in U+FFFD is an unfinished multi-byte character
and waits for the next token.

Worked example: output ids [A, B, C] with prefix_offset=1, read_offset=2 decode "B" and "BC";
the new text is "C", then prefix_offset=2, read_offset=3.
"""

from __future__ import annotations

from typing import Any

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns committed output tokens into text and finds stop strings in it.

    ``text`` is the output text so far, cut before a stop string once one is found.
    ``stream_text()`` returns new text that is safe to show: it holds back a tail that could
    still grow into a stop string.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], stop: tuple[str, ...]) -> None:
        self._tokenizer = tokenizer
        # A few prompt tokens give the first output tokens their left context (leading spaces).
        context = prompt_token_ids[-4:]
        self._ids: list[int] = list(context)
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._stop = stop
        self._max_stop_len = max((len(s) for s in stop), default=0)
        self.text = ""
        self._streamed = 0
        self.stopped = False

    def append(self, token_id: int) -> bool:
        """Add one committed token; return True when it completes a stop string."""
        assert not self.stopped, "append after a stop string was found"
        if self._tokenizer is None:
            return False
        self._ids.append(token_id)
        decode = self._tokenizer.decode
        prefix = decode(
            self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=True
        )
        full = decode(self._ids[self._prefix_offset :], skip_special_tokens=True)
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT_CHAR):
            return False
        searched_from = max(0, len(self.text) - self._max_stop_len + 1)
        self.text += full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return self._find_stop(searched_from)

    def _find_stop(self, start: int) -> bool:
        hits = [i for i in (self.text.find(s, start) for s in self._stop) if i >= 0]
        if not hits:
            return False
        self.text = self.text[: min(hits)]
        self.stopped = True
        return True

    def stream_text(self, final: bool = False) -> str:
        """New text since the last call; with ``final``, everything that is left."""
        end = len(self.text)
        if not final and not self.stopped:
            end -= self._partial_stop_suffix()
        if end <= self._streamed:
            return ""
        chunk = self.text[self._streamed : end]
        self._streamed = end
        return chunk

    def _partial_stop_suffix(self) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(self.text)), best, -1):
                if self.text.endswith(stop[:n]):
                    best = n
                    break
        return best
