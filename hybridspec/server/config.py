"""The server's part of the configuration: where it listens, what it calls its model, who may
use it (the API key, or the tenants' keys: ``server.tenants``) and how much one request may
send."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from hybridspec.config import EngineConfig
from hybridspec.errors import check

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
API_KEY_ENV = "HYBRIDSPEC_API_KEY"  # where the command line and hybridspec.deploy read a key
API_KEYS_FILE_ENV = "HYBRIDSPEC_API_KEYS_FILE"  # ... and the tenants' key file
CACHE_ISOLATION = ("per-tenant", "shared", "off")  # server.tenants


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
    # Tenants (server.tenants): (tenant, key) pairs, as an API key file gives them; each key
    # is a bearer key too. With them, admission takes tenants in turn, ``tenant_spare_slots``
    # slots are made beyond the engine's ``max_num_seqs`` for a tenant with nothing running
    # (so another's burst costs its first request no slot's wait), and cached text is scoped
    # per tenant unless ``cache_isolation`` says otherwise (None: per-tenant with tenants,
    # else shared).
    tenant_keys: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    tenant_spare_slots: int = 1
    cache_isolation: str | None = None
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
    # Once warm, collect and freeze the heap (``engine.freeze_heap``): the loaded model's and
    # the libraries' objects are left out of every later collection, a full pass over which
    # holds the interpreter lock (and so the engine thread) mid-stream for as long as it takes
    # to visit them all. ``hybridspec serve`` turns it on; off by default, since each app made
    # in one process (a test suite's) would pay a full collection at its start.
    freeze_heap: bool = False
    # For ``hybridspec bench --served``: a second engine over the same weights runs the requests
    # for ``none``, stepped by turns with the first (``engine.loop``), so that a method's
    # trial and ``none``'s run side by side through the same seconds of the machine.
    bench_twin: bool = False

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
            isinstance(self.tenant_keys, tuple)
            and all(isinstance(k, str) and k.split() == [k] for _, k in self.tenant_keys)
            and len({k for _, k in self.tenant_keys}) == len(self.tenant_keys),
            "tenant_keys",
            "expected (tenant, key) pairs of distinct keys without spaces",
        )  # the message never repeats a key
        check(
            isinstance(self.tenant_spare_slots, int) and 0 <= self.tenant_spare_slots <= 64,
            "tenant_spare_slots",
            f"expected an integer in [0, 64], got {self.tenant_spare_slots!r}",
        )
        check(
            self.cache_isolation is None or self.cache_isolation in CACHE_ISOLATION,
            "cache_isolation",
            f"expected None or one of {CACHE_ISOLATION}, got {self.cache_isolation!r}",
        )
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
        check(
            isinstance(self.freeze_heap, bool),
            "freeze_heap",
            f"expected a bool, got {self.freeze_heap!r}",
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

    @property
    def isolation(self) -> str:
        """The cache isolation in force (``cache_isolation``, or its default)."""
        if self.cache_isolation is not None:
            return self.cache_isolation
        return "per-tenant" if self.tenant_keys else "shared"

    def engine_config(self) -> EngineConfig:
        """The engine's configuration as the server runs it: with tenants, the spare slots
        added and reserved (``TenantConfig.reserved_slots``), and, under per-tenant isolation,
        the ``suffix`` pools per session (a tenant's scope is its session: ``per-server``
        would leave every scoped request without a pool)."""
        engine = self.engine
        if not self.tenant_keys:
            return engine
        target = dataclasses.replace(
            engine.target, max_num_seqs=engine.target.max_num_seqs + self.tenant_spare_slots
        )
        tenants = dataclasses.replace(engine.tenants, reserved_slots=self.tenant_spare_slots)
        suffix = engine.suffix
        if self.isolation == "per-tenant" and suffix.isolation == "per-server":
            suffix = dataclasses.replace(suffix, isolation="per-session")
        return dataclasses.replace(engine, target=target, tenants=tenants, suffix=suffix)

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
