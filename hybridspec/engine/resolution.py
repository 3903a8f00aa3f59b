"""A request's proposer and K, resolved once, where the request enters: ``ProposerCatalog.resolve``.

The engine's ``ProposerPool`` builds the catalog: every built proposer by name, every
composition ``a+b`` it offers (``grammar+ngram``), the registered proposers that could not be
built (with the reason) and the engine's defaults. A library request is resolved by
``Engine.add_request``; the server resolves its requests against the same catalog (taken at
startup, ``server.state.ModelInfo``) before tokenizing them, and hands the result to the engine
in ``GenerationParams.resolved``, which the engine then takes as it is. Either way the request
carries the proposer object and its K (``ResolvedProposer``): no round looks a proposer up by
name, and no layer repeats the checks.

Worked example: defaults ``ngram`` and K = 5. A request naming nothing gets ``ngram`` and 5;
``proposer="grammar+ngram", num_speculative_tokens=8`` gets the composed instance and 8;
``"draft"`` without a draft model raises InvalidRequestError ``proposer: 'draft' is not
available: ...``; ``"ngram+grammar"`` raises ``'ngram' does not compose``. K's bounds are
``GenerationParams``' (``check_num_speculative_tokens``), checked when the parameters are made.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hybridspec.errors import InvalidRequestError

if TYPE_CHECKING:  # the parameters' module imports this one, and stays free of transformers
    from hybridspec.proposers import Proposer


@dataclass(frozen=True, slots=True)
class ResolvedProposer:
    """The proposer a request runs with, and its K (``num_speculative_tokens``)."""

    name: str  # as the request named it, or the default: metrics and responses report it
    proposer: Proposer
    num_speculative_tokens: int


@dataclass(frozen=True, slots=True)
class ProposerCatalog:
    """What requests may name, and the defaults: read-only once built, so the server's threads
    resolve against it while the engine runs (they read it and never call a proposer)."""

    proposers: Mapping[str, Proposer]  # built proposers and their compositions, by name
    unavailable: Mapping[str, str]  # registered but not built: name -> why
    default_proposer: str
    default_num_speculative_tokens: int

    def names(self) -> tuple[str, ...]:
        """The names requests may pick, sorted (compositions after the plain ones)."""
        return tuple(self.proposers)

    def resolve(
        self, proposer: str | None = None, num_speculative_tokens: int | None = None
    ) -> ResolvedProposer:
        """The request's proposer (None: the default) and K (None: the default); raises
        InvalidRequestError (param ``proposer``) for an unknown or unavailable name."""
        name = proposer or self.default_proposer
        k = num_speculative_tokens or self.default_num_speculative_tokens
        return ResolvedProposer(name, self.find(name), k)

    def find(self, name: str) -> Proposer:
        """The proposer ``name``; InvalidRequestError naming the choices when there is none."""
        found = self.proposers.get(name)
        if found is not None:
            return found
        if name in self.unavailable:
            raise InvalidRequestError(
                f"proposer: {name!r} is not available: {self.unavailable[name]}", "proposer"
            )
        head, plus, rest = name.partition("+")
        if plus and head and rest:
            self.find(head)  # an unknown or unavailable part is named as such
            self.find(rest)
            raise InvalidRequestError(
                f"proposer: {head!r} does not compose with {rest!r}, so {name!r} names nothing",
                "proposer",
            )
        known = ", ".join(sorted({*self.proposers, *self.unavailable}))
        raise InvalidRequestError(
            f"proposer: unknown proposer {name!r}; registered: {known}", "proposer"
        )
