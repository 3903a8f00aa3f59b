"""GGUF matrices packed in place (csrc/pack.c): the very bytes the numpy path packs, for every
type, stacked mixes and the edge cases of the scale factoring; a whole file loaded in place
equal to the old path; bad files refused by name before anything large is allocated."""

from __future__ import annotations

import ctypes
import gc
import mmap
import os
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridspec.config import ModelConfig
from hybridspec.errors import ModelLoadError
from hybridspec.model import gguf_file, kernel_build, qgemm
from hybridspec.model.gguf import read_gguf
from hybridspec.model.gguf_blocks import GGUF_TYPES, GGUFMatrix, GGUFPart
from hybridspec.model.gguf_load import convert_in_place, pack_quantized
from hybridspec.model.gguf_pack import c_decodes, held, pack_matrix, read_ahead
from hybridspec.model.llama_weights import LlamaWeights
from hybridspec.model.loader import load_model
from hybridspec.model.quant import PackedWeight
from tests.model.test_gguf_types import (
    LAYOUT,
    _private_cache,  # noqa: F401  # a fixture: the cache dir
    write_mixed_file,
)
from tests.model.test_quant import random_raw

pytestmark = pytest.mark.skipif(qgemm.kernel() is None, reason="no C compiler")
PACKED_FIELDS = ("codes", "scales", "offsets", "scale_super", "offset_super")


def kernel() -> qgemm.Kernel:
    block = qgemm.kernel()
    assert block is not None
    return block


def assert_same_bytes(got: PackedWeight, want: PackedWeight) -> None:
    assert (got.bits, got.group, got.rows, got.cols) == (
        want.bits,
        want.group,
        want.rows,
        want.cols,
    )
    for name in PACKED_FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert (a.dtype, a.shape) == (b.dtype, b.shape), name
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name


def part(kind: str, rows: int, cols: int, seed: int, permuted: bool = False) -> GGUFPart:
    order = np.random.default_rng(seed).permutation(rows) if permuted else None
    return GGUFPart(f"t{seed}", kind, random_raw(kind, rows, cols, seed), (rows, cols), order)


def check(matrix: GGUFMatrix) -> PackedWeight:
    packed = pack_matrix(matrix, kernel())
    assert_same_bytes(packed, kernel().pack(matrix.decode()))
    return packed


@pytest.mark.parametrize("kind", sorted(GGUF_TYPES))
def test_every_type_packs_to_the_numpy_paths_bytes(kind: str) -> None:
    check(GGUFMatrix((part(kind, 37, 512, seed=3, permuted=True),)))  # a tile past the rows


@pytest.mark.parametrize(
    "kinds",
    [
        ("Q4_K", "Q4_K", "Q6_K"),  # q/k/v as Q4_K_M writes them: 6 bits, groups of 16
        ("Q4_K", "Q4_K"),  # gate/up
        ("Q2_K", "Q3_K"),
        ("Q4_0", "Q5_0", "Q4_1"),  # float16 factors: no int8 steps hold them
        ("Q5_K", "Q6_K", "Q5_1"),
        ("Q4_K", "Q8_0", "Q6_K"),  # a type pack.c leaves to numpy: all of it in numpy
    ],
)
def test_stacked_mixes_pack_to_the_numpy_paths_bytes(kinds: tuple[str, ...]) -> None:
    parts = tuple(part(k, 32 + 16 * i, 256, seed=i, permuted=i < 2) for i, k in enumerate(kinds))
    check(GGUFMatrix(parts))


