"""Lazy re-exports for package ``__init__`` modules (PEP 562), so that importing a package
costs nothing until one of its names is used.

A package lists its public names once per defining module::

    __getattr__, __dir__ = lazy_exports(__name__, globals(), {
        "hybridspec.engine.engine": ("Engine",),
    })

``Engine`` is then imported from ``hybridspec.engine.engine`` on first access and kept in the
package's namespace. The package's ``TYPE_CHECKING`` imports give type checkers the same names.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, namespace: dict[str, Any], exports: Mapping[str, tuple[str, ...]]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level ``__getattr__`` and ``__dir__`` of ``package`` for ``exports``.

    ``exports`` maps a module to the names it defines; ``namespace`` is the package's
    ``globals()``, where a resolved name is cached (later lookups never reach ``__getattr__``).
    """
    origin = {name: module for module, names in exports.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = origin.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *origin})

    return __getattr__, __dir__
