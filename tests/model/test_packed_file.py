"""The packed-weight file (``packed_file``): a later load maps what the first one packed, the same
bytes and the same greedy ids; a stale, truncated or corrupt entry is never used; a cache that
cannot be written is skipped."""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridspec import Engine, EngineConfig, GenerationParams, ModelConfig
from hybridspec.model import gguf_load, gguf_pack, packed_file
from hybridspec.model.gguf import GGUFModel
from hybridspec.model.gguf_blocks import GGUFMatrix
from hybridspec.model.gguf_load import checked_gguf, load_in_place
from hybridspec.model.gguf_pack import c_decodes
from hybridspec.model.gguf_rows import MappedRows
from hybridspec.model.llama_weights import LlamaWeights
from hybridspec.model.quant import PackedWeight
from tests.model.test_gguf_pack import assert_same_bytes, kernel, mixed_file  # noqa: F401
from tests.model.test_gguf_rows import write_untied_file
from tests.model.test_gguf_types import PROMPT


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("HYBRIDSPEC_CACHE_DIR", str(folder))
    monkeypatch.delenv(packed_file.ENV, raising=False)
    return folder


def entries(cache: Path) -> list[Path]:
    return sorted((cache / "packed").glob(f"*{packed_file.SUFFIX}"))


def load(path: Path, packs: bool) -> LlamaWeights:
    """``load_in_place``'s weights; ``packs``: whether the packing must run (else it fails)."""
    with pytest.MonkeyPatch.context() as patch:
        if not packs:

            def refuse(*args: object, **kwargs: object) -> None:
                raise AssertionError("packed although the packed-weight file was there")

            patch.setattr(gguf_load, "convert_in_place", refuse)
        return load_in_place(path, torch.bfloat16, kernel())[0].weights


def assert_same_weights(got: LlamaWeights, want: LlamaWeights) -> None:
    def same(a: object, b: object) -> None:
        if isinstance(b, PackedWeight):
            assert isinstance(a, PackedWeight)
            assert_same_bytes(a, b)
        elif isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        elif isinstance(b, MappedRows):
            every = torch.arange(b.shape[0])
            assert isinstance(a, MappedRows) and torch.equal(a.rows(every), b.rows(every))
        else:
            assert a is None and b is None

    for name in ("embed", "lm_head", "norm", "inv_freq", "local_inv_freq"):
        same(getattr(got, name), getattr(want, name))
    assert (got.lm_head is got.embed) == (want.lm_head is want.embed)
    assert got.dims == want.dims and got.family is want.family
    for ours, theirs in zip(got.layers, want.layers, strict=True):
        for field in dataclasses.fields(theirs):
            same(getattr(ours, field.name), getattr(theirs, field.name))


