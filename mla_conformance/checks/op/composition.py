"""The composition of an op's prefill, merge and (when it has one) write, as serving engines run chunked prefill
over cached context in "MHA mode" (vLLM's MLA backends, SGLang's), for suites/test_op_composition.py.

A batch of rows, row b with C_b cached context tokens and N_b new tokens (latent kv_c [., 512] and k_pe [., 64]
in the model dtype; some row with no context, one whose context ends in the first chunk):

0. the latent of every token goes into a paged latent cache -- by the op's ``write`` when it has one (format
   "latent", the page size the composition uses), else by the suite -- and the context is read back from it;
1. the context, in chunks of W tokens (W forcing >= 3 chunks; W not a multiple of the page size, so a chunk holds
   part of a page; a row whose context has ended has kv_len 0 in the later chunks), is up-projected per head,
   k = [kv_c W_UK^T | k_pe broadcast over heads], v = kv_c W_UV^T (float32, rounded to the model dtype), and
   each chunk is one ``prefill(causal=False)`` of the new tokens' queries;
2. the new tokens are one ``prefill(causal=True)`` over their own keys (bottom-right: query i sees the new keys
   <= i);
3. the parts are merged pairwise with ``merge`` (the suite converts each lse from prefill_lse_base to
   merge_lse_base, and an empty side's infinity to the one merge_empty_input takes, as the engine's glue must):
   chunk 0 with chunk 1, that with chunk 2, ..., then the new tokens.

Every step is checked against its float64 oracle (the attention of the new tokens' queries over the keys
covered so far, from the very K / V the op was handed), so a failure names the step. The bound of a merged
result of k parts follows from the parts' bounds (mla_conformance.checks.op.compare.attention_bounds): with
S = softmax @ |V| and T of the merged key set, delta the largest bound of a part's lse and E a merge's weight
error (mla_conformance.checks.op.merge),
``|out - ref| <= (p_round + acc) S + dot T + k u_out S + 2 delta S + (k - 1) (2E + 2^-22) S`` and
``|lse - ref| <= delta + (k - 1) (E + 2^-23 + 2^-23 |lse|)``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from mla_conformance.checks.op import merge as merge_checks
from mla_conformance.checks import op as op_checks
from mla_conformance.checks.op import methods as method_checks
from mla_conformance.checks.op.compare import Bounds, compare_attention
from mla_conformance.checks.op import prefill as prefill_checks
from mla_conformance.checks.op.prefill import cu_seqlens
from mla_conformance.checks.tolerances import unit_roundoff
from mla_conformance.contract.op import MethodCase, declared, has_method
from mla_conformance.messages import failure
from mla_conformance.model import attention_oracles

KV_LORA, ROPE, NOPE, V_DIM = 512, 64, 128, 128
U32 = unit_roundoff(torch.float32)


@dataclasses.dataclass(frozen=True)
class CompositionSpec:
    context: tuple[int, ...] = (0, 20, 70)
    new: tuple[int, ...] = (3, 5, 4)
    chunk: int = 24
    page: int = 16
    heads: int = 4
    dtype: str = "bfloat16"
    seed: int = 0
    device: str = "cpu"

    @property
    def softmax_scale(self) -> float:
        return (NOPE + ROPE) ** -0.5

    @property
    def chunks(self) -> int:
        return -(-max(self.context) // self.chunk)

    def chunk_lens(self, j: int) -> list[int]:
        return [max(0, min(C, (j + 1) * self.chunk) - j * self.chunk) for C in self.context]

    def prefill_case(self, causal: bool, kv_lens) -> MethodCase:
        m = sum(self.new)
        empty = any(n == 0 for n in kv_lens) if not causal else False
        return MethodCase("prefill", getattr(torch, self.dtype), h_q=self.heads, h_k=self.heads, d_qk=NOPE + ROPE,
                          d_v=V_DIM, tokens=m, batch=len(self.new), causal=causal, zero_length_rows=empty,
                          device=self.device)

    def merge_case(self, base: str, empty: bool) -> MethodCase:
        return MethodCase("merge", getattr(torch, self.dtype), h_q=self.heads, d_v=V_DIM, tokens=sum(self.new),
                          rows_without_keys=empty, lse_base=base, device=self.device)

    def locate(self, t: int) -> str:
        for b, n in enumerate(self.new):
            if t < n:
                return f"row {b}, new token {t} of {n}, {self.context[b]} context tokens"
            t -= n
        return "past the last row"


@dataclasses.dataclass
class CompositionInputs:
    spec: CompositionSpec
    kv_c: torch.Tensor            # [sum(C + N), 512] model dtype, rows one after another (context, then new)
    k_pe: torch.Tensor            # [sum(C + N), 64]
    q: torch.Tensor               # [sum(N), h, 192]
    w_uk: torch.Tensor            # [h, 128, 512] float32
    w_uv: torch.Tensor            # [h, 128, 512]
    slots: torch.Tensor           # int64 [sum(C + N)]
    block_table: torch.Tensor     # int32 [B, pages]
    num_blocks: int
    starts: list[int]             # row b's first token in kv_c


@functools.lru_cache(maxsize=8)
def build(spec: CompositionSpec) -> CompositionInputs:
    g = torch.Generator().manual_seed(7000 + spec.seed)
    dt = getattr(torch, spec.dtype)
    lens = [C + N for C, N in zip(spec.context, spec.new)]
    total = sum(lens)
    kv_c = torch.randn(total, KV_LORA, generator=g, dtype=torch.float64).to(dt)
    k_pe = torch.randn(total, ROPE, generator=g, dtype=torch.float64).to(dt)
    q = torch.randn(sum(spec.new), spec.heads, NOPE + ROPE, generator=g, dtype=torch.float64).to(dt)
    w_uk = (torch.randn(spec.heads, NOPE, KV_LORA, generator=g, dtype=torch.float64) / KV_LORA ** 0.5).float()
    w_uv = (torch.randn(spec.heads, V_DIM, KV_LORA, generator=g, dtype=torch.float64) / KV_LORA ** 0.5).float()
    pages = [-(-L // spec.page) for L in lens]
    num_blocks = sum(pages) + 2
    ids = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    table = torch.full((len(lens), max(pages) + 1), 2 ** 30, dtype=torch.int32)
    slots, used, starts = [], 0, []
    for b, L in enumerate(lens):
        mine = ids[used:used + pages[b]]
        used += pages[b]
        table[b, :pages[b]] = torch.tensor(mine, dtype=torch.int32)
        starts.append(len(slots))
        slots += [mine[p // spec.page] * spec.page + p % spec.page for p in range(L)]
    return CompositionInputs(spec, kv_c, k_pe, q, w_uk, w_uv, torch.tensor(slots, dtype=torch.int64), table,
                             num_blocks, starts)


def up_project(spec: CompositionSpec, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, 576] latent rows in the model dtype -> k [n, h, 192], v [n, h, 128] in the model dtype (the
    projection in float32, rounded once), k_pe broadcast over the heads."""
    inp = build(spec)
    dt = getattr(torch, spec.dtype)
    c = latent[:, :KV_LORA].float()
    k_nope = torch.einsum("nc,hdc->nhd", c, inp.w_uk).to(dt)
    v = torch.einsum("nc,hdc->nhd", c, inp.w_uv).to(dt)
    rope = latent[:, None, KV_LORA:].expand(-1, spec.heads, ROPE).to(dt)
    return torch.cat([k_nope, rope], dim=-1), v


