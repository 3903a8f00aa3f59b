"""Several choices of one prompt (OpenAI's ``n``), sharing the prompt's prefill.

The ``n`` choices of a prompt are ``n`` ordinary requests (each its own KV-cache slot, proposer
state, random generator and position-keyed uniforms) tied by a ``ChoiceGroup`` until the prompt
is prefilled:

1. the group waits as one queue entry and is admitted only when ``n`` slots are free, all at
   once (``Scheduler.admit``); a group larger than the engine's slots is refused when added;
2. its first live member, the *source*, feeds the prompt's tokens but the last as prefill
   chunks, while the others feed nothing (``Scheduler.plan``);
3. once the source caches ``len(prompt) - 1`` tokens, ``fork_ready`` copies that prefix of its
   cache into every other member's slot (``ModelRuntime.copy_prefix``), with the prompt's
   log-probabilities and target features scored so far, and dissolves the group: from the
   next forward on, each choice decodes alone, feeding the prompt's last token and its drafts.

So the prompt is fed once, not ``n`` times, and each choice's tokens are those of the same
request made alone: its logits come from the same cached keys and values (on the native CPU
runtime the row-invariant kernel makes them the same bits, however the prompt was chunked).
A choice's rollback truncates its own slot only. If the source ends before the fork (aborted,
or failed), the next member becomes the source and prefills the prompt itself.

Seeds: choice ``i`` of a request with seed ``s`` samples with seed ``(s + i) mod 2**63``
(``choice_seed``), as vLLM derives its choices' seeds: choice 0 is the request made with ``n =
1``, and choice ``i`` the one made alone with seed ``s + i``. Under a deterministic proposer
its text then depends on nothing else: not on the other choices, the batch or the drafts.

Dimensions: ``n`` choices per prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from hybridspec.engine.request import (
    ChoiceGroup,
    FinishReason,
    GenerationResult,
    Request,
    RequestOutput,
)
from hybridspec.engine.stats import GenerationStats
from hybridspec.errors import HybridSpecError, check
from hybridspec.model import ModelRuntime
from hybridspec.types import MAX_SEED


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice ``index`` of a request seeded with ``seed`` (None: fresh entropy)."""
    return None if seed is None else (seed + index) % MAX_SEED


def check_choices(n: int, num_prompts: int, max_num_seqs: int, max_queue_size: int) -> None:
    """Refuse (InvalidRequestError) what the engine could never hold: more choices of a prompt
    than its slots (they run at once), more prompts than its queue and slots."""
    check(
        isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= max_num_seqs,
        "n",
        f"expected an integer in [1, {max_num_seqs}] (the engine's slots: a prompt's choices "
        f"run at once), got {n!r}",
    )
    most = max_queue_size + max_num_seqs
    check(
        0 < num_prompts <= most,
        "prompt",
        f"expected 1 to {most} prompts (queue and slots), got {num_prompts}",
    )


def group_choices(requests: list[Request]) -> None:
    """Tie ``requests`` (the choices of one prompt, none started) into a group; one request
    needs none."""
    if len(requests) > 1:
        group = ChoiceGroup(list(requests))
        for request in requests:
            request.group = group


def leave(request: Request) -> None:
    """Take a finished request out of its group (if it still has one): the next member
    becomes the source, and a member left alone is an ordinary request."""
    group = request.group
    if group is None:
        return
    request.group = None
    group.requests.remove(request)
    if len(group.requests) == 1:
        group.requests[0].group = None


def fork_ready(running: Iterable[Request], runtime: ModelRuntime) -> None:
    """Share the prefill of every group whose source has cached its prompt but the last
    token: copy the cached prefix (and what the prefill scored) to the other members, and
    dissolve the group."""
    for request in running:
        group = request.group
        if group is None or group.source is not request:
            continue
        assert request.slot is not None
        length = len(request.prompt_token_ids) - 1
        if runtime.seq_len(request.slot) < length:
            continue
        for member in group.requests[1:]:
            assert member.slot is not None and runtime.seq_len(member.slot) == 0
            runtime.copy_prefix(request.slot, member.slot, length)
            member.scores.prompt = list(request.scores.prompt)
            member.features.pending = list(request.features.pending)
            member.features.num_handed = request.features.num_handed
        for member in group.requests:
            member.group = None


def run_to_results(
    step: Callable[[], list[RequestOutput]],
    abort: Callable[[str], object],
    request_ids: list[str],
) -> list[GenerationResult]:
    """Step until every request of ``request_ids`` has finished; their results in that order.
    A failed one raises HybridSpecError; the others are then aborted."""
    results: dict[str, GenerationResult] = {}
    try:
        while len(results) < len(request_ids):
            for output in step():
                if output.request_id in request_ids and output.result is not None:
                    if output.finish_reason is FinishReason.ERROR:
                        raise HybridSpecError(output.result.error or "generation failed")
                    results[output.request_id] = output.result
    finally:
        for request_id in request_ids:
            if request_id not in results:
                abort(request_id)
    return [results[request_id] for request_id in request_ids]


def combined_stats(stats: Sequence[GenerationStats], prompt_tokens: int) -> GenerationStats:
    """The speculation statistics of several choices taken together: counts summed, the
    earliest first token and the latest end; ``prompt_tokens`` as given (choices share one)."""
    combined = GenerationStats(prompt_tokens=prompt_tokens)
    width = max((len(s.proposed_per_position) for s in stats), default=0)
    combined.proposed_per_position = [0] * width
    combined.accepted_per_position = [0] * width
    for one in stats:
        combined.generated_tokens += one.generated_tokens
        combined.target_forwards += one.target_forwards
        combined.draft_tokens_proposed += one.draft_tokens_proposed
        combined.draft_tokens_accepted += one.draft_tokens_accepted
        for i, (p, a) in enumerate(
            zip(one.proposed_per_position, one.accepted_per_position, strict=True)
        ):
            combined.proposed_per_position[i] += p
            combined.accepted_per_position[i] += a
        combined.elapsed_s = max(combined.elapsed_s, one.elapsed_s)
        first = one.time_to_first_token_s
        if first is not None and (
            combined.time_to_first_token_s is None or first < combined.time_to_first_token_s
        ):
            combined.time_to_first_token_s = first
    return combined
