"""Structured output: a request's grammar as a position-aware mask, alike for p and q.

A ``GrammarSpec`` (JSON object, JSON schema, regex or EBNF grammar) is compiled once per
engine and spec by xgrammar against the model's tokenizer (``Grammars``); each request gets a
``GrammarState``, the grammar's matcher at its committed position. ``verifier.controls`` calls
``GrammarState.mask_`` last, on the verifier's rows of p and on a sampling proposer's rows of q
alike, so verification stays exact: at verify row j the matcher looks ahead through the drafts
``d_1 .. d_j`` (accepting them), writes the allowed tokens of that position, and rolls back. The
engine cuts drafts at the first one the grammar forbids (``num_allowed``) before verification,
and commits the verified tokens to the matcher (``commit``).

xgrammar was chosen over llguidance by the per-token cost of a mask plus an advance, measured
with the SmolLM2 tokenizer (vocabulary 49152) on a JSON schema (benchmarks/RESULTS.md has the
figures; both are far below a target forward).

Worked example (schema ``{"a": enum ["x", "yy"]}``, byte tokens): committed ``{"a": "y``, drafts
``[y, ", }]``; row 0 allows only ``y``, row 1 only ``"``, row 2 only ``}``, row 3 only EOS.
``forced([])`` is the tokens of ``y"}``: the only text the grammar allows from there.

Dimensions: ``num_rows`` rows of logits, ``vocab_size`` (the model's, which may exceed the
tokenizer's), ``num_words = ceil(vocab_size / 32)`` of xgrammar's int32 bitmask.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from hybridspec.errors import GrammarError, InvalidRequestError
from hybridspec.model import as_transformers
from hybridspec.types import GrammarSpec
from hybridspec.verifier.grammar_bounds import check_bounds

if TYPE_CHECKING:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerBase

_BITS = torch.arange(32, dtype=torch.int32)
DEFAULT_CACHE_BYTES = 64 * 1024 * 1024
# xgrammar's messages start with a time and its C++ source's path ("[03:08:30] /x/y.cc:12: ").
_XGRAMMAR_PREFIX = re.compile(r"\[[\d:]+\] \S+:\d+: ")


def _clean(message: str) -> str:
    """xgrammar's error message without its time and source path, first line, at most 300
    characters."""
    first = _XGRAMMAR_PREFIX.sub("", message.strip()).splitlines()[:1]
    text = first[0] if first else "unknown error"
    return text if len(text) <= 300 else text[:300] + "..."


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[num_rows, vocab_size] bool from xgrammar's bitmask [num_rows, num_words] int32."""
    bits = (bitmask.unsqueeze(-1) >> _BITS) & 1  # [num_rows, num_words, 32]
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def bitmask_of(tokens: Iterable[int], vocab_size: int) -> torch.Tensor:
    """xgrammar's bitmask row [num_words] int32 allowing exactly ``tokens``."""
    words = [0] * ((vocab_size + 31) // 32)
    for token in tokens:
        words[token // 32] |= 1 << (token % 32)
    signed = [w - (1 << 32) if w >= 1 << 31 else w for w in words]  # as int32
    return torch.tensor(signed, dtype=torch.int32)


class Grammars:
    """Compiles ``GrammarSpec``s against one tokenizer and keeps the compiled grammars in a
    cache of ``cache_bytes`` (``_Cache``: least recently used first out, by each grammar's
    ``memory_size_bytes``). Safe to call from several threads at once (the server compiles on
    worker threads: ``server.grammars``); sources beyond ``verifier.grammar_bounds`` are
    refused before compiling.

    xgrammar's own cache is off: it holds resident memory several times the bytes it
    counts against its limit (its intermediate results as well as the compiled grammars), so
    its limit does not bound the process; ``_Cache`` holds only the compiled grammars.

    ``stop_token_ids`` are the tokens that end the output once the grammar is complete (the
    model's EOS ids). JSON is compiled without free whitespace (xgrammar's compact separators
    ``", "`` and ``": "``): a model cannot then pad its output with whitespace forever, and the
    punctuation and keys are forced text, drafted for free (``proposers.grammar``).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        cache_bytes: int = DEFAULT_CACHE_BYTES,
    ) -> None:
        import xgrammar as xgr  # on first use: it imports transformers (hybridspec.lazy)

        info = xgr.TokenizerInfo.from_huggingface(  # it inspects transformers' classes
            as_transformers(tokenizer), vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
        )
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._cache = _Cache(cache_bytes)

    @property
    def cache_bytes(self) -> int:
        """Bytes the compiled grammars in the cache take now."""
        return self._cache.size_bytes

    def compile(self, spec: GrammarSpec, param: str = "grammar") -> xgr.CompiledGrammar:
        """The compiled grammar; GrammarError naming ``param`` (the field the grammar came
        from) when it is beyond the bounds, invalid, or allows no output at all."""
        if spec.compiled is not None:
            return spec.compiled
        key = (spec.kind, spec.source)
        compiled = self._cache.get(key)
        if compiled is not None:
            return compiled
        check_bounds(spec, param)
        try:
            compiled = self._compile(spec)
        except InvalidRequestError:
            raise
        except Exception as exc:  # xgrammar's errors have no common base class
            raise GrammarError(
                f"{param}: the {spec.kind} does not compile: {_clean(str(exc))}", param
            ) from None
        _check_allows_output(compiled, spec, param)
        self._cache.put(key, compiled)
        return compiled

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        if spec.kind == "json_object":
            return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.kind == "json_schema":
            return self._compiler.compile_json_schema(spec.source, any_whitespace=False)
        if spec.kind == "regex":
            return self._compiler.compile_regex(spec.source)
        return self._compiler.compile_grammar(spec.source)

    def state(self, spec: GrammarSpec) -> GrammarState:
        """A fresh matcher of ``spec`` at the start of the output."""
        return GrammarState(self.compile(spec), self.tokenizer, self.vocab_size)


class _Cache:
    """Compiled grammars by (kind, source), least recently used first out, within
    ``limit_bytes`` of xgrammar's ``memory_size_bytes`` (a grammar larger than the limit is
    not kept). Thread-safe."""

    def __init__(self, limit_bytes: int) -> None:
        self._limit = limit_bytes
        self._entries: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.size_bytes = 0

    def get(self, key: tuple[str, str]) -> xgr.CompiledGrammar | None:
        with self._lock:
            compiled = self._entries.get(key)
            if compiled is not None:
                self._entries.move_to_end(key)
            return compiled

    def put(self, key: tuple[str, str], compiled: xgr.CompiledGrammar) -> None:
        size = int(compiled.memory_size_bytes)
        with self._lock:
            if key in self._entries or size > self._limit:
                return
            self._entries[key] = compiled
            self.size_bytes += size
            while self.size_bytes > self._limit:
                _, old = self._entries.popitem(last=False)
                self.size_bytes -= int(old.memory_size_bytes)


def _check_allows_output(compiled: xgr.CompiledGrammar, spec: GrammarSpec, param: str) -> None:
    """GrammarError unless the grammar allows some first token (one that allows none, such
    as a character class of no characters or a ``$ref`` cycle, could never be answered)."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    words = (compiled.tokenizer_info.vocab_size + 31) // 32
    bitmask = torch.zeros((1, words), dtype=torch.int32)
    matcher.fill_next_token_bitmask(bitmask, 0)
    if not bool(bitmask.any()) and not matcher.is_terminated():
        raise GrammarError(f"{param}: the {spec.kind} allows no output at all", param)


class GrammarState:
    """A grammar's matcher at a sequence's committed position (``types.TokenConstraint``).

    Lookahead through drafts accepts them in the matcher and rolls them back before returning,
    so between calls the matcher is always at the committed position.
    """

    def __init__(
        self, compiled: xgr.CompiledGrammar, tokenizer: PreTrainedTokenizerBase, vocab_size: int
    ) -> None:
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled)
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        # After the grammar's end and a stop token (EOS), a request that ignores EOS may only
        # go on with stop tokens: the matcher is terminated and they are counted here.
        self._stops = frozenset(compiled.tokenizer_info.stop_token_ids)
        self._stop_row = bitmask_of(self._stops, vocab_size)
        self._num_stops_after_end = 0

    def _advance(self, tokens: Sequence[int]) -> int:
        """Accept ``tokens`` while the grammar allows them; how many it accepted."""
        for i, token in enumerate(tokens):
            if self._matcher.is_terminated():
                if int(token) not in self._stops:
                    return i
                self._num_stops_after_end += 1
            elif not self._matcher.accept_token(int(token)):
                return i
        return len(tokens)

    def _rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted by ``_advance`` (stop tokens after the end
        first, then the matcher's own)."""
        stops = min(num_tokens, self._num_stops_after_end)
        self._num_stops_after_end -= stops
        self._matcher.rollback(num_tokens - stops)

    def mask_(self, logits: torch.Tensor, drafts: Sequence[int]) -> None:
        """``types.TokenConstraint.mask_``: each row's forbidden tokens set to -inf."""
        num_rows = logits.shape[0]
        first = len(drafts) - num_rows + 1  # row 0 follows drafts[:first]
        bitmask = torch.full((num_rows, (self._vocab_size + 31) // 32), -1, dtype=torch.int32)
        accepted = self._advance(drafts[:first])
        if accepted == first:
            for j in range(num_rows):
                if self._matcher.is_terminated():
                    bitmask[j] = self._stop_row
                else:
                    self._matcher.fill_next_token_bitmask(bitmask, j)
                if j == num_rows - 1 or self._advance([drafts[first + j]]) == 0:
                    break
                accepted += 1
        self._rollback(accepted)
        allowed = allowed_tokens(bitmask, self._vocab_size)
        logits.masked_fill_(~allowed.to(logits.device), float("-inf"))

    def num_allowed(self, drafts: Sequence[int]) -> int:
        accepted = self._advance(drafts)
        self._rollback(accepted)
        return accepted

    def forced(self, drafts: Sequence[int], max_num_tokens: int) -> list[int]:
        """``types.TokenConstraint.forced``: the forced text after ``drafts``, tokenized, as
        far as the grammar accepts the tokens (a forced text's tokenization need not be the
        model's; the drafts are verified like any other)."""
        if max_num_tokens <= 0:
            return []
        accepted = self._advance(drafts)
        complete = accepted == len(drafts) and not self._matcher.is_terminated()
        text = self._matcher.find_jump_forward_string() if complete else ""
        self._rollback(accepted)
        if not text:
            return []
        tokens = list(self._tokenizer.encode(text, add_special_tokens=False))[:max_num_tokens]
        return tokens[: self.num_allowed([*drafts, *tokens]) - len(drafts)]

    def commit(self, tokens: Sequence[int]) -> None:
        """Move the committed position past verified ``tokens``; the verifier only gives
        tokens the grammar allows, so a refusal is an internal error."""
        accepted = self._advance(tokens)
        self._num_stops_after_end = 0  # committed: never rolled back
        if accepted < len(tokens):
            raise RuntimeError(f"grammar: committed token {tokens[accepted]} is not allowed")

    @property
    def is_complete(self) -> bool:
        """True when the output so far is a whole match of the grammar."""
        return bool(self._matcher.is_completed())
