"""``hybridspec serve`` as a subprocess on the embedded model, driven by the official client."""

from __future__ import annotations

import os
import shutil
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from hybridspec.cli import API_KEY_ENV, build_parser, server_config, uvicorn_config
from hybridspec.engine import Engine
from hybridspec.errors import InvalidRequestError
from hybridspec.model.loader import LoadedModel
from hybridspec.server import ServerConfig, create_app
from tests.server.conftest import free_port, run_in_thread, tiny_engine_config

openai = pytest.importorskip("openai")

STARTUP_TIMEOUT_S = 240.0
MAX_TOKENS = 8
CHAT = [{"role": "user", "content": "Name three colors."}]


def test_serve_options_build_the_server_config() -> None:
    args = build_parser().parse_args(
        [
            "serve",
            "--port",
            "9001",
            "--target",
            "m.gguf",
            "--draft",
            "d.gguf",
            "--dtype",
            "float32",
            "--proposer",
            "draft",
            "-k",
            "5",
            "--max-queue-size",
            "7",
        ]
    )
    config = server_config(args)
    assert (config.host, config.port) == ("127.0.0.1", 9001)
    assert config.engine.target.name_or_path == "m.gguf"
    assert config.engine.draft.model is not None
    assert config.engine.draft.model.name_or_path == "d.gguf"
    assert config.engine.target.dtype == "float32"
    assert config.engine.default_proposer == "draft"
    assert config.engine.default_num_speculative_tokens == 5
    assert config.engine.max_queue_size == 7
    assert config.engine.adaptive_speculation and config.engine.verify_token_cost == 0.03
    default = server_config(build_parser().parse_args(["serve"])).engine
    assert default.target.name_or_path is None
    assert not server_config(build_parser().parse_args(["serve"])).bench_twin
    assert server_config(build_parser().parse_args(["serve", "--bench-twin"])).bench_twin


