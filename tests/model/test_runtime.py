"""The ``ModelRuntime`` contract both runtimes keep: ``ForwardOutput``'s hidden states, observers.

A tiny random Llama of 4 layers in float32; transformers' ``output_hidden_states`` on each whole
sequence is the reference (its entry ``i + 1`` is layer ``i``'s output, its last entry the
final norm's output).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from hybridspec.model.hf_runtime import HFRuntime
from hybridspec.model.llama import LlamaRuntime
from hybridspec.model.llama_weights import LlamaWeights
from hybridspec.model.runtime import ForwardBatch, ForwardOutput, ModelRuntime
from tests.conftest import TINY_VOCAB_SIZE, tiny_llama

NUM_LAYERS = 4
HIDDEN_LAYERS = (-1, 0, 2)  # out of order, and the last layer by a negative index
ATOL = 1e-5  # float32 hidden states of size ~1-10: only the order of sums differs
SEED = 21


def model() -> LlamaForCausalLM:
    return tiny_llama(seed=SEED, num_hidden_layers=NUM_LAYERS)


def native(invariant_attention: bool = True) -> LlamaRuntime:
    reference = model()
    weights = LlamaWeights.from_hf_state_dict(
        reference.state_dict(), reference.config, dtype=torch.float32
    )
    return LlamaRuntime(weights, 4, 128, invariant_attention=invariant_attention)


def sequences() -> list[list[int]]:
    gen = torch.Generator().manual_seed(22)
    return [torch.randint(0, TINY_VOCAB_SIZE, (60,), generator=gen).tolist() for _ in range(3)]


# Per sequence: tokens cached before the ragged batch, tokens it feeds. Sequence 0 feeds a
# committed token and 4 drafts, sequence 1 a prefill chunk, sequence 2 one decode token.
CACHED = (11, 7, 24)
FED = (5, 20, 1)


def ragged_forward(runtime: ModelRuntime, hidden_layers: tuple[int, ...]) -> ForwardOutput:
    """Prefill each sequence's cached tokens, then one ragged batch of all three."""
    seqs = sequences()
    slots = [runtime.allocate() for _ in seqs]
    for slot, seq, cached in zip(slots, seqs, CACHED, strict=True):
        runtime.forward(ForwardBatch.from_lists([slot], [seq[:cached]], logits_indices=[]))
    batch = ForwardBatch.from_lists(
        slots,
        [seq[c : c + n] for seq, c, n in zip(seqs, CACHED, FED, strict=True)],
        hidden_layers=hidden_layers,
    )
    return runtime.forward(batch)


