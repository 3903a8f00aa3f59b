"""Fixtures of the model tests: the kernel library built for each instruction-set path.

``tests/model/test_qgemm.py`` and ``test_attention_c.py`` compare the library's paths bit for
bit; they share one build of each (``kernel_variants``), compiled side by side: each build is a
compiler process of its own, seconds long.
"""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from hybridspec.model import kernel_build, qgemm
from hybridspec.model.qgemm import Kernel

# name -> flags added to the build's: each takes one more instruction set off ``isa.h``'s chain
KERNEL_FLAGS = {
    "native": (),  # as the runtime builds it (-march=native)
    "no-vnni": ("-mno-avx512vnni",),  # AVX-512 without its int8 dot products
    "avx2": ("-mno-avx512f",),
    "portable": ("-mno-avx2",),  # the portable C
}


@pytest.fixture(scope="session")
def kernel_variants(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Kernel]:
    """The library built with each of ``KERNEL_FLAGS``, each loaded apart from the runtime's
    ``qgemm.kernel()`` (a scratch and settings of its own). "native" is the runtime's build
    (keyed by sources, flags and compiler: the same library) copied to this session's folder;
    the others are compiled there."""
    if qgemm.kernel() is None:
        pytest.skip("no C compiler")
    folder = tmp_path_factory.mktemp("kernels")

    def build(flags: tuple[str, ...]) -> Path:
        if not flags:
            return Path(shutil.copy(kernel_build.build(), folder / "native.so"))
        return kernel_build.build(flags, folder)

    with ThreadPoolExecutor(len(KERNEL_FLAGS)) as pool:
        paths = list(pool.map(build, KERNEL_FLAGS.values()))
    return {name: Kernel(path) for name, path in zip(KERNEL_FLAGS, paths, strict=True)}


@pytest.fixture(scope="module")
def kernel() -> Kernel:
    """The runtime's kernel library (``qgemm.kernel()``), which the tests that use it need
    built."""
    built = qgemm.kernel()
    assert built is not None
    return built
