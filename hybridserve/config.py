"""EngineConfig: every engine knob in one dataclass, from keyword arguments, the CLI or the environment."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hybridserve.chat_format.modes import MODES as TOKENIZER_MODES

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "ki": 1024,
    "mi": 1024**2,
    "gi": 1024**3,
    "ti": 1024**4,
}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ENV_PREFIX = "HYBRIDSERVE_"


def parse_size(text: str | int) -> int:
    """``"2GiB"`` -> 2147483648; plain numbers are bytes."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(text)
    if not m or (m.group(2) or "").lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size (examples: 512MiB, 2GiB, 1000000)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


def default_model_path() -> str:
    return str(Path(__file__).parent / "assets" / "austen-v4")


SPECULATIVE_METHODS = ("mtp",)


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's ``speculative_config``: the draft method and how many tokens it drafts per step."""

    method: str
    num_speculative_tokens: int
    # Measure output tokens/s per load level and draft fewer (or none) where that is faster.
    adaptive: bool = True
    disable_by_batch_size: int | None = None  # vLLM's: no drafts while this many requests run

    @staticmethod
    def parse(value: dict[str, Any] | str | None) -> SpeculativeConfig | None:
        if value is None or value == "":
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--speculative-config is not valid JSON ({exc}): {value!r}") from exc
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
        keys = ("method", "num_speculative_tokens", "adaptive", "disable_by_batch_size")
        unknown = sorted(set(value) - set(keys))
        if unknown:
            known = ", ".join(keys)
            raise ValueError(f"speculative_config: unknown keys {unknown} (known: {known})")
        method = value.get("method")
        if method not in SPECULATIVE_METHODS:
            supported = list(SPECULATIVE_METHODS)
            raise ValueError(f"speculative_config: unknown method {method!r}; supported: {supported}")
        k = value.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an integer >= 1, got {k!r}")
        adaptive, off_at = value.get("adaptive", True), value.get("disable_by_batch_size")
        if not isinstance(adaptive, bool):
            raise ValueError(f"speculative_config: adaptive must be true or false, got {adaptive!r}")
        if off_at is not None and (not isinstance(off_at, int) or isinstance(off_at, bool) or off_at < 1):
            raise ValueError(
                f"speculative_config: disable_by_batch_size must be an integer >= 1, got {off_at!r}"
            )
        return SpeculativeConfig(str(method), k, adaptive, off_at)


@dataclass(frozen=True)
class ModelConfig:
    """Which model, in what precision, on which device, for how long a context."""

    model: str
    dtype: str
    device: str
    max_model_len: int | None
    dequantize_weights: bool
    native_fp8_matmul: bool
    seed: int


@dataclass(frozen=True)
class CacheConfig:
    """The cache plan's knobs: block size, memory or blocks, layout, prefix caching, KV dtype."""

    block_tokens: int | None
    kv_cache_bytes: int
    num_blocks: int | None
    layout: str  # arena or fixed, resolved
    enable_prefix_caching: bool
    window_cache_share: float
    kv_cache_dtype: str

    def resolve_block_tokens(self, strides: list[int]) -> int:
        """The configured block size, or the smallest multiple of every stride that is >= 16."""
        lcm = math.lcm(*strides) if strides else 1
        if self.block_tokens is not None:
            return self.block_tokens
        return lcm * max(1, math.ceil(16 / lcm))


@dataclass(frozen=True)
class SchedulerConfig:
    """How many requests run at once, a step's token budget, and the growth each keeps free."""

    max_num_seqs: int
    max_num_batched_tokens: int
    reserve_lookahead: int | None = None  # None: one block


@dataclass(frozen=True)
class ParallelConfig:
    """The data-parallel world of engine-core ranks, and whether they split the experts."""

    data_parallel_size: int
    data_parallel_size_local: int
    data_parallel_start_rank: int
    data_parallel_address: str
    data_parallel_rpc_port: int | None
    data_parallel_rank: int
    expert_parallel: bool


@dataclass(frozen=True)
class CompileConfig:
    """Which steps may run compiled (the worker's compile policy decides what actually does)."""

    enforce_eager: bool
    compile_decode: bool
    compile_prefill: bool


@dataclass(frozen=True)
class DisaggregationConfig:
    """This server's side of prefill/decode disaggregation, and where its KV handoff listens."""

    mode: str | None
    bootstrap_host: str
    bootstrap_port: int  # this rank's (each rank of a side hands off on its own; 0: a free one)
    kv_transfer_timeout: float


WINDOW_CACHE_SHARE_DEFAULT = 0.25


