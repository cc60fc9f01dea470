"""A broken engine configuration: vLLM's CPU MLA decode kernel handed 0.8 x the softmax scale (a port that drops a
factor of it, as one that forgets YaRN's mscale^2 would), the prefill (SDPA) left right; through the engine contract
as ``tests.meta.impls.broken.engine_decode_scale.DecodeScaleTimes08``. The engine suite must fail it at the first
decode position, naming the decode path."""

from mla_conformance.engine.vllm import VLLMEngine

SCALE_FACTOR = 0.8


class DecodeScaleTimes08(VLLMEngine):
    name = "vllm-decode-scale-x0.8"

    def load(self, model_dir, options):
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.mla import cpu_mla

        kernel = ops.mla_decode_kvcache_cpu

        def wrong_scale(out, q, kv_cache, scale, block_table, seq_lens):
            return kernel(out, q, kv_cache, scale * SCALE_FACTOR, block_table, seq_lens)

        cpu_mla.ops.mla_decode_kvcache_cpu = wrong_scale  # the module's handle: CPUMLAImpl.forward_mqa calls it
        super().load(model_dir, options)
