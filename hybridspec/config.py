"""One typed configuration tree, with every bound and default of the configuration in one
place (a request's own options have theirs in ``types``; K's are here).

Each component receives only its own part: the n-gram proposer an ``NgramConfig``, the draft
proposer a ``DraftConfig``, the runtime a ``ModelConfig``, the engine an ``EngineConfig``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from hybridspec.errors import check

MIN_SPECULATIVE_TOKENS = 1
MAX_SPECULATIVE_TOKENS = 16
# Adaptive speculation's verify cost per token (engine.speculation), timed on the development
# CPU (2 cores, SmolLM2-135M bf16): 0.026..0.036 of a one-token forward.
DEFAULT_VERIFY_TOKEN_COST = 0.03
# A measured cost above this is timing noise (a loaded machine). Real ones grow with the model
# where the block kernel turns compute-bound: ~0.03 at 135M, ~0.25 at a 3B shape on one thread.
MAX_VERIFY_TOKEN_COST = 0.5
DTYPES = ("auto", "float32", "bfloat16", "float16")
# "gguf": keep a GGUF file's Q4_0/Q4_1/Q8_0 matrices as they are stored; "int4"/"int8": also
# quantize the dense matrices at load; "auto" (the default): "gguf" for a GGUF file where the
# block kernel runs, else "none" (model.loader.resolve_quantize).
QUANTIZE = ("auto", "none", "gguf", "int4", "int8")
MAX_DRAFT_COST_PER_TOKEN = 10.0
MAX_NUM_THREADS = 1024  # a draft ten times the target's cost never pays


def parse_num_threads(text: str) -> int | Literal["auto"]:
    """A ``--threads`` option's text: 'auto' or an integer (``EngineConfig`` bounds it); a
    ValueError otherwise, which argparse reports as an invalid value."""
    return "auto" if text == "auto" else int(text)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    """A finite int or float, not a bool."""
    return _is_int(value) or (isinstance(value, float) and math.isfinite(value))


def check_num_speculative_tokens(value: object, param: str = "num_speculative_tokens") -> None:
    check(
        _is_int(value) and MIN_SPECULATIVE_TOKENS <= value <= MAX_SPECULATIVE_TOKENS,  # type: ignore[operator]
        param,
        f"expected an integer in [{MIN_SPECULATIVE_TOKENS}, {MAX_SPECULATIVE_TOKENS}], "
        f"got {value!r}",
    )


NGRAM_CONTINUATIONS = ("copy", "frequency")


@dataclass(frozen=True, slots=True)
class NgramConfig:
    """Options of the n-gram proposer."""

    min_order: int = 1  # shortest context (in tokens) that keys a table
    max_order: int = 8  # longest context; matched first, backing off to shorter ones
    window: int = 512  # committed tokens (prompt included) that the tables remember
    table_capacity: int = 1 << 14  # slots per order's open-addressing table (a power of two)
    # "copy": the tokens that followed the latest occurrence of the longest matching context;
    # "frequency": each token the most frequent continuation, chained (see proposers.ngram).
    continuation: str = "copy"

    def __post_init__(self) -> None:
        check(
            self.continuation in NGRAM_CONTINUATIONS,
            "continuation",
            f"expected one of {NGRAM_CONTINUATIONS}, got {self.continuation!r}",
        )
        check(
            _is_int(self.min_order) and self.min_order >= 1,
            "min_order",
            f"expected an integer >= 1, got {self.min_order!r}",
        )
        check(
            _is_int(self.max_order) and self.min_order <= self.max_order <= 8,
            "max_order",
            f"expected an integer in [min_order={self.min_order}, 8], got {self.max_order!r}",
        )
        check(
            _is_int(self.window) and self.window >= self.max_order + 1,
            "window",
            f"expected an integer >= max_order + 1 = {self.max_order + 1}, got {self.window!r}",
        )
        check(
            _is_int(self.table_capacity)
            and self.table_capacity >= 16
            and self.table_capacity & (self.table_capacity - 1) == 0,
            "table_capacity",
            f"expected a power of two >= 16, got {self.table_capacity!r}",
        )


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Which model to load and how. ``name_or_path`` None means the embedded default."""

    name_or_path: str | None = None
    dtype: str = "auto"  # "auto" picks per device by measurement (see model.loader)
    device: str = "cpu"
    max_seq_len: int | None = None  # None: the model's own context length
    max_num_seqs: int = 8  # KV-cache slots: the most sequences alive at once
    quantize: str = "auto"  # one of QUANTIZE: weight matrices kept or made group-quantized
    # A GGUF file's packed weights kept in a file that later loads map (model.packed_file);
    # HYBRIDSPEC_PACKED_CACHE=0 also turns it off.
    packed_cache: bool = True

    def __post_init__(self) -> None:
        check(self.dtype in DTYPES, "dtype", f"expected one of {DTYPES}, got {self.dtype!r}")
        check(
            isinstance(self.packed_cache, bool),
            "packed_cache",
            f"expected a bool, got {self.packed_cache!r}",
        )
        check(
            self.quantize in QUANTIZE,
            "quantize",
            f"expected one of {QUANTIZE}, got {self.quantize!r}",
        )
        check(
            isinstance(self.device, str) and bool(self.device),
            "device",
            f"expected a device string such as 'cpu' or 'cuda', got {self.device!r}",
        )
        check(
            self.max_seq_len is None or (_is_int(self.max_seq_len) and self.max_seq_len >= 2),
            "max_seq_len",
            f"expected None or an integer >= 2, got {self.max_seq_len!r}",
        )
        check(
            _is_int(self.max_num_seqs) and 1 <= self.max_num_seqs <= 1024,
            "max_num_seqs",
            f"expected an integer in [1, 1024], got {self.max_num_seqs!r}",
        )