def test_api_key_and_body_limit_options(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    default = server_config(build_parser().parse_args(["serve"]))
    assert (default.host, default.api_key) == ("127.0.0.1", None)
    assert default.max_body_bytes == 4 * 1024 * 1024
    options = ["serve", "--api-key", "sk-1", "--max-body-bytes", "1000"]
    config = server_config(build_parser().parse_args(options))
    assert (config.api_key, config.max_body_bytes) == ("sk-1", 1000)
    monkeypatch.setenv(API_KEY_ENV, "sk-from-env")
    assert server_config(build_parser().parse_args(["serve"])).api_key == "sk-from-env"
    assert server_config(build_parser().parse_args(options)).api_key == "sk-1"  # option wins
    monkeypatch.setenv(API_KEY_ENV, "")
    assert server_config(build_parser().parse_args(["serve"])).api_key is None
    with pytest.raises(InvalidRequestError, match="max_body_bytes"):
        server_config(build_parser().parse_args(["serve", "--max-body-bytes", "0"]))


def self_signed_certificate(directory: Path, password: str) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key, encrypted with ``password``, made by openssl."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed")
    cert, key = directory / "cert.pem", directory / "key.pem"
    command = ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt"]
    command += ["ec_paramgen_curve:prime256v1", "-keyout", str(key), "-out", str(cert)]
    command += ["-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"]
    command += ["-passout", f"pass:{password}"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        pytest.skip(f"openssl could not make a certificate: {result.stderr[-500:]}")
    return cert, key


def test_tls_options_reach_uvicorn(tmp_path: Path) -> None:
    cert, key = self_signed_certificate(tmp_path, "pw")
    options = ["serve", "--ssl-certfile", str(cert), "--ssl-keyfile", str(key)]
    config = server_config(build_parser().parse_args([*options, "--ssl-keyfile-password", "pw"]))
    assert "pw" not in repr(config)
    uvicorn_options = uvicorn_config(config, create_app(config), "warning")
    assert uvicorn_options.ssl_certfile == str(cert) and uvicorn_options.ssl_keyfile == str(key)
    assert uvicorn_options.ssl_keyfile_password == "pw" and uvicorn_options.is_ssl
    plain = uvicorn_config(ServerConfig(), create_app(), "warning")
    assert not plain.is_ssl and plain.host == "127.0.0.1"
    with pytest.raises(InvalidRequestError, match="ssl_certfile"):
        ServerConfig(ssl_keyfile=str(key))
    with pytest.raises(InvalidRequestError, match="ssl_certfile"):
        ServerConfig(ssl_certfile=str(tmp_path / "missing.pem"))


def test_https_with_a_self_signed_certificate(
    tmp_path: Path, tiny_model: LoadedModel, tiny_model_dir: Path
) -> None:
    cert, key = self_signed_certificate(tmp_path, "secret")
    port = free_port()
    config = ServerConfig(
        engine=tiny_engine_config(tiny_model_dir),
        port=port,
        api_key="sk-tls",
        ssl_certfile=str(cert),
        ssl_keyfile=str(key),
        ssl_keyfile_password="secret",
    )
    app = create_app(config, engine_factory=lambda cfg: Engine(cfg, target=tiny_model))
    trust = ssl.create_default_context(cafile=str(cert))
    with run_in_thread(uvicorn_config(config, app, "warning")):
        url = f"https://127.0.0.1:{port}"
        assert httpx.get(f"{url}/health", verify=trust, timeout=10).status_code == 200
        models = httpx.get(f"{url}/v1/models", verify=trust, timeout=10)
        assert models.status_code == 401
        headers = {"Authorization": "Bearer sk-tls"}
        models = httpx.get(f"{url}/v1/models", verify=trust, headers=headers, timeout=10)
        assert models.status_code == 200
        with pytest.raises(httpx.ConnectError):  # not trusted without the certificate
            httpx.get(f"{url}/health", timeout=10)


def test_threads_option() -> None:
    """``--threads``/``-t``: the forward's threads (``EngineConfig.num_threads``), bounded."""
    parse = build_parser().parse_args
    assert server_config(parse(["serve"])).engine.num_threads == "auto"
    assert server_config(parse(["serve", "-t", "auto"])).engine.num_threads == "auto"
    assert server_config(parse(["serve", "--threads", "2"])).engine.num_threads == 2
    assert server_config(parse(["serve", "-t", "1"])).engine.num_threads == 1
    with pytest.raises(ValueError, match="num_threads"):
        server_config(parse(["serve", "--threads", "0"]))
    with pytest.raises(SystemExit):
        parse(["serve", "--threads", "many"])


@pytest.mark.parametrize(
    ("options", "adaptive", "cost"),
    [(["--fixed-k"], False, 0.03), (["--verify-token-cost", "auto"], True, None)],
)
def test_speculation_options(options: list[str], adaptive: bool, cost: float | None) -> None:
    engine = server_config(build_parser().parse_args(["serve", *options])).engine
    assert (engine.adaptive_speculation, engine.verify_token_cost) == (adaptive, cost)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--verify-token-cost", "cheap"])


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The embedded default served by ``hybridspec serve`` on a free loopback port."""
    port = free_port()
    log = Path(tmp_path_factory.mktemp("serve")) / "server.log"
    command = [
        sys.executable,
        "-m",
        "hybridspec.cli",
        "serve",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-seq-len",
        "1024",
        "--max-num-seqs",
        "2",
        "--log-level",
        "warning",
    ]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if process.poll() is not None:
                pytest.fail(
                    f"hybridspec serve exited with {process.returncode}:\n{log.read_text()[-3000:]}"
                )
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"hybridspec serve did not become healthy:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)


@pytest.mark.slow
def test_official_client_against_the_embedded_model(served: str) -> None:
    client = openai.OpenAI(base_url=f"{served}/v1", api_key="unused", timeout=120, max_retries=0)
    (model,) = client.models.list().data
    assert model.id == "SmolLM2-135M-Instruct"

    whole = client.chat.completions.create(
        model=model.id, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0
    )
    text = whole.choices[0].message.content
    assert text and whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage is not None and 0 < whole.usage.completion_tokens <= MAX_TOKENS
    assert whole.model_extra is not None and "hybridspec" in whole.model_extra

    chunks = list(
        client.chat.completions.create(
            model=model.id, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason

    prompt = "The colors of the rainbow are red, orange, yellow, green, blue,"
    texts = {}
    for proposer, k in (("none", 1), ("ngram", 6)):
        completion = client.completions.create(
            model=model.id,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"proposer": proposer, "num_speculative_tokens": k},
        )
        texts[proposer] = completion.choices[0].text
        stats = completion.model_extra["hybridspec"]
        assert stats["proposer"] == proposer and stats["num_speculative_tokens"] == k
    assert texts["ngram"] == texts["none"] and texts["none"]

    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=model.id, prompt="hi", extra_body={"proposer": "draft"})
    assert refused.value.body["param"] == "proposer"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4o", prompt="hi")
