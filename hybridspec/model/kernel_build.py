"""Building the kernel library (``csrc/``): compiled once per machine, keyed by its sources.

The C sources are compiled with the system's C compiler (``$CC``, else ``cc``) with
``-O3 -march=native -fopenmp`` into ``default_cache_dir()/kernels``, keyed by the sources, the
flags and the compiler, the first time it is needed (a few seconds). ``qgemm.load`` loads what
``build`` returns.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from hybridspec.model.gguf import default_cache_dir

_CSRC = Path(__file__).parent / "csrc"
SOURCES = tuple(sorted(_CSRC.glob("*.c")))  # compiled together into one library
HEADERS = tuple(sorted(_CSRC.glob("*.h")))  # in the build's key with the sources
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")


def compiler() -> str | None:
    """The C compiler to build with: ``$CC``, else ``cc`` / ``gcc`` on PATH."""
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return name
    return None


def build(extra_flags: tuple[str, ...] = (), cache_dir: Path | None = None) -> Path:
    """Compile the kernel (or find it compiled) and return the shared library's path.

    ``extra_flags`` are appended to ``FLAGS`` (the tests build each instruction-set path, e.g.
    ``("-mno-avx512vnni",)``). Raises RuntimeError when there is no compiler or it fails.
    """
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC)")
    flags = (*FLAGS, *extra_flags)
    digest = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        digest.update(source.read_bytes())
    digest.update(" ".join((shutil.which(cc) or cc, *flags)).encode())
    folder = (cache_dir or default_cache_dir()) / "kernels"
    target = folder / f"qgemm-{digest.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    fd, scratch = tempfile.mkstemp(dir=folder, suffix=".so")
    os.close(fd)
    try:
        done = subprocess.run(
            [cc, *flags, "-o", scratch, *map(str, SOURCES), "-lm"],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed to build the kernel: {done.stderr.strip()}")
        os.replace(scratch, target)  # atomic: a concurrent build finds a whole library
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)
    return target