def reference_hidden(layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The fed rows' outputs of ``layers`` before the final norm (every layer but the last),
    ``[num_tokens, len(layers), D]``, and transformers' last entry (after the final norm)."""
    reference = model()
    rows, normed = [], []
    with torch.inference_mode():
        for seq, c, n in zip(sequences(), CACHED, FED, strict=True):
            states = reference(torch.tensor([seq[: c + n]]), output_hidden_states=True)
            states = states.hidden_states
            assert len(states) == NUM_LAYERS + 1
            rows.append(torch.stack([states[i % NUM_LAYERS + 1][0, c:] for i in layers], dim=1))
            normed.append(states[-1][0, c:])
    return torch.cat(rows), torch.cat(normed)


@pytest.mark.parametrize("invariant_attention", [True, False], ids=["kernel", "sdpa"])
def test_native_hidden_states_match_transformers_for_every_fed_row(
    invariant_attention: bool,
) -> None:
    runtime = native(invariant_attention)
    output = ragged_forward(runtime, HIDDEN_LAYERS)
    hidden = output.hidden_states
    assert hidden is not None and hidden.shape == (sum(FED), len(HIDDEN_LAYERS), 64)
    assert hidden.dtype == torch.float32
    expected, normed = reference_hidden((0, 2))
    torch.testing.assert_close(hidden[:, 1:], expected, atol=ATOL, rtol=1e-5)
    # Layer -1 is the last layer before the final norm: transformers' last entry is after it.
    weights = runtime.weights
    last = F.rms_norm(hidden[:, 0], (64,), weights.norm, weights.dims.rms_norm_eps)
    torch.testing.assert_close(last, normed, atol=ATOL, rtol=1e-5)


def test_transformers_runtime_hidden_states_match_native() -> None:
    want = ragged_forward(native(), HIDDEN_LAYERS)
    got = ragged_forward(HFRuntime(model(), 4, 128), HIDDEN_LAYERS)
    assert got.hidden_states is not None and want.hidden_states is not None
    torch.testing.assert_close(got.hidden_states, want.hidden_states, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("runtime_kind", ["native", "transformers"])
def test_hidden_states_are_none_unless_asked_and_leave_logits_bit_identical(
    runtime_kind: str,
) -> None:
    def make() -> ModelRuntime:
        return native() if runtime_kind == "native" else HFRuntime(model(), 4, 128)

    plain = ragged_forward(make(), ())
    asked = ragged_forward(make(), HIDDEN_LAYERS)
    assert plain.hidden_states is None and asked.hidden_states is not None
    assert torch.equal(plain.logits, asked.logits)


def test_hidden_states_cover_every_fed_row_whatever_logits_indices_say() -> None:
    runtime = native()
    slot = runtime.allocate()
    ids = sequences()[0][:9]
    output = runtime.forward(
        ForwardBatch.from_lists([slot], [ids], logits_indices=[8], hidden_layers=(1,))
    )
    assert output.logits.shape == (1, TINY_VOCAB_SIZE)
    assert output.hidden_states is not None and output.hidden_states.shape == (9, 1, 64)


@pytest.mark.parametrize(
    "hidden_layers", [(NUM_LAYERS,), (-NUM_LAYERS - 1,), (True,), [0]], ids=str
)
def test_bad_hidden_layers_raise_value_error(hidden_layers: tuple[int, ...]) -> None:
    for runtime in (native(), HFRuntime(model(), 4, 128)):
        slot = runtime.allocate()
        batch = ForwardBatch.from_lists([slot], [[1, 2]], hidden_layers=hidden_layers)
        with pytest.raises(ValueError, match="hidden_layers"):
            runtime.forward(batch)
        assert runtime.seq_len(slot) == 0


@pytest.mark.parametrize("runtime_kind", ["native", "transformers"])
def test_forward_observers_see_each_batch_until_removed(runtime_kind: str) -> None:
    runtime: ModelRuntime = native() if runtime_kind == "native" else HFRuntime(model(), 4, 128)
    seen: list[tuple[str, int, float]] = []

    def first(batch: ForwardBatch, seconds: float) -> None:
        seen.append(("first", batch.token_ids.numel(), seconds))

    def once(batch: ForwardBatch, seconds: float) -> None:
        seen.append(("once", batch.token_ids.numel(), seconds))
        once_handle.remove()  # an observer may remove itself while it is called

    handle = runtime.add_forward_observer(first)
    once_handle = runtime.add_forward_observer(once)
    slot = runtime.allocate()
    runtime.forward(ForwardBatch.from_lists([slot], [[1, 2, 3]]))
    runtime.forward(ForwardBatch.from_lists([slot], [[4]]))
    handle.remove()
    handle.remove()  # a second remove does nothing
    runtime.forward(ForwardBatch.from_lists([slot], [[5]]))
    assert [(name, n) for name, n, _ in seen] == [("first", 3), ("once", 3), ("first", 1)]
    assert all(seconds > 0 for _, _, seconds in seen)
    assert seen[0][2] == seen[1][2]  # one clock per forward, shared by its observers
    assert runtime.seq_len(slot) == 5


@pytest.mark.parametrize(
    ("runtime_kind", "invariant"),
    [("native", True), ("native", False), ("transformers", False)],
    ids=["kernel", "sdpa", "transformers"],
)
def test_copied_prefix_continues_as_its_source_and_stays_apart(
    runtime_kind: str, invariant: bool
) -> None:
    """A slot given a copy of another's prefix continues exactly as the source would (the
    choices of one prompt share its prefill this way), and neither's later writes or
    truncations reach the other."""
    runtime: ModelRuntime = (
        native(invariant) if runtime_kind == "native" else HFRuntime(model(), 4, 128)
    )
    seq = sequences()[0]
    source, dest = runtime.allocate(), runtime.allocate()
    runtime.forward(ForwardBatch.from_lists([source], [seq[:20]], logits_indices=[]))
    runtime.copy_prefix(source, dest, 15)
    assert runtime.seq_len(dest) == 15 and runtime.seq_len(source) == 20
    # the source goes on past the copied prefix; the copy takes other tokens at 15..
    runtime.forward(ForwardBatch.from_lists([source], [seq[20:30]], logits_indices=[]))
    other = runtime.forward(ForwardBatch.from_lists([dest], [seq[40:45]])).logits
    runtime.truncate(source, 15)
    again = runtime.forward(ForwardBatch.from_lists([source], [seq[40:45]])).logits
    torch.testing.assert_close(other, again, atol=1e-5, rtol=0)
    if runtime_kind == "native" and invariant:
        assert torch.equal(other, again)  # the same bits, as from the same cache
    fresh = runtime.allocate()
    alone = runtime.forward(ForwardBatch.from_lists([fresh], [seq[:15] + seq[40:45]])).logits
    torch.testing.assert_close(other, alone[15:], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="length"):
        runtime.copy_prefix(source, dest, 21)
    with pytest.raises(ValueError, match="dest"):
        runtime.copy_prefix(source, source, 3)