@dataclass(frozen=True, slots=True)
class DraftConfig:
    """The draft model of the ``draft`` proposer; ``model`` None means none is configured.

    ``cost_per_token``: the time of one draft token relative to a one-token target forward,
    which adaptive speculation charges for each draft. None measures it when the proposer is
    built; a seeded sampled request's text then depends on the figure measured (its drafts are
    sampled, and how many it asks for steers its randomness), so fix it for reproducible runs.
    """

    model: ModelConfig | None = None
    cost_per_token: float | None = None

    def __post_init__(self) -> None:
        _check_cost(self.cost_per_token)


@dataclass(frozen=True, slots=True)
class EagleConfig:
    """The draft head of the ``eagle`` and ``hybrid`` proposers.

    ``head``: a directory holding ``config.json`` and ``head.safetensors`` (what ``hybridspec
    distill`` writes), or a published EAGLE head (``proposers.eagle.published``); None picks the
    head shipped for the target, if there is one.
    ``cost_per_token`` as in ``DraftConfig``: None measures it when the proposer is built.
    ``catch_up``: the most real pairs a round feeds the head; a round with more pending (a
    request's first, or the first after a pause) starts the head over from the last
    ``catch_up`` (``proposers.eagle.proposer``); None feeds them all.
    """

    head: str | None = None
    cost_per_token: float | None = None
    catch_up: int | None = 16

    def __post_init__(self) -> None:
        check(
            self.head is None or (isinstance(self.head, str) and bool(self.head)),
            "head",
            f"expected None or a directory, got {self.head!r}",
        )
        _check_cost(self.cost_per_token)
        check(
            self.catch_up is None or (_is_int(self.catch_up) and self.catch_up >= 1),
            "catch_up",
            f"expected None or an integer >= 1, got {self.catch_up!r}",
        )


SUFFIX_ISOLATION = ("per-server", "per-session", "off")


@dataclass(frozen=True, slots=True)
class SuffixConfig:
    """The store of recent requests' text that the ``suffix`` proposer drafts from.

    ``max_tokens``: tokens kept (all pools together), the oldest leaving first. ``isolation``:
    which requests draft from which (``proposers.suffix``): "per-server" one pool for all,
    "per-session" a pool per session (the server's ``user`` field), "off" none.
    """

    max_tokens: int = 1 << 16
    isolation: str = "per-server"

    def __post_init__(self) -> None:
        check(
            _is_int(self.max_tokens) and 1024 <= self.max_tokens <= 1 << 24,
            "max_tokens",
            f"expected an integer in [1024, {1 << 24}], got {self.max_tokens!r}",
        )
        check(
            self.isolation in SUFFIX_ISOLATION,
            "isolation",
            f"expected one of {SUFFIX_ISOLATION}, got {self.isolation!r}",
        )


