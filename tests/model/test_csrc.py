"""The C library's shape (hybridspec/model/csrc): files and functions small enough to read, no
allocation inside a kernel call (each takes the caller's scratch, csrc/scratch.h), and sources
that compile for every instruction set ``isa.h`` knows, this machine's or not."""

from __future__ import annotations

import platform
import re
import subprocess
from pathlib import Path

import pytest

from hybridspec.model import kernel_build

CSRC = Path(__file__).parents[2] / "hybridspec" / "model" / "csrc"
FILES = sorted(CSRC.glob("*.[ch]"))
MAX_FILE_LINES = 450
MAX_FUNCTION_LINES = 80


def functions(lines: list[str]) -> list[tuple[str, int]]:
    """Each function defined at the top level of a C file: its first line and its length, from
    the signature's first line to the closing brace in column 0."""
    found, start = [], None
    for i, line in enumerate(lines):
        signature = re.match(r"[A-Za-z_].*\(", line) and not line.rstrip().endswith(";")
        if start is None and signature and not line.startswith(("typedef", "#")):
            start = i
        if start is not None and line.startswith("}"):
            found.append((lines[start], i - start + 1))
            start = None
    return found


def test_the_library_has_its_files() -> None:
    names = {path.name for path in FILES}
    assert {"matmul.c", "layer.c", "attention.c", "fastmath.h", "isa.h", "scratch.h"} <= names


@pytest.mark.parametrize("path", FILES, ids=lambda path: path.name)
def test_files_and_functions_stay_small(path: Path) -> None:
    lines = path.read_text().splitlines()
    assert len(lines) <= MAX_FILE_LINES
    found = functions(lines)
    assert found or path.suffix == ".h"  # every .c file defines functions: else the parse is wrong
    long = [(first, length) for first, length in found if length > MAX_FUNCTION_LINES]
    assert not long


@pytest.mark.parametrize("path", FILES, ids=lambda path: path.name)
def test_no_kernel_allocates(path: Path) -> None:
    text = path.read_text()
    assert not re.search(r"\b(malloc|calloc|realloc|free)\s*\(", text)


def test_one_exp_and_one_set_of_instruction_set_macros() -> None:
    text = {path.name: path.read_text() for path in FILES}
    exps = [name for name, body in text.items() if "1.44269504" in body]
    assert exps == ["fastmath.h"]
    isa = [name for name, body in text.items() if re.search(r"#\s*define\s+H[AS]_(AVX|SIMD)", body)]
    assert isa == ["isa.h"]


# isa.h's paths, each named by the target flags that select it on any x86-64 compiler
AVX2 = ("-mavx2", "-mfma", "-mf16c")
AVX512 = (*AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl")
ISA_FLAGS = {
    "avx512vnni": (*AVX512, "-mavx512vnni"),
    "avx512": AVX512,
    "avx2": AVX2,
    "portable": (),
}


@pytest.mark.parametrize("isa", ISA_FLAGS)
def test_every_instruction_set_path_compiles(isa: str) -> None:
    """The runtime builds with -march=native, so a path this machine lacks is compiled only on
    machines that have it: checked here without running it, since a path that does not compile
    leaves those machines on torch's matmul (``qgemm.kernel``)."""
    cc = kernel_build.compiler()
    if cc is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("no C compiler for x86-64")
    flags = ("-march=x86-64", *ISA_FLAGS[isa], "-fsyntax-only", "-Wall", "-Werror", "-fopenmp")
    for source in kernel_build.SOURCES:
        done = subprocess.run([cc, *flags, str(source)], capture_output=True, text=True)
        assert done.returncode == 0, f"{source.name} ({isa}): {done.stderr}"
