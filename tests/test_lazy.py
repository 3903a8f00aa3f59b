"""The package's ``__init__``s resolve their public names on first use (``hybridspec.lazy``):
``import hybridspec`` and the command line's own import stay cheap, and every name still works."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from hybridspec.lazy import lazy_exports

HEAVY = ("torch", "transformers", "numba", "fastapi", "uvicorn", "matplotlib")
LAZY_PACKAGES = (
    "hybridspec",
    "hybridspec.engine",
    "hybridspec.model",
    "hybridspec.server",
    "hybridspec.bench",
)


def heavy_modules_after(statement: str) -> list[str]:
    """The heavy modules that ``statement`` imports, in a fresh interpreter."""
    code = f"{statement}; import sys; print(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    return result.stdout.split()


@pytest.mark.parametrize(
    ("statement", "allowed"),
    [
        ("import hybridspec", ()),
        ("from hybridspec import EngineConfig, SamplingParams", ("torch",)),
        ("from hybridspec.server import ServerConfig", ()),
        # The parser reads GenerationParams' defaults (torch); not the bench, not the server.
        ("import hybridspec.cli; hybridspec.cli.build_parser()", ("torch",)),
    ],
)
def test_cheap_imports_load_no_heavy_module(statement: str, allowed: tuple[str, ...]) -> None:
    assert set(heavy_modules_after(statement)) <= set(allowed)


@pytest.mark.parametrize("package", LAZY_PACKAGES)
def test_every_public_name_resolves_to_its_defining_object(package: str) -> None:
    module = importlib.import_module(package)
    for name in module.__all__:
        value = getattr(module, name)
        assert getattr(module, name) is value  # cached after the first lookup
        assert name in dir(module)
        defining = importlib.import_module(value.__module__)
        assert getattr(defining, name) is value, (package, name)


def test_an_unknown_name_is_an_attribute_error() -> None:
    namespace: dict[str, object] = {}
    getattr_, dir_ = lazy_exports("pkg", namespace, {"collections": ("OrderedDict",)})
    with pytest.raises(AttributeError, match="'pkg' has no attribute 'Nope'"):
        getattr_("Nope")
    assert dir_() == ["OrderedDict"]
    assert getattr_("OrderedDict") is importlib.import_module("collections").OrderedDict
    assert "OrderedDict" in namespace
