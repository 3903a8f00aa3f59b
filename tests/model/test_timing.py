"""Timing a runtime's forwards in place (``model.timing``): the cache is left as it was, and a
forward timed as a verify runs it computes logits of every row."""

from __future__ import annotations

from hybridspec.model import median_forward_seconds
from hybridspec.model.runtime import ForwardBatch
from tests.engine.tiny import make_engine, tiny_loaded


def test_every_row_times_the_logits_of_every_row() -> None:
    runtime = make_engine(tiny_loaded(0), max_num_seqs=1).runtime
    forward, seen = runtime.forward, []

    def watched(batch: ForwardBatch) -> object:
        out = forward(batch)
        if len(batch.token_ids) > 1 and batch.logits_indices is not None:
            seen.append((len(batch.token_ids), out.logits.shape[0]))
        return out

    runtime.forward = watched  # type: ignore[method-assign]
    for every_row in (False, True):
        seen.clear()
        timings = median_forward_seconds(runtime, (1, 3), context=8, every_row=every_row)
        assert timings is not None and all(t > 0 for t in timings)
        rows = {logits for tokens, logits in seen if tokens == 3}
        assert rows == ({3} if every_row else {1})
    assert runtime.num_free_slots() == 1  # the scratch slot given back
