"""A DeepSeek-V4 layer over an op: projections, the compressors and the CSA indexer in torch (reference-v4's),
the attention in the op's sparse decode over two caches with the sink -- FlashMLA's V4 ("MODEL1") decode call.

``--mla-backend op:SPEC`` on a V4 config (:class:`mla_conformance.impl.ops.layer.OpBackend` hands V4 configs
here) runs the V4 layer suite through any op that declares what the call needs: ``decode`` with
``sparse_decode`` and ``sparse_decode_extra_cache``, ``attn_sink``, and the V4 head dims (head_dim, head_dim)
in ``head_dims`` (q and the KV vector are head_dim wide, the value is the whole vector: d_qk = d_v). Each token of
a call is one decode step (s_q 1, as an engine decodes), for the rows that have it::

    window cache   paged [B x W/page pages, page, 1, head_dim]: row b's ring of the last W KV vectors
    extra cache    paged [B x C pages, page, 1, head_dim]: row b's compressed entries (CSA / HCA)
    indices        [B, 1, W]: the ring slots of the window tokens the query sees (p - W < t <= p), -1 else
    extra_indices  [B, 1, k]: the attended entries (CSA: the indexer's top-k of the closed ones; HCA: all closed)
    attn_sink      float32 [H]: the layer's sinks; softmax_scale head_dim^-0.5
    out = op.decode(q [B, 1, H, head_dim], ...)[0]  ->  inverse RoPE, grouped output projection (torch)

The pages hold the cache dtype (format "latent"). What the op declines for that case is the skip sentence.
"""

from __future__ import annotations

import torch

from mla_conformance.contract.op import OpCase, declared, takes_head_dims
from mla_conformance.kv import model1
from mla_conformance.impl.backends.v4 import ReferenceV4, add_compressor_buffers, v4_active_nbytes
from mla_conformance.model.v4_config import CSA, V4Config
from mla_conformance.model.v4_reference import inv_freq


#: the layer's kv_codec -> the op's kv format of the V4 pages
FORMATS = {"none": "latent", model1.NAME: model1.NAME}