def _fill_cache(op, spec: CompositionSpec, inp: CompositionInputs, figures: dict):
    """Step 0: the latent cache, written by the op's write where it has one (else by the suite); returns the
    cache (poisoned with NaN where nothing was written) and what was used to fill it."""
    __tracebackhide__ = True
    dt = getattr(torch, spec.dtype)
    cache = torch.full((inp.num_blocks, spec.page, 1, KV_LORA + ROPE), float("nan"), dtype=dt)
    wcase = MethodCase("write", dt, d_qk=KV_LORA + ROPE, d_v=KV_LORA, tokens=int(inp.slots.numel()),
                       kv_format="latent", page_block_size=spec.page, device=spec.device)
    if has_method(op, "write") and method_checks.unsupported(op, wcase) is None:
        bufs = method_checks.buffers(spec.device, kv_c=inp.kv_c, k_pe=inp.k_pe, kv_cache=cache, slot_mapping=inp.slots)
        method_checks.call(op, "write", wcase, "composition step 0: write", bufs,
                           ("kv_c", "k_pe", "kv_cache", "slot_mapping"),
                mutable=("kv_cache",), kv_format="latent")
        cache = bufs["kv_cache"].view.detach().cpu()
        got = cache.reshape(-1, KV_LORA + ROPE)[inp.slots]
        want = torch.cat([inp.kv_c, inp.k_pe], dim=-1)
        differ = (got.contiguous().view(torch.uint8) != want.contiguous().view(torch.uint8)).unflatten(
            -1, (-1, got.element_size())).any(-1)
        if bool(differ.any()):
            t, j = (int(i) for i in differ.nonzero()[0])
            raise AssertionError(failure(f"{method_checks.where(op, wcase, 'composition step 0: write of the cache')}: token {t} (slot "
                                 f"{int(inp.slots[t])}) reads back {float(got[t, j])!r} at value {j}, written "
                                 f"{float(want[t, j])!r}: the chunks below would read another context "
                                 "(suites/test_op_write.py checks the writer byte by byte)"))
        figures["cache_written_by"] = "write"
        return cache
    cache.view(-1, KV_LORA + ROPE)[inp.slots] = torch.cat([inp.kv_c, inp.k_pe], dim=-1)
    figures["cache_written_by"] = "the suite"
    return cache


