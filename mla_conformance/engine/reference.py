"""The engine suite's reference: the project's float64 model (transformers' DeepseekV2 modules around the
reference-naive attention over the expanded K/V, :func:`mla_conformance.generation.generate.greedy_generate`),
generating greedily from the same token ids, with the full next-token log-probabilities at each position."""

from __future__ import annotations

import dataclasses

import torch

#: the float64 oracle (the expanded K/V, every product in float64)
REFERENCE_BACKEND = "reference-naive"


@dataclasses.dataclass
class ReferenceCompletion:
    """The reference's greedy tokens and, at each position, log_softmax of its float64 logits (the whole vocab)."""

    tokens: list[int]
    logprobs: list[torch.Tensor]

    def margin(self, position: int) -> float:
        """Top-1 minus top-2 log-probability (= logit difference) at ``position``."""
        top2 = torch.topk(self.logprobs[position], 2).values
        return float(top2[0] - top2[1])


#: a quantized latent cache's reference: the codec runs in reference-absorbed, in the dtype its layout is defined for
#: (fp8-e4m3-flashmla: FlashMLA's bfloat16-model layout), as the per-codec goldens run it
CODEC_REFERENCE = ("reference-absorbed", torch.bfloat16)


def reference_greedy(model_dir, prompts: list[list[int]], max_new_tokens: list[int], *, kv_codec: str = "none",
                     model=None) -> list[ReferenceCompletion]:
    """The float64 reference's greedy generation (``kv_codec`` none), or the codec's (CODEC_REFERENCE)."""
    # transformers (generation) and the backends (specs) only when a reference is computed, in the engine suite
    from mla_conformance.generation.generate import greedy_generate, load_model
    from mla_conformance.specs import get_backend  # as above

    backend, dtype = (REFERENCE_BACKEND, torch.float64) if kv_codec == "none" else CODEC_REFERENCE
    if model is None:
        model = load_model(model_dir, dtype)
        if hasattr(model, "set_experts_implementation"):  # transformers' grouped_mm MoE takes no float64
            model.set_experts_implementation("eager")
    steps: list[list[torch.Tensor]] = [[] for _ in prompts]

    def record(logits, active):
        lp = torch.log_softmax(logits.to(torch.float64), -1).cpu()
        for b, on in enumerate(active):
            if on:
                steps[b].append(lp[b])

    gen = greedy_generate(model, get_backend(backend), prompts, max_new_tokens, kv_codec=kv_codec,
                          on_logits=record)
    return [ReferenceCompletion(toks, lps) for toks, lps in zip(gen.tokens, steps)]
