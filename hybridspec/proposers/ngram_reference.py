"""Plain-Python reference of the ``ngram`` proposer, for the tests to compare the kernels against.

It recounts every n-gram of the window from scratch on each call, with tuples as dictionary
keys and no hashing, so that it is easy to check by reading. The semantics it defines (see the
glossary of ``hybridspec.proposers.ngram``):

- the window is the last ``window`` committed tokens;
- an occurrence of order ``n`` is a window position ``p >= n`` (counted from the window's start):
  the ``n`` tokens before it are its context, the token at ``p`` its next token;
- for one context, continuations rank by count, then by the position of their latest
  occurrence (more recent wins); positions are distinct, so the ranking is total;
- a prediction tries orders ``max_order`` down to ``min_order`` and takes the first context that
  has any continuation;
- predictions chain: each predicted token extends the context for the next one, without being
  counted; the proposal stops at the first position with no prediction.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridspec.config import NgramConfig

# context -> {next token: (count, position of its latest occurrence)}
NgramCounts = dict[tuple[int, ...], dict[int, tuple[int, int]]]


def ngram_counts(token_ids: Sequence[int], order: int, window: int) -> NgramCounts:
    """Count the order-``order`` occurrences in the last ``window`` of ``token_ids``.

    Positions are absolute (indices into ``token_ids``), like the kernels' ``last_pos``.
    """
    first = max(0, len(token_ids) - window)
    counts: NgramCounts = {}
    for pos in range(first + order, len(token_ids)):
        continuations = counts.setdefault(tuple(token_ids[pos - order : pos]), {})
        count, _ = continuations.get(token_ids[pos], (0, pos))
        continuations[token_ids[pos]] = (count + 1, pos)
    return counts


def reference_proposal(
    token_ids: Sequence[int],
    num_tokens: int,
    config: NgramConfig,
    prefix: Sequence[int] = (),
) -> list[int]:
    """Up to ``num_tokens`` next tokens predicted from the committed context ``token_ids``,
    continuing ``prefix`` (drafts chosen before: they end the matched context, uncounted)."""
    orders = range(config.max_order, config.min_order - 1, -1)
    tables = {order: ngram_counts(token_ids, order, config.window) for order in orders}
    if config.continuation == "copy":
        return _copy(tables, token_ids, [*token_ids, *prefix], num_tokens)
    context = [*token_ids, *prefix]
    proposal: list[int] = []
    while len(proposal) < num_tokens:
        next_token = _predict(tables, context)
        if next_token is None:
            break
        proposal.append(next_token)
        context.append(next_token)
    return proposal


def _longest_match(
    tables: dict[int, NgramCounts], context: Sequence[int]
) -> dict[int, tuple[int, int]] | None:
    """The continuations of the longest order whose context has any, or None when none has."""
    for order, counts in tables.items():  # longest order first
        if len(context) < order:
            continue
        continuations = counts.get(tuple(context[-order:]))
        if continuations:
            return continuations
    return None


def _predict(tables: dict[int, NgramCounts], context: list[int]) -> int | None:
    """The best next token of the longest matching context, or None when no order matches."""
    continuations = _longest_match(tables, context)
    if continuations is None:
        return None
    # (count, latest position) compares count first, then recency.
    return max(continuations, key=continuations.__getitem__)


def _copy(
    tables: dict[int, NgramCounts],
    token_ids: Sequence[int],
    context: Sequence[int],
    num_tokens: int,
) -> list[int]:
    """The committed tokens after the latest occurrence of the longest end of ``context`` that
    has one."""
    continuations = _longest_match(tables, context)
    if num_tokens == 0 or continuations is None:
        return []
    latest = max(pos for _, pos in continuations.values())
    return list(token_ids[latest : latest + num_tokens])
