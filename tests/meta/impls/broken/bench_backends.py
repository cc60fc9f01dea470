"""Broken backends for the benchmark's correctness gate (mla_conformance.perf.gate) at long rows: wrong by only a few
times the gate's bound there, where the score-rounding term (mla_conformance.perf.score_rounding) has widened it.
tests/meta/test_bench_refuses.py holds the gate to refusing each."""

from __future__ import annotations

from mla_conformance.impl.backends.reference import ReferenceAbsorbed
from mla_conformance.model import reference as ref
from mla_conformance.model.config import yarn_get_mscale


class MscaleOnce(ReferenceAbsorbed):
    """YaRN's attention factor applied once instead of squared: YaRN scales both q and k by mscale(factor,
    mscale_all_dim), so the logits carry mscale^2 (``MLAConfig.softmax_scale``); a kernel that multiplies only q by
    it computes every logit 1/mscale too small (x0.83 at v3-mini's factor 8, x0.79 at V2-Lite's 40): softer
    attention, an output error that grows with the logits' magnitude, as the score rounding's does."""

    name = "broken-mscale-once"

    def attend(self, weights, hidden_states, positions, cache, lengths=None):
        cfg = weights.config
        y = cfg.yarn or {}
        once = 1 / yarn_get_mscale(float(y.get("factor", 1.0)), float(y.get("mscale_all_dim") or 1.0))
        lengths, new_lens = cache.write_plan(positions, lengths)
        q_nope, q_pe, c, k_pe = ref.project(weights, hidden_states, positions)
        cache.write_latent(c, k_pe, lengths)
        T = int(new_lens.max())
        allowed = cache.allowed(lengths, new_lens, hidden_states.shape[1], T)
        c_all, kpe_all = cache.read_latent(T, new_lens)
        out = ref.absorbed_scores_and_mix(weights, q_nope * once, q_pe * once, c_all, kpe_all, allowed)
        cache.commit(new_lens)
        return out.to(hidden_states.dtype)