def test_a_later_load_maps_the_same_bytes_without_packing(
    mixed_file: Path,  # noqa: F811
    cache: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fresh = load(mixed_file, True)
    (entry,) = entries(cache)
    assert not list((cache / "packed").glob(".*"))  # no staging file left
    later = load(mixed_file, False)
    assert_same_weights(later, fresh)
    plain = gguf_load.convert_in_place(mixed_file, torch.bfloat16, kernel()).weights
    assert_same_weights(later, plain)
    assert entry.stat().st_size < 2 * mixed_file.stat().st_size + packed_file.DATA


def packed_spans(model: GGUFModel) -> list[tuple[int, int]]:
    """The addresses ([start, end)) of the blocks of every matrix a load of ``model`` packs in
    C."""
    return [
        (part.blocks.ctypes.data, part.blocks.ctypes.data + part.blocks.nbytes)
        for matrix in model.state_dict.values()
        if isinstance(matrix, GGUFMatrix) and c_decodes(matrix, kernel())
        for part in matrix.parts
    ]


@pytest.mark.parametrize("keep", [True, False])
def test_the_gguf_pages_packed_into_a_kept_file_are_dropped_from_the_page_cache(
    mixed_file: Path,  # noqa: F811
    cache: Path,
    monkeypatch: pytest.MonkeyPatch,
    keep: bool,
) -> None:
    """Every byte of every matrix packed in C is given back with ``drop`` where the packed
    file is written (its pages leave the page cache), and never where there is no such file
    (the next load packs from them again); the weights are the same either way."""
    calls: list[tuple[int, int, bool]] = []
    release = gguf_pack.release

    def spy(view: np.ndarray, advice: int = 4, drop: bool = False) -> None:
        if advice == 4:  # MADV_DONTNEED: the pages given back after their run
            calls.append((view.ctypes.data, view.ctypes.data + view.nbytes, drop))
        release(view, advice, drop)

    models: list[GGUFModel] = []

    def checked(path: Path) -> GGUFModel:
        models.append(checked_gguf(path))
        return models[-1]

    monkeypatch.setattr(gguf_pack, "release", spy)
    monkeypatch.setattr(gguf_load, "checked_gguf", checked)
    if not keep:
        monkeypatch.setenv(packed_file.ENV, "0")
    weights = load_in_place(mixed_file, torch.bfloat16, kernel())[0].weights
    assert bool(entries(cache)) == keep
    (model,) = models
    spans = packed_spans(model)
    assert spans
    covered = sorted((a, b) for a, b, drop in calls if drop == keep)
    for start, end in spans:
        reach = start
        for a, b in covered:
            if a <= reach < b:
                reach = b
        assert reach >= end, f"bytes {reach}-{end} not given back with drop={keep}"
    assert not [c for c in calls if c[2] != keep]
    monkeypatch.setattr(gguf_pack, "release", release)
    plain = gguf_load.convert_in_place(mixed_file, torch.bfloat16, kernel()).weights
    assert_same_weights(weights, plain)


def test_an_untied_embedding_stays_in_the_gguf_mapping(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_untied_file(tmp_path / "untied.gguf")
    fresh = load(path, True)
    later = load(path, False)
    assert isinstance(later.embed, MappedRows) and isinstance(fresh.embed, MappedRows)
    every = torch.arange(later.dims.vocab_size)
    assert torch.equal(later.embed.rows(every), fresh.embed.rows(every))
    assert_same_weights(later, gguf_load.convert_in_place(path, torch.bfloat16, kernel()).weights)


def test_greedy_ids_are_the_same_from_the_packed_file(
    mixed_file: Path,  # noqa: F811
    cache: Path,
) -> None:
    def ids() -> list[int]:
        engine = Engine(EngineConfig(target=ModelConfig(str(mixed_file), max_seq_len=96)))
        params = GenerationParams.create(max_new_tokens=16)
        return list(engine.generate(prompt_token_ids=PROMPT, params=params).token_ids)

    first = ids()
    assert len(entries(cache)) == 1
    assert ids() == first


@pytest.mark.parametrize("damage", ["truncate", "header", "index"])
def test_a_damaged_entry_is_rebuilt(
    mixed_file: Path,  # noqa: F811
    cache: Path,
    monkeypatch: pytest.MonkeyPatch,
    damage: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    fresh = load(mixed_file, True)
    (entry,) = entries(cache)
    size = entry.stat().st_size
    with open(entry, "r+b") as handle:
        if damage == "truncate":
            handle.truncate(size - 1000)
        elif damage == "header":
            handle.write(b"NOTPACKD")
        else:  # the index's last byte: no longer JSON
            handle.seek(size - 1)
            handle.write(b"\x00")
    with caplog.at_level(logging.WARNING):
        assert packed_file.load(entry, checked_gguf(mixed_file), kernel()) is None
    assert "rebuilding" in caplog.text and not entry.exists()
    rebuilt = load(mixed_file, True)
    assert entries(cache) == [entry] and entry.stat().st_size == size
    assert_same_weights(load(mixed_file, False), fresh)
    assert_same_weights(rebuilt, fresh)


def test_an_edited_gguf_file_is_a_new_entry_and_old_ones_are_pruned(
    mixed_file: Path,  # noqa: F811
    cache: Path,
    tmp_path: Path,
) -> None:
    copy = tmp_path / mixed_file.name
    copy.write_bytes(mixed_file.read_bytes())
    seen = []
    for step in range(packed_file.KEEP_ENTRIES + 2):
        os.utime(copy, ns=(10**18 + step, 10**18 + step))
        seen.append(packed_file.entry_path(copy, kernel()))
        load_in_place(copy, torch.bfloat16, kernel())
    assert len(set(seen)) == len(seen)  # the modification time keys the entry
    assert entries(cache) == sorted(seen[-packed_file.KEEP_ENTRIES :])


def test_turned_off_by_the_setting_or_the_environment(
    mixed_file: Path,  # noqa: F811
    cache: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    load_in_place(mixed_file, torch.bfloat16, kernel(), cache=False)
    monkeypatch.setenv(packed_file.ENV, "0")
    load_in_place(mixed_file, torch.bfloat16, kernel())
    assert not (cache / "packed").exists()


@pytest.mark.parametrize("why", ["not a folder", "full disk", "no room to set aside"])
def test_a_cache_that_cannot_be_written_is_skipped_and_the_load_works(
    mixed_file: Path,  # noqa: F811
    cache: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    why: str,
) -> None:
    want = gguf_load.convert_in_place(mixed_file, torch.bfloat16, kernel()).weights
    if why == "not a folder":
        cache.mkdir(exist_ok=True)
        (cache / "packed").write_text("a file where the folder would be")
    else:

        def full(*args: object) -> int:
            raise OSError(28, "No space left on device")

        if why == "full disk":
            monkeypatch.setattr(packed_file.os, "pwrite", full)
        else:
            monkeypatch.setattr(packed_file, "reserve", full)
    with caplog.at_level(logging.WARNING):
        assert_same_weights(load(mixed_file, True), want)
    assert "cannot keep the packed weights" in caplog.text
    if why != "not a folder":
        assert "No space left" in caplog.text
        assert not list((cache / "packed").iterdir())  # the staging file removed


def test_the_setting_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="packed_cache"):
        ModelConfig(packed_cache="no")  # type: ignore[arg-type]
