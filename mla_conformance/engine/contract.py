"""The engine contract: a serving engine loaded from a checkpoint directory with a few options, asked for greedy
generations with the log-probabilities of the chosen and the top-k tokens of token-id prompts, and for the KV
cache it allocated (its own tensors).

An engine is named like a backend: ``ENGINE[:key=value,...]`` (``vllm:attention_backend=CPU_MLA,dtype=float32``;
:func:`parse_engine_spec`); the keys are :class:`EngineOptions`' fields. An adapter (``vllm.py``, ``sglang.py``) is
a class with::

    name: str
    unsupported_reason(options) -> str | None    # a sentence (the engine is not installed, takes no such option)
    load(model_dir, options) -> None
    effective_options() -> dict                   # the options as the engine runs them (it may turn some off)
    generate(prompts, max_new_tokens, top_k) -> list[Completion]
    kv_cache() -> KVCache | None                  # None: the engine does not expose its cache tensors
    close() -> None

Engines are heavy and may abort: the suite runs each configuration in a subprocess of its own
(:mod:`mla_conformance.engine.run`), never in the test process.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mla_conformance.errors import BackendSpecError

#: built-in engine adapters: name -> "module:class"
BUILTIN_ENGINES = {"vllm": "mla_conformance.engine.vllm:VLLMEngine",
                   "sglang": "mla_conformance.engine.sglang:SGLangEngine"}

_BOOL = {"on": True, "true": True, "1": True, "yes": True, "off": False, "false": False, "0": False, "no": False}


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """What an engine configuration sets; None leaves the engine's own default.

    dtype: the model dtype (float32, bfloat16, float16); attention_backend: the engine's name for its attention
    backend (vLLM: CPU_MLA, FLASHMLA, TRITON_MLA, ...); kv_cache_dtype: auto, fp8, fp8_e4m3, ...; page_size: tokens a
    cache block holds; chunked_prefill / prefix_caching / cuda_graphs: on or off; max_batched_tokens: the tokens one
    engine step takes (small with chunked_prefill: long prompts are prefilled in chunks); mla: off runs the engine's
    expanded-K/V attention instead of MLA (vLLM: VLLM_MLA_DISABLE=1)."""

    dtype: str | None = None
    attention_backend: str | None = None
    kv_cache_dtype: str | None = None
    page_size: int | None = None
    chunked_prefill: bool | None = None
    prefix_caching: bool | None = None
    cuda_graphs: bool | None = None
    max_batched_tokens: int | None = None
    mla: bool | None = None

    def set(self) -> dict[str, Any]:
        """The options given (not None), in field order."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}

    def text(self) -> str:
        return ",".join(f"{k}={_word(v)}" for k, v in self.set().items())


def _word(value) -> str:
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    engine: str
    options: EngineOptions

    def text(self) -> str:
        opts = self.options.text()
        return f"{self.engine}:{opts}" if opts else self.engine

    def with_options(self, **changes) -> "EngineSpec":
        return EngineSpec(self.engine, dataclasses.replace(self.options, **changes))


def parse_engine_spec(spec: str) -> EngineSpec:
    """``ENGINE[:key=value,...]`` -> EngineSpec (ENGINE: a built-in adapter's name or ``package.module.Class``, an
    adapter of one's own, importable from the working directory); a bad spec is one BackendSpecError naming it and the cause."""
    name, _, rest = spec.strip().partition(":")
    if name not in BUILTIN_ENGINES and "." not in name:
        raise BackendSpecError(f"engine spec {spec!r}: unknown engine {name!r}; known: {', '.join(BUILTIN_ENGINES)}, "
                               "or an adapter class as package.module.Class")
    fields = {f.name: f for f in dataclasses.fields(EngineOptions)}
    values: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not value:
            raise BackendSpecError(f"engine spec {spec!r}: {item!r} is not key=value")
        if key not in fields:
            raise BackendSpecError(f"engine spec {spec!r}: unknown option {key!r}; options: {', '.join(fields)}")
        kind = fields[key].type
        if "bool" in str(kind):
            if value.lower() not in _BOOL:
                raise BackendSpecError(f"engine spec {spec!r}: {key}={value}: expected on or off")
            values[key] = _BOOL[value.lower()]
        elif "int" in str(kind):
            try:
                values[key] = int(value)
            except ValueError:
                raise BackendSpecError(f"engine spec {spec!r}: {key}={value}: expected an integer") from None
            if values[key] <= 0:
                raise BackendSpecError(f"engine spec {spec!r}: {key}={value}: expected a positive integer")
        else:
            values[key] = value
    return EngineSpec(name, EngineOptions(**values))


@dataclasses.dataclass
class Completion:
    """One prompt's greedy continuation: the chosen tokens, each one's log-probability, and at each position the
    top-k tokens' log-probabilities (token id -> logprob) as the engine reports them; cached_tokens: the prompt
    tokens the engine took from its prefix cache."""

    tokens: list[int]
    logprobs: list[float]
    top: list[dict[int, float]]
    cached_tokens: int | None = None


@dataclasses.dataclass
class KVCacheTensor:
    """One of the engine's cache tensors: the layer it serves, shape, dtype, bytes, and the tokens it can hold."""

    layer: str
    shape: list[int]
    dtype: str
    nbytes: int
    tokens: int

    @property
    def bytes_per_token(self) -> float:
        return self.nbytes / self.tokens


@dataclasses.dataclass
class KVCache:
    """The engine's KV cache as allocated (its own tensors, one or more per layer), and the layout it says it
    stores (e.g. "latent" for MLA's [blocks, page, 576] cache, "expanded" for per-head K and V)."""

    tensors: list[KVCacheTensor]
    layout: str
    page_size: int | None = None

    def bytes_per_token_per_layer(self) -> float:
        """Bytes one token occupies in one layer's cache: each layer's tensors' bytes over the tokens they hold,
        the largest over layers (layers allocate alike)."""
        per_layer: dict[str, float] = {}
        for t in self.tensors:
            per_layer[t.layer] = per_layer.get(t.layer, 0.0) + t.bytes_per_token
        return max(per_layer.values()) if per_layer else 0.0


def get_engine(name: str):
    """An adapter instance: a built-in engine's, or of the class ``package.module.Class``."""
    import importlib

    module, _, cls = BUILTIN_ENGINES[name].partition(":") if name in BUILTIN_ENGINES else name.rpartition(".")
    try:
        return getattr(importlib.import_module(module), cls)()
    except (ImportError, AttributeError) as exc:
        raise BackendSpecError(f"engine {name!r}: no adapter class {cls!r} in {module!r} ({exc})") from None