def _spans(lens) -> list[tuple[int, int]]:
    out, a = [], 0
    for n in lens:
        out.append((a, a + n))
        a += n
    return out


def _chunk_kv(spec: CompositionSpec, latent_of, j: int):
    """Context chunk j of every row (``latent_of(b, a, e)``: row b's latent rows a..e-1), up-projected."""
    rows = [latent_of(b, j * spec.chunk, min(C, (j + 1) * spec.chunk))
            for b, C in enumerate(spec.context) if min(C, (j + 1) * spec.chunk) > j * spec.chunk]
    return up_project(spec, torch.cat(rows) if rows else torch.zeros(0, KV_LORA + ROPE, dtype=getattr(torch, spec.dtype)))


def _intended(spec: CompositionSpec):
    inp = build(spec)
    latent = torch.cat([inp.kv_c, inp.k_pe], dim=-1)
    return lambda b, a, e: latent[inp.starts[b] + a:inp.starts[b] + e]


@functools.lru_cache(maxsize=8)
def _new_kv(spec: CompositionSpec):
    return up_project(spec, torch.cat([_intended(spec)(b, C, C + N) for b, (C, N) in enumerate(zip(spec.context,
                                                                                                    spec.new))]))


@functools.lru_cache(maxsize=32)
def part_oracle(spec: CompositionSpec, p: int):
    """The float64 oracle of part p (context chunk p, or the new tokens for p = chunks) over the intended K / V."""
    inp = build(spec)
    if p < spec.chunks:
        k, v = _chunk_kv(spec, _intended(spec), p)
        lens, causal = spec.chunk_lens(p), False
    else:
        (k, v), lens, causal = _new_kv(spec), spec.new, True
    return attention_oracles.prefill(inp.q, k, v, cu_seqlens(spec.new), cu_seqlens(lens), softmax_scale=spec.softmax_scale,
                      causal=causal, magnitudes=True)


