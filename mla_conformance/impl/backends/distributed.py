"""Reference distributed backends (issue 44), the layer contract across ranks (mla_conformance.contract.distributed):
``reference-tp`` (heads split, the latent cache whole on every rank), ``reference-dcp`` (every rank all heads, the
cache's tokens sharded by the interleave, partial attentions merged by lse over the group) and ``reference-tp-dcp``
(vLLM's DCP inside its TP group: heads split for the projections, queries all-gathered over the group, each rank
attending its tokens for every head, the lse merge reduced and each rank keeping its heads, o_proj row-parallel).
Collectives are torch.distributed's (gloo on CPU); absorbed MLA in float32 (float64 for float64 weights). Without
``distribute()`` (one process) each is an ordinary absorbed backend.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from mla_conformance.contract.distributed import Parallel
from mla_conformance.model.reference import absorbed_kv_b, project


def _owner_local(g: int, W: int, S: int) -> tuple[int, int]:
    return (g // S) % W, (g // (S * W)) * S + g % S


class DistLatentCache:
    """kv [B, local capacity, kv_lora + rope]: the tokens this rank owns, in their global order; seq_lens [B] the rows'
    global lengths, n_local [B] the tokens held here."""

    def __init__(self, cfg, batch_size, capacity, dtype, device, par: Parallel):
        self.batch_size, self.capacity, self.par = batch_size, capacity, par
        W, S = par.dcp_size, par.interleave
        local = capacity if W == 1 else (-(-capacity // (S * W))) * S
        self.kv = torch.zeros(batch_size, local, cfg.kv_lora_rank + cfg.qk_rope_head_dim, dtype=dtype, device=device)
        self.seq_lens = torch.zeros(batch_size, dtype=torch.int64, device=device)
        self.n_local = torch.zeros(batch_size, dtype=torch.int64)

    def tensors(self):
        return {"kv": self.kv}

    def allocated_nbytes(self):
        return self.kv.nbytes

    def active_nbytes(self):
        return int(self.n_local.sum()) * self.kv[0, 0].nbytes

    def global_positions(self, b: int) -> torch.Tensor:
        """The global positions of row b's local tokens."""
        W, S, r = self.par.dcp_size, self.par.interleave, self.par.dcp_rank
        li = torch.arange(int(self.n_local[b]))
        return (li // S) * S * W + r * S + li % S


class ReferenceDistributed:
    """The three plans in one class; the built-in names pick one (``distributed`` declares it)."""

    name = "reference-distributed"
    distributed = ("tp", "dcp", "tp+dcp")

    def __init__(self):
        self.par = Parallel.of("tp", 1, 0)

    def distribute(self, parallel: Parallel) -> None:
        self.par = parallel

    def unsupported_reason(self, config, *, dtype, device, kv_codec):
        if kv_codec != "none":
            return f"{self.name} keeps a plain latent cache, not {kv_codec}"
        if getattr(config, "dsa", False):
            return f"{self.name} is dense MLA"
        if config.num_attention_heads % self.par.tp_size:
            return f"{self.name}: {config.num_attention_heads} heads do not split over TP {self.par.tp_size}"
        return None

    def new_cache(self, config, *, batch_size, capacity, dtype, device, kv_codec="none"):
        return DistLatentCache(config, batch_size, capacity, dtype, device, self.par)

    def attend(self, weights, hidden_states, positions, cache, lengths=None):
        par, cfg = self.par, weights.config
        x, dt = hidden_states, hidden_states.dtype
        wd = torch.float64 if dt == torch.float64 else torch.float32
        B, S_new, _ = x.shape
        lengths = torch.full((B,), S_new) if lengths is None else lengths.to("cpu").long()
        w = weights.to(wd)
        q_nope, q_pe, c, k_pe = project(w, x.to(wd), positions)            # q: this rank's heads
        start = cache.seq_lens.to("cpu").clone()
        W, S = par.dcp_size, par.interleave
        for b in range(B):                                                  # keep the tokens this rank owns
            for i in range(int(lengths[b])):
                own, li = _owner_local(int(start[b]) + i, W, S)
                if own == par.dcp_rank:
                    cache.kv[b, li] = torch.cat([c[b, i], k_pe[b, i]]).to(cache.kv.dtype)
                    cache.n_local[b] = li + 1
        cache.seq_lens += lengths.to(cache.seq_lens.device)
        w_uk, w_uv = absorbed_kv_b(w)                                       # [H_local, nope, c], [H_local, v, c]
        q_lat = torch.einsum("bshn,hnc->bshc", q_nope, w_uk)
        if par.plan == "tp+dcp":                                            # every head of the group, here
            q_lat, q_pe = (torch.cat(self._all_gather(t.contiguous()), dim=2) for t in (q_lat, q_pe))
        scale = cfg.softmax_scale
        H = q_lat.shape[2]
        n_max = max(1, int(cache.n_local.max()))
        kv = cache.kv[:, :n_max].to(wd)
        held = torch.arange(n_max)[None, :] < cache.n_local[:, None]       # unwritten slots: selected away (NaN)
        kv = torch.where(held[..., None], kv, torch.zeros((), dtype=wd))
        scores = (torch.einsum("bshc,btc->bsht", q_lat, kv[..., :cfg.kv_lora_rank]) +
                  torch.einsum("bshr,btr->bsht", q_pe, kv[..., cfg.kv_lora_rank:])) * scale
        qpos = start[:, None] + torch.arange(S_new)[None, :]               # [B, S]: global query positions
        kpos = torch.full((B, n_max), -1, dtype=torch.int64)
        for b in range(B):
            g = cache.global_positions(b)
            kpos[b, :g.numel()] = g
        allowed = (kpos[:, None, :] >= 0) & (kpos[:, None, :] <= qpos[:, :, None])   # [B, S, t]
        scores = torch.where(allowed[:, :, None, :], scores, torch.tensor(-math.inf, dtype=wd))
        lse = torch.logsumexp(scores, dim=-1)                               # [B, S, H]; -inf: no key here
        p = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
        out = torch.einsum("bsht,btc->bshc", p, kv[..., :cfg.kv_lora_rank])
        if W > 1:                                                           # merge the ranks' partials by lse
            lses = torch.stack(self._all_gather(lse.contiguous()))          # [W, B, S, H]
            m = lses.amax(0)
            m = torch.where(torch.isinf(m), 0.0, m)
            total = torch.exp(lses - m).sum(0)
            weight = torch.exp(lse - m) / torch.where(total == 0, 1.0, total)
            out = out * weight[..., None]
            dist.all_reduce(out, group=par.group)
            if par.plan == "tp+dcp":                                        # keep this rank's heads
                h = H // W
                out = out[:, :, par.rank * h:(par.rank + 1) * h]
        o = torch.einsum("bshc,hvc->bshv", out, w_uv).flatten(2)
        y = o @ w["o_proj.weight"].T
        if par.tp_size > 1:
            dist.all_reduce(y, group=par.group)
        return y.to(dt)

    def _all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(t) for _ in range(self.par.world_size)]
        dist.all_gather(parts, t, group=self.par.group)
        return parts


class ReferenceTP(ReferenceDistributed):
    name = "reference-tp"
    distributed = ("tp",)


class ReferenceDCP(ReferenceDistributed):
    name = "reference-dcp"
    distributed = ("dcp",)


class ReferenceTPDCP(ReferenceDistributed):
    name = "reference-tp-dcp"
    distributed = ("tp+dcp",)
