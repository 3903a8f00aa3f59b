"""A custom proposer in a few lines: guess that the text repeats what followed the last token.

Run it on the embedded default model:

    python examples/custom_proposer.py

``LastOccurrenceProposer`` looks for the previous occurrence of the newest token in the
committed context and proposes the tokens that followed it. It only needs ``propose``: the
context arrives with every request, so there is no state to start, commit or finish.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridspec import Engine, Proposal, Proposer, ProposeRequest


class LastOccurrenceProposer(Proposer):
    def propose(self, requests: Sequence[ProposeRequest]) -> list[Proposal]:
        proposals = []
        for request in requests:
            context, k = request.token_ids, request.max_num_drafts
            last = context[-1]
            guess: list[int] = []
            for start in range(len(context) - 2, -1, -1):
                if context[start] == last:
                    guess = list(context[start + 1 : start + 1 + k])
                    break
            proposals.append(Proposal(token_ids=guess))
        return proposals


def main(engine: Engine | None = None) -> dict[str, str]:
    engine = engine if engine is not None else Engine()
    engine.register_proposer("last-occurrence", LastOccurrenceProposer)
    prompt = "Repeat exactly: the quick brown fox jumps over the lazy dog. " * 2
    texts = {}
    for proposer in ("none", "last-occurrence"):
        result = engine.generate(
            prompt, proposer=proposer, num_speculative_tokens=4, max_new_tokens=32
        )
        texts[proposer] = result.text
        print(f"{proposer:>16}: {result.stats.mean_accepted_length:.2f} tokens per forward")
    assert texts["none"] == texts["last-occurrence"], "speculation changed the greedy output"
    return texts


if __name__ == "__main__":
    main()