def blocks_with(kind: str, rows: int, at: int, value: float, seed: int) -> np.ndarray:
    raw = random_raw(kind, rows, 256, seed).reshape(-1, GGUF_TYPES[kind][1]).copy()
    raw[:, at : at + 2] = np.array([value], np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.filterwarnings("ignore:invalid value encountered")
@pytest.mark.parametrize(
    ("kind", "at", "value", "mode"),
    [
        ("Q6_K", 208, -0.01, "steps"),  # d < 0: a step of -128 takes a negated factor
        ("Q4_K", 0, 0.0, "steps"),  # d = 0: every scale zero, factor 1
        ("Q4_K", 0, 6e-8, "steps"),  # a subnormal float16 d
        ("Q4_K", 0, float("inf"), "float"),  # an infinite d: inf * 0 is NaN, only float32
        ("Q4_K", 2, float("nan"), "float"),  # NaN offsets: only float32
    ],
)
def test_scale_edge_cases_pack_alike(kind: str, at: int, value: float, mode: str) -> None:
    raw = blocks_with(kind, 20, at, value, seed=5)
    if kind == "Q6_K":
        raw.reshape(-1, 210)[:, 192] = 0x80  # a sub-block scale of -128
    packed = check(GGUFMatrix((GGUFPart("t", kind, raw, (20, 256)),)))
    held = {"steps": torch.int8, "half": torch.float16, "float": torch.float32}[mode]
    assert packed.scales.dtype == held


def test_only_the_types_pack_c_decodes_run_in_c() -> None:
    assert c_decodes(GGUFMatrix((part("Q4_K", 16, 256, 0), part("Q6_K", 16, 256, 1))), kernel())
    assert not c_decodes(GGUFMatrix((part("Q4_K", 16, 256, 0), part("Q8_0", 16, 256, 1))), kernel())


def test_pack_c_compiles_without_warnings(tmp_path: Path) -> None:
    cc = kernel_build.compiler()
    assert cc is not None
    source = Path(qgemm.__file__).parent / "csrc" / "pack.c"
    flags = ["-O3", "-march=native", "-fopenmp", "-Wall", "-Wextra", "-Werror"]
    done = subprocess.run(
        [cc, *flags, "-c", str(source), "-o", str(tmp_path / "pack.o")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr


@pytest.fixture(scope="module")
def mixed_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """test_gguf_types' file: every supported type, layer 0 as Q4_K_M mixes them."""
    return write_mixed_file(tmp_path_factory.mktemp("gguf") / "mixed.gguf", LAYOUT)


def test_a_file_loaded_in_place_holds_what_the_numpy_path_packs(mixed_file: Path) -> None:
    new = convert_in_place(mixed_file, torch.bfloat16, kernel()).weights
    model = read_gguf(mixed_file, keep_quantized=True)
    old = pack_quantized(
        LlamaWeights.from_hf_state_dict(model.state_dict, model.config, dtype=torch.bfloat16)
    )
    assert new.lm_head is new.embed and old.lm_head is old.embed
    pairs = [(new.embed, old.embed), (new.norm, old.norm)]
    for ours, theirs in zip(new.layers, old.layers, strict=True):
        pairs += [(getattr(ours, f), getattr(theirs, f)) for f in ("wqkv", "wo", "w_gate_up")]
        pairs += [(ours.w_down, theirs.w_down), (ours.attn_norm, theirs.attn_norm)]
    for got, want in pairs:
        assert type(got) is type(want)
        if isinstance(got, PackedWeight):
            assert_same_bytes(got, want)
        else:
            assert got.dtype == want.dtype and torch.equal(got, want)


def test_a_truncated_file_is_refused_naming_file_and_tensor(
    mixed_file: Path, tmp_path: Path
) -> None:
    data = mixed_file.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ModelLoadError, match=r"cut\.gguf.*tensor '.*' ends at byte .* truncated"):
        load_model(ModelConfig(name_or_path=str(cut)))  # before the tokenizer is converted
    cut.write_bytes(data[:200])  # inside the metadata
    with pytest.raises(ModelLoadError, match=r"cut\.gguf.*truncated or corrupt"):
        read_gguf(cut, keep_quantized=True, lazy=True)


def test_an_unknown_tensor_type_is_refused_by_name(mixed_file: Path, tmp_path: Path) -> None:
    data = bytearray(mixed_file.read_bytes())
    name = b"blk.0.attn_output.weight"
    at = data.index(name) + len(name)  # then n_dims (4 bytes), 2 dims (16), the type (4)
    data[at + 20 : at + 24] = (200).to_bytes(4, "little")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=r"bad\.gguf.*blk\.0\.attn_output\.weight.*type 200"):
        read_gguf(bad, keep_quantized=True, lazy=True)


def test_a_file_larger_than_the_free_memory_is_refused_first(
    mixed_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gguf_file, "available_memory", lambda: (1 << 20, "MemAvailable"))

    def no_packing(*_: object, **__: object) -> None:
        raise AssertionError("packed before the memory was checked")

    monkeypatch.setattr("hybridspec.model.gguf_load.pack_matrix", no_packing)
    with pytest.raises(ModelLoadError, match=r"mixed\.gguf.*needs about \d+ MB.* 1 MB is avail"):
        convert_in_place(mixed_file, torch.bfloat16, kernel())


def test_available_memory_reads_meminfo() -> None:
    available, source = gguf_file.available_memory()
    assert available > 0 and source


def cached_pages(path: Path) -> tuple[int, int]:
    """Pages of the file in the page cache (mincore), and its pages."""
    size = path.stat().st_size
    with path.open("rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as mapped:
        pages = -(-size // mmap.PAGESIZE)
        vector = (ctypes.c_ubyte * pages)()
        view = np.frombuffer(mapped, dtype=np.uint8)
        address = ctypes.c_void_p(view.ctypes.data)
        assert ctypes.CDLL(None).mincore(address, ctypes.c_size_t(size), vector) == 0
        del view
    return sum(v & 1 for v in vector), pages


def test_read_ahead_brings_the_whole_file_into_the_page_cache(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    with path.open("wb") as f:
        f.write(np.random.default_rng(0).bytes(24 << 20))
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    cached, pages = cached_pages(path)
    if cached == pages:
        pytest.skip("this file system keeps the file in memory: nothing to read ahead")
    read_ahead(path, kernel()).join(timeout=60)  # every read asked for: wait for the disk
    deadline = time.monotonic() + 30
    while cached_pages(path)[0] < pages and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cached_pages(path) == (pages, pages)


def test_read_ahead_of_a_missing_file_reads_nothing(tmp_path: Path) -> None:
    thread = read_ahead(tmp_path / "missing.gguf", kernel())
    thread.join(timeout=10)
    assert not thread.is_alive()


def vm_flags(address: int) -> list[str] | None:
    """The VmFlags of the mapping holding ``address`` (/proc/self/smaps: ``hg`` advised
    MADV_HUGEPAGE, ``nh`` MADV_NOHUGEPAGE); None where smaps does not say."""
    try:
        text = Path("/proc/self/smaps").read_text()
    except OSError:
        return None
    inside = False
    for line in text.splitlines():
        head = line.split()[0] if line.split() else ""
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            start, end = (int(v, 16) for v in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    return None


def _advised_huge(address: int) -> bool | None:
    """Whether the mapping holding ``address`` is advised MADV_HUGEPAGE; None where unknown."""
    flags = vm_flags(address)
    return None if flags is None else "hg" in flags


def test_packed_codes_are_held_in_memory_advised_for_huge_pages() -> None:
    big = held((3, 1024, 1024), torch.uint8)  # 3 MiB: over one huge page
    small = held((4, 8), torch.float32)
    assert big.shape == (3, 1024, 1024) and big.dtype is torch.uint8 and big.is_contiguous()
    assert small.shape == (4, 8) and small.dtype is torch.float32
    advised = _advised_huge(big.data_ptr())
    if advised is None or not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists():
        pytest.skip("no smaps or no transparent huge pages here")
    assert advised
    view = big[1:2].clone()
    big.fill_(7)  # writable, and every page of the mapping there
    assert int(big[2, 1023, 1023]) == 7 and view.shape == (1, 1024, 1024)
    rows = big[2]
    del big
    gc.collect()
    assert int(rows.sum()) == 7 * 1024 * 1024  # the mapping outlives the name: a view holds it