def _check_cost(cost: object) -> None:
    check(
        cost is None
        or (
            isinstance(cost, (int, float))
            and not isinstance(cost, bool)
            and 0 <= cost <= MAX_DRAFT_COST_PER_TOKEN
        ),
        "cost_per_token",
        f"expected None or a number in [0, {MAX_DRAFT_COST_PER_TOKEN}], got {cost!r}",
    )


@dataclass(frozen=True, slots=True)
class TenantConfig:
    """Fair admission across tenants (``engine.turns``; a request's tenant is
    ``GenerationParams.tenant``, requests without one count as one tenant).

    ``max_running`` / ``max_queued``: the most requests one tenant may have in the running
    batch / waiting (None: no bound of its own); beyond ``max_queued`` a request is refused
    with ``TenantLimitError``. ``reserved_slots``: of the engine's slots, the last this many
    free ones go only to a tenant with nothing running, so a tenant's burst leaves a slot that
    another tenant's first request takes at the next step.
    """

    max_running: int | None = None
    max_queued: int | None = None
    reserved_slots: int = 0

    def __post_init__(self) -> None:
        for name in ("max_running", "max_queued"):
            value = getattr(self, name)
            check(
                value is None or (_is_int(value) and value >= 1),
                name,
                f"expected None or an integer >= 1, got {value!r}",
            )
        check(
            _is_int(self.reserved_slots) and self.reserved_slots >= 0,
            "reserved_slots",
            f"expected an integer >= 0, got {self.reserved_slots!r}",
        )


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything the engine is built from."""

    target: ModelConfig = field(default_factory=ModelConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    ngram: NgramConfig = field(default_factory=NgramConfig)
    eagle: EagleConfig = field(default_factory=EagleConfig)
    suffix: SuffixConfig = field(default_factory=SuffixConfig)
    tenants: TenantConfig = field(default_factory=TenantConfig)
    default_proposer: str = "ngram"
    default_num_speculative_tokens: int = 8
    max_queue_size: int = 64  # requests waiting for a batch slot before CapacityError
    prefill_chunk_size: int = 512  # prompt tokens per prefill forward with nothing decoding
    # A step that prefills beside decoding requests is bounded in time (engine.step_budget):
    # its forward may take this many times the decoding requests' forward alone, at least
    # prefill_step_min_s and at most prefill_step_max_s seconds (a stream's gap between tokens
    # while prompts prefill; or twice the decoding forward where that alone is more); its prompts'
    # chunks are sized to fit. None: no time bound,
    # prefill_chunk_size tokens per step however deep. A step runs up to 1.5x its estimate on a
    # 2-core machine (the event loop and clients share the cores), so 0.16 s keeps a stream's
    # gaps under 0.25 s.
    prefill_step_ratio: float | None = 4.0
    prefill_step_min_s: float = 0.15
    prefill_step_max_s: float = 0.16
    # Adaptive speculation (engine.speculation): each round, a request asks for the drafts
    # (at most its K) whose estimated chance of acceptance pays for verifying them. False: K.
    adaptive_speculation: bool = True
    # Verifying one more token, relative to a forward's fixed cost. The default was measured on
    # the development CPU; None times it at start-up (seeded sampled outputs then vary by machine).
    verify_token_cost: float | None = DEFAULT_VERIFY_TOKEN_COST
    # Price a greedy request's drafts with each proposer's measured drafting time (engine.
    # proposer_costs) rather than its fixed cost_per_token. False: the fixed ones only, so that
    # the drafts asked for never depend on timing (the engine's tests).
    measure_proposer_costs: bool = True
    # The compiled structured-output grammars kept for reuse, in MiB (least recently used out).
    grammar_cache_mb: int = 64
    # CPU threads of the forward (torch's, the block kernel's, numba's: model.threads), set
    # where the engine is built. "auto": the cores the process may use (affinity, cgroup quota),
    # adapted to the load from measured step times (model.thread_policy), since on a machine
    # busy with other work fewer threads waste less time at the kernels' barriers waiting for
    # a thread the OS descheduled. An integer: that many, fixed. None: as the process has them.
    num_threads: int | Literal["auto"] | None = "auto"
    # The prefix cache across requests (engine.prefix_cache): megabytes of resident memory that
    # keys and values kept from finished requests (for later ones sharing a prefix) may hold.
    # None: sized to the machine where reuse is exact (the native bfloat16 runtime on CPU),
    # else off; 0: off.
    prefix_cache_mb: int | None = None

    def __post_init__(self) -> None:
        check(
            self.num_threads is None
            or self.num_threads == "auto"
            or (
                isinstance(self.num_threads, int)
                and _is_int(self.num_threads)
                and 1 <= self.num_threads <= MAX_NUM_THREADS
            ),
            "num_threads",
            f"expected 'auto', None or an integer in [1, {MAX_NUM_THREADS}], "
            f"got {self.num_threads!r}",
        )
        check(
            self.prefix_cache_mb is None
            or (_is_int(self.prefix_cache_mb) and self.prefix_cache_mb >= 0),
            "prefix_cache_mb",
            f"expected None or an integer >= 0, got {self.prefix_cache_mb!r}",
        )
        check(
            isinstance(self.adaptive_speculation, bool),
            "adaptive_speculation",
            f"expected a bool, got {self.adaptive_speculation!r}",
        )
        check(
            isinstance(self.measure_proposer_costs, bool),
            "measure_proposer_costs",
            f"expected a bool, got {self.measure_proposer_costs!r}",
        )
        check(
            self.verify_token_cost is None
            or (
                isinstance(self.verify_token_cost, (int, float))
                and not isinstance(self.verify_token_cost, bool)
                and 0 <= self.verify_token_cost <= 1
            ),
            "verify_token_cost",
            f"expected None or a number in [0, 1], got {self.verify_token_cost!r}",
        )
        check(
            isinstance(self.default_proposer, str) and bool(self.default_proposer),
            "default_proposer",
            f"expected a proposer name, got {self.default_proposer!r}",
        )
        check_num_speculative_tokens(
            self.default_num_speculative_tokens, "default_num_speculative_tokens"
        )
        check(
            _is_int(self.max_queue_size) and self.max_queue_size >= 1,
            "max_queue_size",
            f"expected an integer >= 1, got {self.max_queue_size!r}",
        )
        check(
            _is_int(self.grammar_cache_mb) and self.grammar_cache_mb >= 0,
            "grammar_cache_mb",
            f"expected an integer >= 0, got {self.grammar_cache_mb!r}",
        )
        check(
            self.prefill_step_ratio is None
            or (_is_number(self.prefill_step_ratio) and 1 <= self.prefill_step_ratio <= 1000),
            "prefill_step_ratio",
            f"expected None or a number in [1, 1000], got {self.prefill_step_ratio!r}",
        )
        check(
            _is_number(self.prefill_step_min_s) and 0 <= self.prefill_step_min_s <= 60,
            "prefill_step_min_s",
            f"expected a number of seconds in [0, 60], got {self.prefill_step_min_s!r}",
        )
        check(
            _is_number(self.prefill_step_max_s)
            and self.prefill_step_min_s <= self.prefill_step_max_s <= 60,
            "prefill_step_max_s",
            f"expected a number of seconds in [prefill_step_min_s, 60], "
            f"got {self.prefill_step_max_s!r}",
        )
        check(
            _is_int(self.prefill_chunk_size) and self.prefill_chunk_size >= 16,
            "prefill_chunk_size",
            f"expected an integer >= 16, got {self.prefill_chunk_size!r}",
        )
        check(
            isinstance(self.tenants, TenantConfig)
            and self.tenants.reserved_slots < self.target.max_num_seqs,
            "tenants",
            "expected a TenantConfig reserving fewer slots than max_num_seqs",
        )