@dataclass
class EngineConfig:
    """Every engine knob, flat, as users give them: ``LLM(**kwargs)``, ``--flags``, ``HYBRIDSERVE_*``
    variables (vLLM's EngineArgs). Components take the sub-config of their concern whole
    (``scheduler_config``, ``cache_config``, ``compile_config``, ...), never a list of loose values."""

    model: str = field(default_factory=default_model_path, metadata={"help": "Hugging Face model folder"})
    dtype: str = field(
        default="auto", metadata={"help": "auto (the checkpoint's), float32, bfloat16, float16"}
    )
    tokenizer_mode: str = field(
        default="auto",
        metadata={
            "help": "conversation format: hf (the chat template), deepseek_v4 (DeepSeek-V4's encoder), "
            "auto (deepseek_v4 for a V4 checkpoint shipping the encoder or no chat template)"
        },
    )
    device: str = field(
        default="auto", metadata={"help": "auto (cuda if available, else cpu), cpu, cuda, cuda:N"}
    )
    max_num_seqs: int = field(default=32, metadata={"help": "most requests running at once"})
    max_num_batched_tokens: int = field(default=512, metadata={"help": "token budget of one step"})
    max_model_len: int | None = field(
        default=None, metadata={"help": "longest prompt + output (default: model)"}
    )
    block_tokens: int | None = field(default=None, metadata={"help": "tokens per logical cache block"})
    kv_cache_memory: str = field(default="1GiB", metadata={"help": "memory for every cache pool, e.g. 2GiB"})
    num_blocks: int | None = field(
        default=None, metadata={"help": "blocks per cache group (overrides memory)"}
    )
    enable_prefix_caching: bool = field(default=True, metadata={"help": "reuse cached prefixes"})
    window_cache_share: float = field(
        default=WINDOW_CACHE_SHARE_DEFAULT,
        metadata={
            "help": "with --cache-layout fixed: share of spare cache memory that keeps window context of "
            "cached prefixes (ignored by the arena, where groups take pages as they need them)"
        },
    )
    cache_layout: str | None = field(
        default=None,
        metadata={
            "help": "arena: every cache group draws pages from one byte arena as it needs them; fixed: each "
            "group gets a fixed share of --kv-cache-memory at start-up (--window-cache-share). Default: "
            "arena, or fixed with --num-blocks (N blocks per group is a fixed split; with --cache-layout "
            "arena it sizes an arena of the bytes of N blocks of every group)"
        },
    )
    seed: int = field(default=0, metadata={"help": "seed of the engine's sampler"})
    enforce_eager: bool = field(
        default=False,
        metadata={
            "help": "no torch.compile and no CUDA graphs: every step runs eagerly (by default the steps "
            "compile: see --compile-decode and --compile-prefill)"
        },
    )
    compile_decode: bool | None = field(
        default=None,
        metadata={
            "help": "pure-decode steps (with --speculative-config: steps that verify no drafts) over "
            "bucketed static shapes through torch.compile (CUDA graphs on CUDA); on by default unless "
            "--enforce-eager; the server serves eagerly while they compile in the background, and "
            "inductor caches them on disk"
        },
    )
    compile_prefill: bool | None = field(
        default=None,
        metadata={
            "help": "prefill and mixed steps (and speculative steps that verify drafts) through one "
            "torch.compile graph with dynamic sizes; on by default unless --enforce-eager (a step the "
            "graph does not fit runs eagerly)"
        },
    )
    compile_in_background: bool = field(
        default=True,
        metadata={
            "help": "the server answers at once, running steps eagerly while its compiled steps compile in "
            "a background thread; each takes over once ready (CPU; on CUDA the graphs are captured before "
            "the server answers). --no-compile-in-background: answer only once every step is compiled"
        },
    )
    engine_ready_timeout: float = field(
        default=1800.0,
        metadata={
            "help": "seconds the server waits for its engine core to load the model and compile its steps "
            "(0: as long as the core process lives); a core that exits is reported at once"
        },
    )
    dequantize_weights: bool = field(
        default=False,
        metadata={
            "help": "dequantise an FP8/FP4 checkpoint's weights to --dtype at load (2-4x the memory, same "
            "outputs); by default they stay quantized and each layer dequantises its own at use"
        },
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata={
            "help": "auto (the model dtype) or fp8: window KV, compressed rows and indexer keys in e4m3 with "
            "a power-of-two scale per 64 values (rope dimensions stay in the model dtype), like DeepSeek-V4"
        },
    )
    native_fp8_matmul: bool = field(
        default=True,
        metadata={
            "help": "on CUDA sm90+, FP8 weights multiply natively (torch scaled_mm; activations rounded to "
            "e4m3 per 128 values, as DeepSeek's kernels do); off: dequantise per layer at use"
        },
    )
    reserve_lookahead: int | None = field(
        default=None,
        metadata={
            "help": "tokens of growth each running request keeps free from new admissions "
            "(default: one block; 0 turns the reserve off)"
        },
    )

    data_parallel_size: int = field(
        default=1,
        metadata={"help": "engine-core ranks, each with its own scheduler and cache (DP attention)"},
    )
    enable_expert_parallel: bool = field(
        default=False,
        metadata={"help": "split the routed experts over the data-parallel ranks (torch.distributed)"},
    )
    data_parallel_size_local: int | None = field(
        default=None, metadata={"help": "ranks started on this host (default: all of them)"}
    )
    data_parallel_start_rank: int = field(default=0, metadata={"help": "first rank started on this host"})
    data_parallel_address: str = field(
        default="127.0.0.1",
        metadata={"help": "head host: its rendezvous store and engine sockets listen here"},
    )
    data_parallel_rpc_port: int | None = field(
        default=None,
        metadata={
            "help": "head's first port: store at PORT, outputs at PORT+1, rank r's inputs at PORT+2+r "
            "(default: free ports on one host)"
        },
    )
    data_parallel_rank: int = field(default=0, metadata={"help": "this engine core's rank (set per process)"})
    disaggregation_mode: str | None = field(
        default=None,
        metadata={"help": "prefill or decode: this server is one side of a disaggregated deployment"},
    )
    disaggregation_bootstrap_host: str = field(
        default="127.0.0.1",
        metadata={"help": "address this worker's KV handoff binds and announces (reachable by its peers)"},
    )
    disaggregation_bootstrap_port: int = field(
        default=0,
        metadata={
            "help": "prefill worker's KV rendezvous (TCPStore) port; data-parallel rank r binds PORT + r "
            "(0: free ones)"
        },
    )
    kv_transfer_timeout: float = field(
        default=30.0,
        metadata={"help": "seconds a handoff may wait: held blocks, queued imports, transfers"},
    )
    speculative_config: dict[str, Any] | str | None = field(
        default=None,
        metadata={
            "help": 'speculative decoding as JSON, e.g. \'{"method": "mtp", "num_speculative_tokens": 2}\''
        },
    )

    def __post_init__(self) -> None:
        if self.disaggregation_mode not in (None, "prefill", "decode"):
            raise ValueError(
                f"--disaggregation-mode must be prefill or decode, not {self.disaggregation_mode!r}"
            )
        if self.tokenizer_mode not in TOKENIZER_MODES:
            raise ValueError(f"--tokenizer-mode {self.tokenizer_mode!r}: choose {', '.join(TOKENIZER_MODES)}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        parse_size(self.kv_cache_memory)
        if self.cache_layout not in (None, "arena", "fixed"):
            raise ValueError(f"--cache-layout {self.cache_layout!r}: choose arena or fixed")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"--kv-cache-dtype {self.kv_cache_dtype!r}: choose auto or fp8")
        self._check_compile_flags()
        self._check_data_parallel()
        SpeculativeConfig.parse(self.speculative_config)  # a malformed one fails at start-up

    def _check_compile_flags(self) -> None:
        asked = {"--compile-decode": self.compile_decode, "--compile-prefill": self.compile_prefill}
        for flag, on in asked.items():
            if on and self.enforce_eager:
                raise ValueError(f"{flag} with --enforce-eager: choose one")
        if self.cache_layout == "arena" and self.kv_cache_dtype == "fp8" and self.compiles:
            raise ValueError(
                "--kv-cache-dtype fp8 with --cache-layout arena runs eagerly only (an FP8 cache keeps two "
                "dtypes in one arena); add --enforce-eager or use --cache-layout fixed"
            )

    @property
    def compiles(self) -> bool:
        """Whether any step may run compiled (the worker may still run them eagerly: see CompilePolicy)."""
        return self.compile_config.compile_decode or self.compile_config.compile_prefill

    def _check_data_parallel(self) -> None:
        n, local, start = self.data_parallel_size, self.local_ranks, self.data_parallel_start_rank
        if n < 1 or local < 1 or start < 0 or start + local > n:
            raise ValueError(
                f"data-parallel ranks {start}..{start + local - 1} do not fit a world of {n} "
                "(check --data-parallel-size, --data-parallel-size-local, --data-parallel-start-rank)"
            )
        if local < n and self.data_parallel_rpc_port is None:
            raise ValueError(
                "ranks on several hosts need --data-parallel-rpc-port (and --data-parallel-address)"
            )

    @property
    def local_ranks(self) -> int:
        local = self.data_parallel_size_local
        return self.data_parallel_size if local is None else local

    @property
    def rank_bootstrap_port(self) -> int:
        """This rank's KV handoff store port: each rank of a disaggregated side hands off on its own."""
        port = self.disaggregation_bootstrap_port
        return port + self.data_parallel_rank if port else 0

    @property
    def expert_parallel(self) -> bool:
        """Whether the ranks run the MoE layers together (else they are independent replicas)."""
        return self.enable_expert_parallel and self.data_parallel_size > 1

    @property
    def speculative(self) -> SpeculativeConfig | None:
        return SpeculativeConfig.parse(self.speculative_config)

    @property
    def model_config(self) -> ModelConfig:
        return ModelConfig(
            self.model,
            self.dtype,
            self.device,
            self.max_model_len,
            self.dequantize_weights,
            self.native_fp8_matmul,
            self.seed,
        )

    @property
    def cache_config(self) -> CacheConfig:
        return CacheConfig(
            self.block_tokens,
            self.kv_cache_bytes,
            self.num_blocks,
            self.resolved_cache_layout,
            self.enable_prefix_caching,
            self.window_cache_share,
            self.kv_cache_dtype,
        )

    @property
    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, self.reserve_lookahead)

    @property
    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(
            self.data_parallel_size,
            self.local_ranks,
            self.data_parallel_start_rank,
            self.data_parallel_address,
            self.data_parallel_rpc_port,
            self.data_parallel_rank,
            self.expert_parallel,
        )

    @property
    def compile_config(self) -> CompileConfig:
        """Both compiled unless --enforce-eager, or unless switched off one by one."""
        on = not self.enforce_eager
        decode, prefill = (
            on if flag is None else flag for flag in (self.compile_decode, self.compile_prefill)
        )
        return CompileConfig(self.enforce_eager, decode and on, prefill and on)

    @property
    def disaggregation_config(self) -> DisaggregationConfig:
        return DisaggregationConfig(
            self.disaggregation_mode,
            self.disaggregation_bootstrap_host,
            self.rank_bootstrap_port,
            self.kv_transfer_timeout,
        )

    @property
    def resolved_cache_layout(self) -> str:
        """The layout asked for, else arena; --num-blocks alone (blocks per group) means a fixed split, and
        so does an FP8 cache with compiled steps (its two dtypes in one arena would be aliased graph
        inputs: ``cache/flat_rows.py``)."""
        if self.cache_layout is not None:
            return self.cache_layout
        fp8_compiled = self.kv_cache_dtype == "fp8" and self.compiles
        return "fixed" if self.num_blocks is not None or fp8_compiled else "arena"

    @property
    def kv_cache_bytes(self) -> int:
        return parse_size(self.kv_cache_memory)

    def torch_device(self) -> torch.device:
        """This rank's device: with several local ranks on CUDA, rank r takes GPU r - start rank."""
        name = self.device if self.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        if name == "cuda" and self.data_parallel_size > 1:
            return torch.device("cuda", self.data_parallel_rank - self.data_parallel_start_rank)
        return torch.device(name)

    def torch_dtype(self, checkpoint_dtype: str | None) -> torch.dtype:
        name = self.dtype if self.dtype != "auto" else (checkpoint_dtype or "float32")
        if name not in _DTYPES:
            raise ValueError(f"unsupported dtype {name!r}; choose one of {sorted(_DTYPES)}")
        return _DTYPES[name]

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine arguments {unknown}; known: {sorted(names)}")
        return cls(**kwargs)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """One ``--flag-name`` per field; defaults may come from ``HYBRIDSERVE_FLAG_NAME``."""
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            default = os.environ.get(ENV_PREFIX + f.name.upper())
            if f.type in ("bool", bool, "bool | None"):
                parser.add_argument(
                    flag,
                    action=argparse.BooleanOptionalAction,
                    default=_env_bool(default),
                    help=f.metadata.get("help"),
                )
            else:
                parser.add_argument(flag, type=_field_type(f), default=default, help=f.metadata.get("help"))

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> EngineConfig:
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
        return cls(**{k: _coerce(cls, k, v) for k, v in values.items() if v is not None})


def _field_type(f: dataclasses.Field[Any]) -> Any:
    return {"float": float, "int": int}.get(str(f.type).split(" ")[0], str)


def _coerce(cls: type, name: str, value: Any) -> Any:
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return _field_type(f)(value) if not isinstance(value, bool) else value


def _env_bool(value: str | None) -> bool | None:
    if value is None:
        return None
    return value.lower() in ("1", "true", "yes", "on")
