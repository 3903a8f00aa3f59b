"""Timers the benchmark installs around the target's forward, to split a round's time.

``EngineForwardTimer`` is a forward observer of the engine's target runtime
(``ModelRuntime.add_forward_observer``), which times each forward itself. For transformers
models, ``ModuleForwardTimer`` uses forward pre/post hooks on the top-level model, which
``generate`` calls once per round.

On CUDA both clocks synchronise the device first, so that the forward's kernels are counted in
it rather than in whatever runs next; on CPU the forward is synchronous already.
"""

from __future__ import annotations

import time
from typing import Any

from torch import nn

from hybridspec.model import ForwardBatch, ModelRuntime, ObserverHandle, synchronize


class EngineForwardTimer:
    """Time, count and size every ``forward`` of an engine's target runtime while installed.

    ``input_tokens`` lists the number of tokens fed to each forward (all sequences of the batch,
    prefill chunks included).
    """

    def __init__(self, runtime: ModelRuntime) -> None:
        self.seconds = 0.0
        self.input_tokens: list[int] = []
        self._runtime = runtime
        self._handle: ObserverHandle | None = None

    @property
    def calls(self) -> int:
        return len(self.input_tokens)

    def install(self) -> None:
        assert self._handle is None, "already installed"
        self._handle = self._runtime.add_forward_observer(self._observe)

    def uninstall(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def reset(self) -> None:
        self.seconds = 0.0
        self.input_tokens = []

    def _observe(self, batch: ForwardBatch, seconds: float) -> None:
        self.seconds += seconds
        self.input_tokens.append(int(batch.token_ids.numel()))


class ModuleForwardTimer:
    """Time, count and size every top-level forward of a transformers model while installed.

    ``input_tokens`` lists the number of tokens fed to each forward (``input_ids.shape[1]``),
    from which the drafts of assisted generation are counted.
    """

    def __init__(self, model: nn.Module) -> None:
        self.seconds = 0.0
        self.input_tokens: list[int] = []
        self._model = model
        self._device = next(model.parameters()).device
        self._start = 0.0
        self._handles: list[Any] = []

    @property
    def calls(self) -> int:
        return len(self.input_tokens)

    def install(self) -> None:
        assert not self._handles, "already installed"
        self._handles = [
            self._model.register_forward_pre_hook(self._before, with_kwargs=True),
            self._model.register_forward_hook(self._after),
        ]

    def uninstall(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def reset(self) -> None:
        self.seconds = 0.0
        self.input_tokens = []

    def _before(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        self.input_tokens.append(0 if input_ids is None else int(input_ids.shape[-1]))
        synchronize(self._device)
        self._start = time.perf_counter()

    def _after(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        synchronize(self._device)
        self.seconds += time.perf_counter() - self._start
