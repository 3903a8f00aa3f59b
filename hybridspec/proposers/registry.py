"""Proposer names: the one place a name is mapped to the factory that builds the proposer.

``default_registry()`` gives every new engine the built-in proposers (``none``, ``ngram``,
``draft``, ``eagle``, ``hybrid``, ``grammar``, which composes: ``grammar+ngram``) plus those
registered process-wide with ``register_proposer``; an engine's own
``Engine.register_proposer`` adds to that engine alone. An engine builds them in the order they
were registered, so that a factory may compose those registered before it (``hybrid``: the
engine's ``ngram`` and ``eagle`` or ``draft``, from ``ProposerContext.proposers``). No code
below this module compares proposer names.
"""

from __future__ import annotations

from collections.abc import Iterator

from hybridspec.errors import InvalidRequestError
from hybridspec.proposers.base import NoProposer, ProposerFactory


class ProposerRegistry:
    """Maps a proposer name to the factory that builds it."""

    def __init__(self) -> None:
        self._factories: dict[str, ProposerFactory] = {}

    def register(self, name: str, factory: ProposerFactory, *, replace: bool = False) -> None:
        if (
            not isinstance(name, str)
            or not name
            or not name.replace("-", "").replace("_", "").isalnum()
        ):
            raise InvalidRequestError(
                f"proposer: expected a non-empty name of letters, digits, '-' or '_', got {name!r}",
                param="proposer",
            )
        if not callable(factory):
            raise InvalidRequestError(
                f"proposer: factory for {name!r} must be callable, got {factory!r}",
                param="proposer",
            )
        if name in self._factories and not replace:
            raise InvalidRequestError(
                f"proposer: {name!r} is already registered (pass replace=True to override)",
                param="proposer",
            )
        self._factories[name] = factory

    def unregister(self, name: str) -> None:
        self._factories.pop(name, None)

    def factory(self, name: str) -> ProposerFactory:
        try:
            return self._factories[name]
        except KeyError:
            known = ", ".join(sorted(self._factories))
            raise InvalidRequestError(
                f"proposer: unknown proposer {name!r}; registered: {known}", param="proposer"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._factories)

    def __iter__(self) -> Iterator[str]:
        """The names in the order they were registered (a replaced one keeps its place)."""
        return iter(list(self._factories))

    def __contains__(self, name: object) -> bool:
        return name in self._factories

    def copy(self) -> ProposerRegistry:
        other = ProposerRegistry()
        other._factories = dict(self._factories)
        return other


def _builtin_registry() -> ProposerRegistry:
    from hybridspec.proposers.draft import DraftModelProposer
    from hybridspec.proposers.eagle import EagleProposer
    from hybridspec.proposers.grammar import GrammarProposer
    from hybridspec.proposers.hybrid import pooled_hybrid
    from hybridspec.proposers.ngram import NgramProposer
    from hybridspec.proposers.suffix import SuffixProposer

    registry = ProposerRegistry()
    registry.register("none", NoProposer)
    registry.register("grammar", GrammarProposer)
    registry.register("ngram", NgramProposer)
    registry.register("draft", DraftModelProposer)
    registry.register("eagle", EagleProposer)
    registry.register("hybrid", pooled_hybrid)  # after the proposers it composes
    registry.register("suffix", SuffixProposer)
    return registry


# The process-wide registry that new engines start from: the package's one module-level mutable
# state, on purpose, so that a plugin registered once (before ``Engine()`` or ``hybridspec
# serve`` builds its engine) is available everywhere, as with vLLM's model registry.
_PROCESS_REGISTRY: ProposerRegistry | None = None


def _process_registry() -> ProposerRegistry:
    global _PROCESS_REGISTRY
    if _PROCESS_REGISTRY is None:
        _PROCESS_REGISTRY = _builtin_registry()
    return _PROCESS_REGISTRY


def register_proposer(name: str, factory: ProposerFactory, *, replace: bool = False) -> None:
    """Make ``factory`` available as proposer ``name`` to every engine built from now on.

    ``factory`` is a ``Proposer`` subclass or any callable taking a ``ProposerContext``. Raises
    InvalidRequestError for a malformed name, or a taken one unless ``replace``.
    """
    _process_registry().register(name, factory, replace=replace)


def default_registry() -> ProposerRegistry:
    """A fresh registry: the built-in proposers and those given to ``register_proposer``."""
    return _process_registry().copy()
