"""The server's part of the configuration: where it listens, what it calls its model, who may
use it (the API key) and how much one request may send."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from hybridspec.config import EngineConfig
from hybridspec.errors import check

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
API_KEY_ENV = "HYBRIDSPEC_API_KEY"  # where the command line and hybridspec.deploy read a key


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Everything the HTTP server is built from; ``engine`` goes to the Engine unchanged."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"  # loopback unless asked otherwise
    port: int = 8000
    served_model_name: str | None = None  # None: derived from the target (see model_names)
    health_timeout_s: float = 5.0  # the engine thread must answer /health within this
    retry_after_s: int = 1  # Retry-After of a 503 when the request queue is full
    max_prompt_tokens: int | None = None  # None: the context but one token
    # None: no authentication. Else every route but GET|HEAD /health wants it as a bearer key.
    api_key: str | None = field(default=None, repr=False)
    # 4 MiB: a full 128k-token context is about 0.5 MB of text or 1 MB of token ids as JSON,
    # so this fits the largest real prompt a few times over while bounding what one request
    # makes the server hold.
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # TLS, passed to uvicorn: the certificate chain (PEM; may hold the key too), its key file
    # and that key's password. Without a certificate the server speaks plain HTTP.
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_keyfile_password: str | None = field(default=None, repr=False)
    # Robustness (docs/reliability.md): a grammar must compile within grammar_timeout_s (else
    # 400); at shutdown, running requests get shutdown_timeout_s to finish; a stream whose
    # client reads nothing for stream_write_timeout_s is aborted; a request's headers, and its
    # body, must each arrive within request_read_timeout_s (else the connection is closed, or a
    # 408 for the body); an idle keep-alive connection is closed after
    # keep_alive_timeout_s.
    grammar_timeout_s: float = 5.0
    shutdown_timeout_s: float = 10.0
    stream_write_timeout_s: float = 30.0
    request_read_timeout_s: float = 30.0
    keep_alive_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        check(
            isinstance(self.engine, EngineConfig),
            "engine",
            f"expected an EngineConfig, got {type(self.engine).__name__}",
        )
        check(
            isinstance(self.host, str) and bool(self.host),
            "host",
            f"expected a host name or address, got {self.host!r}",
        )
        check(
            isinstance(self.port, int) and 0 <= self.port <= 65535,
            "port",
            f"expected an integer in [0, 65535], got {self.port!r}",
        )
        check(
            self.served_model_name is None or bool(self.served_model_name),
            "served_model_name",
            f"expected None or a non-empty name, got {self.served_model_name!r}",
        )
        check(
            self.health_timeout_s > 0,
            "health_timeout_s",
            f"expected a positive number of seconds, got {self.health_timeout_s!r}",
        )
        check(
            isinstance(self.retry_after_s, int) and self.retry_after_s >= 1,
            "retry_after_s",
            f"expected an integer >= 1, got {self.retry_after_s!r}",
        )
        key = self.api_key
        check(
            key is None or (isinstance(key, str) and key.isprintable() and key.split() == [key]),
            "api_key",
            "expected None or a non-empty key of printable characters without spaces",
        )  # the message never repeats the key
        check(
            isinstance(self.max_body_bytes, int) and self.max_body_bytes >= 1,
            "max_body_bytes",
            f"expected an integer >= 1, got {self.max_body_bytes!r}",
        )
        check(
            self.max_prompt_tokens is None
            or (isinstance(self.max_prompt_tokens, int) and self.max_prompt_tokens >= 1),
            "max_prompt_tokens",
            f"expected None or an integer >= 1, got {self.max_prompt_tokens!r}",
        )
        for name in (
            "grammar_timeout_s",
            "shutdown_timeout_s",
            "stream_write_timeout_s",
            "request_read_timeout_s",
            "keep_alive_timeout_s",
        ):
            value = getattr(self, name)
            check(
                isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0,
                name,
                f"expected a positive number of seconds, got {value!r}",
            )
        self._check_tls()

    def _check_tls(self) -> None:
        for name in ("ssl_certfile", "ssl_keyfile"):
            path = getattr(self, name)
            check(
                path is None or os.path.isfile(path),
                name,
                f"expected None or an existing file, got {path!r}",
            )
        check(
            self.ssl_certfile is not None
            or (self.ssl_keyfile is None and self.ssl_keyfile_password is None),
            "ssl_certfile",
            "a key file or its password needs the certificate file too",
        )

    def model_names(self) -> tuple[str, ...]:
        """The name /v1/models lists first, then the other names requests may use for it.

        The embedded default is ``SmolLM2-135M-Instruct``; a hub id is served under itself; a
        local directory or file under its base name (``/m/tiny.gguf`` -> ``tiny``), with the
        path as given accepted too.
        """
        target = self.engine.target.name_or_path
        names: list[str] = []
        if self.served_model_name is not None:
            names.append(self.served_model_name)
        if target is None:
            names.append(EMBEDDED_MODEL_NAME)
        else:
            stripped = target.rstrip("/\\")
            if os.path.exists(stripped):
                base = os.path.basename(stripped)
                names.append(base[: -len(".gguf")] if base.endswith(".gguf") else base)
            names.append(target)
        return tuple(dict.fromkeys(names))
