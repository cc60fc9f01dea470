"""SGLang's offline ``Engine`` behind the engine contract, where SGLang installs (it ships CUDA builds; there is no
CPU wheel this project can install here). Not run here: written against SGLang's documented offline API
(``sglang.Engine(model_path=..., skip_tokenizer_init=True)``, ``generate(input_ids=..., sampling_params=...,
return_logprob=True, top_logprobs_num=k)``, ``meta_info["output_token_logprobs"]`` / ``["output_top_logprobs"]``:
(logprob, token_id, text) tuples); it does not expose its cache tensors (``kv_cache`` returns None: the bytes test
skips with a sentence)."""

from __future__ import annotations

from mla_conformance.engine.contract import Completion, EngineOptions, KVCache
from mla_conformance.errors import environment_line


class SGLangEngine:
    name = "sglang"

    def __init__(self):
        self.engine = None
        self._options: dict = {}

    def unsupported_reason(self, options: EngineOptions) -> str | None:
        try:
            import sglang  # noqa: F401
        except Exception as exc:
            return (f"SGLang is not installed or does not import here ({environment_line(exc)}); it installs on a "
                    "CUDA host: pip install sglang (docs/engines.md)")
        if options.mla is False:
            return "the sglang adapter has no switch to SGLang's expanded-K/V attention (mla=off)"
        return None

    def load(self, model_dir, options: EngineOptions) -> None:
        import sglang

        kwargs = dict(model_path=str(model_dir), skip_tokenizer_init=True, random_seed=0)
        for ours, theirs in (("dtype", "dtype"), ("attention_backend", "attention_backend"),
                             ("kv_cache_dtype", "kv_cache_dtype"), ("page_size", "page_size"),
                             ("max_batched_tokens", "chunked_prefill_size")):
            value = getattr(options, ours)
            if value is not None:
                kwargs[theirs] = value
        if options.chunked_prefill is False:
            kwargs["chunked_prefill_size"] = -1
        if options.prefix_caching is False:
            kwargs["disable_radix_cache"] = True
        if options.cuda_graphs is False:
            kwargs["disable_cuda_graph"] = True
        self._options = dict(options.set())
        self.engine = sglang.Engine(**kwargs)

    def effective_options(self) -> dict:
        return dict(self._options)

    def generate(self, prompts: list[list[int]], max_new_tokens: list[int], top_k: int) -> list[Completion]:
        params = [{"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True} for n in max_new_tokens]
        outs = self.engine.generate(input_ids=[list(p) for p in prompts], sampling_params=params,
                                    return_logprob=True, top_logprobs_num=top_k)
        result = []
        for out in outs:
            meta = out["meta_info"]
            chosen = meta["output_token_logprobs"]
            tops = meta.get("output_top_logprobs") or [[] for _ in chosen]
            result.append(Completion([int(t) for _, t, *_ in chosen], [float(lp) for lp, *_ in chosen],
                                     [{int(t): float(lp) for lp, t, *_ in top} for top in tops],
                                     meta.get("cached_tokens")))
        return result

    def kv_cache(self) -> KVCache | None:
        return None

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
        self.engine = None