@functools.lru_cache(maxsize=32)
def merged_oracle(spec: CompositionSpec, p: int):
    """The float64 attention of the new queries over the keys of parts 0..p (causal once the new tokens are in)."""
    inp = build(spec)
    ks = [[] for _ in spec.context]
    vs = [[] for _ in spec.context]
    for j in range(min(p + 1, spec.chunks)):
        k, v = _chunk_kv(spec, _intended(spec), j)
        for b, (a, e) in enumerate(_spans(spec.chunk_lens(j))):
            ks[b].append(k[a:e])
            vs[b].append(v[a:e])
    if p >= spec.chunks:
        k, v = _new_kv(spec)
        for b, (a, e) in enumerate(_spans(spec.new)):
            ks[b].append(k[a:e])
            vs[b].append(v[a:e])
    lens = [sum(int(x.shape[0]) for x in row) for row in ks]
    return attention_oracles.prefill(inp.q, torch.cat([torch.cat(r) for r in ks]), torch.cat([torch.cat(r) for r in vs]),
                      cu_seqlens(spec.new), cu_seqlens(lens), softmax_scale=spec.softmax_scale,
                      causal=p >= spec.chunks, magnitudes=True)


def _natural(op, key: str, lse: torch.Tensor) -> torch.Tensor:
    """An op's lse (declared base ``key``) as a float64 natural log, both infinities kept."""
    return attention_oracles.to_natural(lse, declared(op, key))


def run_composition(op, spec: CompositionSpec, *, figures: dict):
    """Steps 0-3 of the module docstring, each checked as it is taken; returns the final (out, lse natural)."""
    __tracebackhide__ = True
    method_checks.require_method(op, "prefill", "merge")
    prefill_checks.require_lse(op, "the composition (chunked prefill's partials merged by their lse)")
    merge_base = declared(op, "merge_lse_base")
    for case in (spec.prefill_case(False, [0]), spec.prefill_case(True, spec.new), spec.merge_case(merge_base, True)):
        method_checks.require(op, case)
    inp = build(spec)
    figures.update(op=op.name, case=f"composition: context {spec.context}, new {spec.new}, chunks of {spec.chunk} "
                                    f"({spec.chunks}), page {spec.page}, h={spec.heads}, {spec.dtype}",
                   check="chunked prefill over cached context, merged, equals one causal pass", chunks=spec.chunks)
    cache = _fill_cache(op, spec, inp, figures)
    flat = cache.reshape(-1, KV_LORA + ROPE)
    from_cache = lambda b, a, e: flat[inp.slots[inp.starts[b] + a:inp.starts[b] + e]]  # noqa: E731
    cu_q = cu_seqlens(spec.new)
    parts = []                      # each part: (out, lse natural)
    step = 0
    for j in range(spec.chunks):
        step += 1
        k, v = _chunk_kv(spec, from_cache, j)
        lens = spec.chunk_lens(j)
        what = (f"composition step {step}: prefill(causal=False) of context chunk {j} (positions {j * spec.chunk}.."
                f"{(j + 1) * spec.chunk - 1}, kv_len {lens})")
        parts.append(_prefill_part(op, spec, spec.prefill_case(False, lens), what, k, v, cu_q, cu_seqlens(lens),
                                   False, part_oracle(spec, j)))
    step += 1
    k, v = _new_kv(spec)
    parts.append(_prefill_part(op, spec, spec.prefill_case(True, spec.new),
                               f"composition step {step}: prefill(causal=True) over the new tokens", k, v, cu_q,
                               cu_seqlens(spec.new), True, part_oracle(spec, spec.chunks)))
    acc = parts[0]
    for p in range(1, len(parts)):
        step += 1
        label = f"context chunk {p}" if p < spec.chunks else "the new tokens"
        acc = _merge_step(op, spec, acc, parts[p], p, f"composition step {step}: merge(parts 0..{p - 1}, {label})",
                          figures)
    figures["steps"] = step
    return acc


