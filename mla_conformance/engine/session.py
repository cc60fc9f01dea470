"""The engine suite's runs, each made once per pytest session and shared by the tests that read it: the float64
reference per model, and per engine spec and model the configurations the checks need, each in a subprocess of its
own (:func:`mla_conformance.engine.run.run_engine`):

* ``cold``: the spec as given (prefix caching asked on unless the spec says), the prompts twice in one engine: the
  first pass is cold (an empty cache), the second may reuse the first's cached prefixes;
* ``chunked``: chunked prefill with a token budget of CHUNK_TOKENS a step (the long prompts prefilled in chunks),
  prefix caching off;
* ``fp8``: kv_cache_dtype=fp8;
* ``expanded``: mla=off (the engine's expanded K/V; vLLM: VLLM_MLA_DISABLE=1), one short generation, for its bytes.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from mla_conformance.engine.contract import EngineSpec
from mla_conformance.engine.run import EngineRun, run_engine
from mla_conformance.resources import fixtures_dir

#: the pinned models: name -> whether an engine must take it (the 576-dim model is at DeepSeek's MLA dims; tiny-mla's
#: head of 80 is one an engine may refuse: its refusal is reported as the engine's sentence)
ENGINE_MODELS = {"tiny-mla-576": True, "tiny-mla": False}
#: each model's pinned prompts (fixtures/; fixtures/train_tiny.py writes them with the model, the same tasks)
PROMPT_FILES = {"tiny-mla-576": "prompts-576.json", "tiny-mla": "prompts.json"}
#: the pinned prompt sets used
PROMPT_SETS = ("tiny-short", "tiny-long")
#: tokens generated per prompt: its pinned answer's length (max_new_tokens, as the goldens generate), 2 to 24 here.
#: Not beyond: past the answer (an EOS for a recall) the tiny models are off their training distribution, where
#: bfloat16 roundings move the hidden state far (tiny-mla-576, tiny-short-06-recall, the step fed its EOS: layer 1's
#: router logits 1.74 in float64, 2.12 in bfloat16) and a log-probability by several units in any bfloat16
#: implementation (the project's own bfloat16 references too: -4.32 in float64, -11.66 through reference-absorbed):
#: no engine's property
#: top-k log-probabilities asked for at each position
TOP_K = 5
#: the chunked configuration's token budget per engine step: every tiny-long prompt (163-218 tokens) is prefilled
#: in 6-7 chunks
CHUNK_TOKENS = 32
VARIANTS = ("cold", "chunked", "fp8", "expanded")


def model_dir(name: str) -> Path:
    return fixtures_dir() / "models" / name


def prompts_path(model: str) -> Path:
    return fixtures_dir() / PROMPT_FILES[model]


@dataclasses.dataclass
class Prompts:
    ids: list[str]
    tokens: list[list[int]]
    new_tokens: list[int]


class EngineSession:
    def __init__(self):
        self._runs: dict[tuple[str, str, str], EngineRun] = {}
        self._refs: dict[str, list] = {}

    @staticmethod
    def prompts(model: str) -> Prompts:
        from mla_conformance.generation.generate import episodes, load_prompts, new_tokens  # transformers: only here

        cfg = json.loads((model_dir(model) / "config.json").read_text(encoding="utf-8"))
        limit = int(cfg.get("max_position_embeddings", 1 << 20))
        eps = episodes(load_prompts(prompts_path(model)), list(PROMPT_SETS))
        return Prompts([e["id"] for e in eps], [e["token_ids"] for e in eps],
                       [max(1, min(new_tokens(e), limit - len(e["token_ids"]))) for e in eps])

    def reference(self, model: str, kv_codec: str = "none") -> list:
        key = f"{model}/{kv_codec}"
        if key not in self._refs:
            from mla_conformance.engine.reference import reference_greedy  # torch: only when a reference is made

            p = self.prompts(model)
            self._refs[key] = reference_greedy(model_dir(model), p.tokens, p.new_tokens, kv_codec=kv_codec)
        return self._refs[key]

    def configuration(self, spec: EngineSpec, variant: str) -> tuple[EngineSpec, dict]:
        """The spec a variant runs and run_engine's keywords."""
        opts = spec.options
        if variant == "cold":
            return (spec if opts.prefix_caching is not None else spec.with_options(prefix_caching=True)), {"passes": 2}
        if variant == "chunked":
            return spec.with_options(chunked_prefill=True, prefix_caching=False,
                                     max_batched_tokens=opts.max_batched_tokens or CHUNK_TOKENS), {
                "varied": "chunked_prefill=on", "require": ("chunked_prefill",)}
        if variant == "fp8":
            return spec.with_options(kv_cache_dtype="fp8"), {"varied": "kv_cache_dtype=fp8"}
        if variant == "expanded":
            return spec.with_options(mla=False), {"varied": "mla=off", "require": ("mla",), "short": True}
        raise ValueError(variant)

    def run(self, spec: EngineSpec, model: str, variant: str = "cold") -> EngineRun:
        key = (spec.text(), model, variant)
        if key not in self._runs:
            vspec, kw = self.configuration(spec, variant)
            p = self.prompts(model)
            tokens, new = (p.tokens[:1], [1]) if kw.pop("short", False) else (p.tokens, p.new_tokens)
            self._runs[key] = run_engine(vspec, model_dir(model), tokens, new, top_k=TOP_K, **kw)
        return self._runs[key]

    def runs(self) -> dict[tuple[str, str, str], EngineRun]:
        return dict(self._runs)