class V4OpCache:
    """The V4 cache of the op path: the window ring and the compressed entries as op pages (views of them by
    row for writing), the indexer keys and the compressors' state as reference-v4 keeps them."""

    def __init__(self, config: V4Config, *, batch_size, capacity, dtype, device, page_block_size: int,
                 kv_codec: str = "none"):
        self.config, self.batch_size, self.capacity, self.dtype = config, batch_size, capacity, dtype
        self.page_block_size = page = page_block_size
        self.kv_codec = kv_codec
        B, W, m = batch_size, config.sliding_window, config.compress_ratio
        self.seq_lens = torch.zeros(B, dtype=torch.int64, device=device)
        self.window_pages_per_row = -(-W // page)
        self._t = {"window": self._pages(B * self.window_pages_per_row, device)}
        self.v4_layout = {"window": "window"}
        self.entry_pages_per_row = 0
        if m:
            self.entry_pages_per_row = -(-max(capacity // m, 1) // page)
            self._t["compressed"] = self._pages(B * self.entry_pages_per_row, device)
            self.v4_layout["compressed"] = "compressed"
            add_compressor_buffers(self, config, capacity=capacity, dtype=dtype, device=device)

    def _pages(self, blocks: int, device) -> torch.Tensor:
        """Page blocks of KV rows: [blocks, page, 1, head_dim] in the cache dtype, or MODEL1's block memory
        uint8 [blocks, block_bytes(page)] (mla_conformance.kv.model1)."""
        if self.kv_codec == model1.NAME:
            return torch.zeros(blocks, model1.block_bytes(self.page_block_size), dtype=torch.uint8, device=device)
        return torch.zeros(blocks, self.page_block_size, 1, self.config.head_dim, dtype=self.dtype, device=device)

    def op_view(self, name: str) -> torch.Tensor:
        """The pages as the op reads them: [blocks, page, 1, head_dim], or MODEL1's [blocks, page, 1, 584] view."""
        t = self._t[name]
        return model1.cache_view(t, self.page_block_size) if self.kv_codec == model1.NAME else t

    def put_row(self, name: str, slot: int, row: torch.Tensor) -> None:
        """KV row [head_dim] at flat slot (block * page + offset): in the cache dtype, or MODEL1's two spans (its
        576-byte part and its 7 scale bytes; the padding byte is not written, as FlashMLA's writer leaves it)."""
        block, offset = divmod(int(slot), self.page_block_size)
        if self.kv_codec == model1.NAME:
            parts = model1.encode(row[None, :model1.D_NOPE], row[None, model1.D_NOPE:])
            for (start, length), part in zip(model1.spans(self.page_block_size, offset), parts):
                self._t[name][block, start:start + length] = part[0]
        else:
            self._t[name][block, offset, 0] = row.to(self.dtype)

    def tensors(self) -> dict[str, torch.Tensor]:
        return dict(self._t)

    def allocated_nbytes(self) -> int:
        return sum(t.nbytes for t in self._t.values())

    def active_nbytes(self) -> int:
        row = model1.TOKEN_BYTES if self.kv_codec == model1.NAME else \
            self.config.head_dim * self._t["window"].element_size()
        return v4_active_nbytes(self, row)


class _Staged:
    """reference-v4's compressor over the op cache: its entries land in row b's compressed pages, its indexer keys
    and state where reference-v4 keeps them."""

    def __init__(self, cache: V4OpCache):
        self.cache, self.config, self.dtype, self._t = cache, cache.config, cache.dtype, cache._t

    def put(self, name, b, slots, rows):
        if name == "compressed":
            page = self.cache.page_block_size
            self.cache.put_row(name, b * self.cache.entry_pages_per_row * page + int(slots), rows[0])
        else:
            self._t[name][b, slots] = rows.to(self._t[name].dtype)


class V4OpPath:
    """The V4 half of an OpBackend (``backend.op``, ``backend.page_block_sizes``)."""

    def __init__(self, backend):
        self.backend, self.op = backend, backend.op
        self._torch = ReferenceV4()  # its projections, compressors and indexer (torch), never its attention

    # ------------------------------------------------------------------ gating
    def page_for(self, config: V4Config) -> int:
        """The largest page size the op reads that divides the window (the ring is whole pages)."""
        fits = [p for p in self.backend.page_block_sizes if config.sliding_window % p == 0]
        return max(fits) if fits else 0

    def case(self, config, dtype, device, kv_format: str = "latent") -> OpCase:
        return OpCase(batch=1, s_q=1, h_q=int(config.num_attention_heads), page_block_size=self.page_for(config),
                      dtype=dtype, kv_format=kv_format, topk=int(config.sliding_window), attn_sink=True,
                      causal=False, device=str(device))

    def unsupported_reason(self, config: V4Config, *, dtype, device, kv_codec="none") -> str | None:
        name, op = self.backend.name, self.op
        needs = [d for d in ("sparse_decode", "sparse_decode_extra_cache", "attn_sink") if not declared(op, d)]
        if needs:
            return (f"{name} hands a DeepSeek-V4 layer's attention to the op's sparse decode over two caches (the "
                    f"window and the compressed entries) with the sink; op {op.name} does not declare "
                    f"{', '.join(n + ' = True' for n in needs)}")
        D = config.head_dim
        if not takes_head_dims(op, D, D):
            return (f"{name}: a V4 layer's query and KV vector are head_dim {D} wide and the value is the whole "
                    f"vector (d_qk = d_v = {D}); op {op.name} does not declare ({D}, {D}) in head_dims")
        fmt = FORMATS.get(kv_codec)
        if fmt is None:
            return (f"{name} hands the op V4 pages in the cache dtype ('latent') or as MODEL1 FP8 rows "
                    f"({model1.NAME}); kv_codec {kv_codec!r} is neither")
        if fmt == model1.NAME and (D, config.qk_rope_head_dim) != (model1.D_QK, model1.D_ROPE):
            return (f"{name}: MODEL1 rows are head_dim {model1.D_QK} = {model1.D_NOPE} e4m3 + {model1.D_ROPE} bf16 "
                    f"rope; this config has head_dim {D}, rope {config.qk_rope_head_dim}")
        if fmt not in declared(op, "kv_formats"):
            return f"op {op.name} does not read the {fmt!r} kv format the V4 pages are in (kv_codec {kv_codec!r})"
        if not self.page_for(config):
            return (f"op {op.name} reads pages of {', '.join(map(str, self.backend.page_block_sizes))} tokens, none "
                    f"of which divides the window ({config.sliding_window}): the ring is whole pages")
        return op.unsupported_reason(self.case(config, dtype, device, fmt))

    def new_cache(self, config, *, batch_size, capacity, dtype, device, kv_codec="none"):
        return V4OpCache(config, batch_size=batch_size, capacity=capacity, dtype=dtype, device=device,
                         page_block_size=self.page_for(config), kv_codec=kv_codec)

    # ------------------------------------------------------------------ attend
    def attend(self, weights, hidden_states, positions, cache: V4OpCache, lengths=None):
        cfg: V4Config = weights.config
        x, dt, dev = hidden_states, hidden_states.dtype, hidden_states.device
        wd = torch.float64 if weights.dtype == torch.float64 else torch.float32
        B, S, _ = x.shape
        H, D, rd, eps = cfg.num_attention_heads, cfg.head_dim, cfg.qk_rope_head_dim, cfg.rms_norm_eps
        W, m, page = cfg.sliding_window, cfg.compress_ratio, cache.page_block_size
        lengths = torch.full((B,), S) if lengths is None else lengths.to("cpu")
        theta, yarn = cfg.rope()
        freqs = inv_freq(rd, theta, yarn).to(device=dev, dtype=wd)
        r = self._torch
        lin = lambda t, name: t.to(weights[name].dtype) @ weights[name].T
        out = torch.zeros(B, S, cfg.hidden_size, dtype=dt, device=dev)
        staged = _Staged(cache)
        for i in range(int(lengths.max()) if B else 0):
            rows = [b for b in range(B) if int(lengths[b]) > i]
            idx, eidx = torch.full((B, 1, W), -1, dtype=torch.int32), None
            if m:
                k_max = min(cfg.index_topk, max(1, cache.capacity // m)) if cfg.layer_type == CSA \
                    else max(1, cache.capacity // m)
                eidx = torch.full((B, 1, k_max), -1, dtype=torch.int32)
            q_all = torch.zeros(B, 1, H, D, dtype=dt, device=dev)
            for b in rows:
                p = int(cache.seq_lens[b])
                xb = x[b, i:i + 1]
                pos = torch.tensor([p], device=dev)
                qr = r._rms(lin(xb, "q_a_proj.weight").to(wd), eps, weights["q_a_norm.weight"])
                q = r._rope(r._rms(lin(qr, "q_b_proj.weight").to(wd).view(1, H, D), eps), pos, freqs)
                kv = r._rope(r._rms(lin(xb, "kv_proj.weight").to(wd), eps, weights["kv_norm.weight"]), pos, freqs)
                cache.put_row("window", b * cache.window_pages_per_row * page + p % W, kv[0])
                t = torch.arange(max(0, p - W + 1), p + 1)
                idx[b, 0, :len(t)] = (b * cache.window_pages_per_row * page + t % W).to(torch.int32)
                if m:
                    pre = "compressor."
                    r._compress(staged, b, lin(xb, pre + "kv_proj.weight").to(wd),
                                lin(xb, pre + "gate_proj.weight").to(wd), ("kv_state", "score_state"),
                                weights[pre + "position_bias"].to(wd), weights[pre + "kv_norm.weight"].to(wd),
                                cfg.overlap, p, 1, "compressed", freqs, wd)
                    N = (p + 1) // m
                    chosen = torch.arange(N)
                    if cfg.layer_type == CSA:
                        ip = "compressor.indexer."
                        r._compress(staged, b, lin(xb, ip + "kv_proj.weight").to(wd),
                                    lin(xb, ip + "gate_proj.weight").to(wd), ("index_kv_state", "index_score_state"),
                                    weights[ip + "position_bias"].to(wd), weights[ip + "kv_norm.weight"].to(wd),
                                    True, p, 1, "indexer", freqs, wd)
                        if N:
                            Hi, Di = cfg.index_n_heads, cfg.index_head_dim
                            qi = r._rope(lin(qr, ip + "q_b_proj.weight").to(wd).view(1, Hi, Di), pos, freqs)
                            wts = lin(xb, ip + "scorer.weights_proj.weight").to(wd) * (Di ** -0.5 * Hi ** -0.5)
                            ikeys = cache._t["indexer"][b, :N].to(wd)
                            scores = r._index_scores(wts, torch.einsum("sic,jc->sij", qi, ikeys))[0]
                            chosen = scores.topk(min(cfg.index_topk, N)).indices.sort().values
                    eidx[b, 0, :len(chosen)] = (b * cache.entry_pages_per_row * page + chosen).to(torch.int32)
                q_all[b, 0] = q[0].to(dt)
            kw = dict(softmax_scale=cfg.softmax_scale, causal=False, indices=idx.to(dev),
                      attn_sink=weights["sinks"].to(device=dev, dtype=torch.float32), head_dim_v=D)
            if m:
                kw.update(extra_k_cache=cache.op_view("compressed"), extra_indices=eidx.to(dev))
            seqlens = torch.tensor([min(int(cache.seq_lens[b]) + 1, W) if b in rows else 0 for b in range(B)],
                                   dtype=torch.int32, device=dev)
            table = (torch.arange(B)[:, None] * cache.window_pages_per_row
                     + torch.arange(cache.window_pages_per_row)[None, :]).to(torch.int32).to(dev)
            res = self.op.decode(q_all, cache.op_view("window"), table, seqlens, **kw)
            if not (isinstance(res, tuple) and len(res) == 2 and isinstance(res[0], torch.Tensor)
                    and tuple(res[0].shape) == (B, 1, H, D)):
                raise ValueError(f"op {self.op.name}: decode() returned {type(res).__name__}, not (out [{B}, 1, {H}, "
                                 f"{D}], lse)")
            o = res[0].to(wd)
            for b in rows:
                pos = torch.tensor([int(cache.seq_lens[b])], device=dev)
                ob = r._rotate_back(o[b], pos, freqs)                                # [1, H, D]
                g = cfg.o_groups
                w_oa = weights["o_a_proj.weight"].view(g, cfg.o_lora_rank, -1)
                y = torch.einsum("sgd,grd->sgr", ob.reshape(1, g, -1).to(w_oa.dtype), w_oa)
                out[b, i] = lin(y.flatten(1), "o_b_proj.weight")[0].to(dt)
                cache.seq_lens[b] += 1
        return out