def _prefill_part(op, spec, case, what, k, v, cu_q, cu_k, causal, oracle):
    __tracebackhide__ = True
    inp = build(spec)
    bufs = method_checks.buffers(spec.device, q=inp.q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    result = method_checks.call(op, "prefill", case, what, bufs, ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k"),
                     softmax_scale=spec.softmax_scale, causal=causal)
    out, lse = prefill_checks.outputs(op, case, what, result)
    empty = math.inf if declared(op, "prefill_empty_row") == "+inf" else -math.inf
    compare_attention(op, case, out, lse, oracle, check=what, figures={}, base=declared(op, "prefill_lse_base"),
                      base_key="prefill_lse_base", empty_lse=empty, empty_key="prefill_empty_row",
                      locate=spec.locate)
    return out.detach().cpu(), _natural(op, "prefill_lse_base", lse)


def _merge_step(op, spec, acc, part, p, what, figures):
    """merge(acc, part p) and its check against the float64 attention over parts 0..p (module docstring)."""
    __tracebackhide__ = True
    base = declared(op, "merge_lse_base")
    to_base = (lambda x: x / math.log(2.0)) if base == "2" else (lambda x: x)
    (a_out, a_lse), (b_out, b_lse) = acc, part
    case = spec.merge_case(base, bool((torch.isinf(a_lse) & torch.isinf(b_lse)).any()))
    bufs = method_checks.buffers(spec.device, out_a=a_out,
                                 lse_a=merge_checks.marked(op, to_base(a_lse).to(torch.float32)), out_b=b_out,
                      lse_b=merge_checks.marked(op, to_base(b_lse).to(torch.float32)))
    out, lse = merge_checks.run(op, case, what, bufs, case.tokens, spec.heads, V_DIM)
    ref_out, ref_lse, mags = merged_oracle(spec, p)
    bounds = _composed_bounds(spec, p, mags, ref_lse, out.dtype)
    merge_checks.compare(op, case, out, lse, (ref_out, ref_lse, mags), bounds, check=what, figures=figures,
                         locate=spec.locate,
               against="the float64 attention over the parts merged so far")
    return out.detach().cpu(), _natural(op, "merge_lse_base", lse)


def _composed_bounds(spec, p, mags, ref_lse, out_dtype) -> Bounds:
    key, tol = op_checks.tolerance_for(spec.prefill_case(False, [1]))
    k = p + 1
    deltas, lse_abs = [], []
    for o_out, o_lse, o_mags in (part_oracle(spec, j) for j in range(k)):
        finite = torch.isfinite(o_lse)
        d = tol.dot * o_mags["score_abs"] + (tol.acc + U32) * (1.0 + torch.where(finite, o_lse.abs(), 0.0))
        deltas.append(torch.where(finite, d, 0.0))
        lse_abs.append(torch.where(finite, o_lse.abs(), 0.0))
    delta = torch.stack(deltas).amax(0)                                   # [T, h]
    e = U32 * (8.0 + 8.0 * torch.stack(lse_abs).amax(0))
    u_out = unit_roundoff(out_dtype)
    s, t = mags["abs_v"], mags["score_v"]
    per = lambda x: x[..., None]  # noqa: E731
    out_b = (tol.p_round + tol.acc) * s + tol.dot * t + k * u_out * s + 2 * per(delta) * s + \
        (k - 1) * per(2 * e + 4 * U32) * s
    finite = torch.where(torch.isfinite(ref_lse), ref_lse.abs(), 0.0)
    lse_b = delta + (k - 1) * (e + 2 * U32 + 2 * U32 * finite)
    return Bounds(out_b, lse_b, f"composition of {k} parts, {key}", lambda i: "", lambda i: "",
                  {"tolerance_p_round": tol.p_round, "tolerance_dot": tol.dot, "tolerance_acc": tol.acc,
                   "tolerance_u_out": u_out})


__all__ = ["CompositionSpec", "build", "up_project", "run_composition"]
