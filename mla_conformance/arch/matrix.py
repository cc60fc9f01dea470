"""The kernel support matrix, as data: one :class:`KernelRow` per kernel, and where every fact was read.

Each row names the architectures the kernel runs on, the KV-cache format, the MLA mode, the head dimensions,
the page block size, the minimum CUDA version and the upstream files (with the revision) each fact was read
from. Nothing here imports a kernel library or torch; :mod:`mla_conformance.arch.gating` turns a row and a
device into a verdict.

Which capabilities count as "SM90" and "SM100"
----------------------------------------------
FlashMLA builds ``-gencode arch=compute_90a,code=sm_90a`` and
``-gencode arch=compute_100f,code=sm_100f`` (setup.py) and nothing else.

* ``sm_90a`` is an *architecture-specific* target: its code runs on compute capability 9.0
  only (no forward compatibility).  FlashMLA also checks ``major == 9 && minor == 0`` at run
  time (``Arch::is_sm90a`` in csrc/api/common.h).
* ``sm_100f`` is a *family-specific* target (new in CUDA 12.9): its code runs on the members
  of the 10.x family that share the feature set, i.e. compute capability 10.0
  (B200/GB200) and 10.3 (B300/GB300).  FlashMLA's run-time check is looser
  (``Arch::is_sm100f`` is ``major == 10``), but a 10.x device outside the family (10.1 was
  Jetson Thor before CUDA 13 renumbered it 11.0) has no matching cubin, so we accept exactly
  10.0 and 10.3.
* SM120/SM121 (RTX 50xx / RTX PRO 6000 Blackwell, DGX Spark GB10) are a different major
  version: ``sm_100f`` code does not run there and FlashMLA builds nothing for them
  (deepseek-ai/FlashMLA issue #124 asks for it; PR #146, flags only, was closed unmerged).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mla_conformance.arch.capability import Capability, cap_str, version_str

# --------------------------------------------------------------------------------------
# Data model
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    """Where one or more facts of a row were read: a file at a revision, or a document."""

    where: str  # "deepseek-ai/FlashMLA" or a URL
    path: str  # file inside the repository ("" for a URL)
    revision: str  # full commit hash, or "" for a web document
    says: str  # the fact(s) read there, paraphrased or quoted briefly

    def to_dict(self) -> dict[str, str]:
        return {"where": self.where, "path": self.path, "revision": self.revision, "says": self.says}


@dataclass(frozen=True)
class ArchTarget:
    """One architecture a kernel is built for, and the device capabilities that run it."""

    name: str  # "SM90"
    family: str  # "Hopper"
    capabilities: tuple[Capability, ...]  # exact (major, minor) pairs accepted
    build_target: str  # nvcc code target, "sm_90a" / "sm_100f" / "" when unknown
    min_cuda: tuple[int, int] | None  # None: not stated by the sources read

    def accepts(self, capability: Capability) -> bool:
        return tuple(capability) in self.capabilities

    def describe(self) -> str:
        caps = " or ".join(cap_str(c) for c in self.capabilities)
        word = "capability" if len(self.capabilities) == 1 else "capabilities"
        return f"{self.name} ({self.family}, compute {word} {caps})"

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "family": self.family,
            "capabilities": [cap_str(c) for c in self.capabilities],
            "build_target": self.build_target,
            "min_cuda": version_str(self.min_cuda),
        }


@dataclass(frozen=True)
class KernelRow:
    """One kernel of the support matrix."""

    kernel_id: str  # "flashmla/dense_decode"
    library: str  # "FlashMLA"
    name: str  # "FlashMLA dense decode" (used in sentences)
    package: str  # importable top-level module, "flash_mla"
    targets: tuple[ArchTarget, ...]
    kv_dtype: str  # "BF16", "FP8 (656-byte V3.2 layout)", ...
    mode: str  # "MQA" (absorbed, latent KV) or "MHA" (non-absorbed)
    head_dim_k: tuple[int, ...]
    head_dim_v: tuple[int, ...]
    page_block_size: tuple[int, ...] | None  # None: not paged, or not enforced
    sources: tuple[Source, ...]
    confidence: str  # "high": read in the library's own source; "medium": source read, details may move
    notes: str = ""

    def needs(self) -> str:
        return " or ".join(t.describe() for t in self.targets)

    def target_for(self, capability: Capability) -> ArchTarget | None:
        for target in self.targets:
            if target.accepts(capability):
                return target
        return None

    def to_dict(self) -> dict[str, Any]:
        return {
            "kernel_id": self.kernel_id,
            "library": self.library,
            "name": self.name,
            "package": self.package,
            "architectures": [t.to_dict() for t in self.targets],
            "kv_dtype": self.kv_dtype,
            "mode": self.mode,
            "head_dim_k": list(self.head_dim_k),
            "head_dim_v": list(self.head_dim_v),
            "page_block_size": None if self.page_block_size is None else list(self.page_block_size),
            "sources": [s.to_dict() for s in self.sources],
            "confidence": self.confidence,
            "notes": self.notes,
        }


# --------------------------------------------------------------------------------------
# The support matrix (data)
# --------------------------------------------------------------------------------------

FLASHMLA = "deepseek-ai/FlashMLA"
FLASHINFER = "flashinfer-ai/flashinfer"
# The revision the seed experiment pinned.  Its README table, setup.py gencode flags and
# dense_decode.h message are the ones encoded below; the search index used to re-check
# them holds other commits of the same files, listed per source.
FLASHMLA_SEED_REVISION = "15f13e5030374295491c5ce31b02d7e63a7772c6"

_README = Source(
    FLASHMLA, "README.md", "066b5ba6f63d9d0840eac008fe58a1f70acfac78",
    "Requirements: SM90 / SM100; CUDA 12.8 and above (12.9+ for SM100 kernels). Support matrix: "
    "Dense Decoding SM90 MQA BF16; Sparse Decoding SM90 & SM100 MQA FP8; Dense Prefill SM100 MHA; "
    "Sparse Prefill SM90 & SM100 MQA. MQA mode = head_dim_k 576 / head_dim_v 512; MHA mode = "
    "head_dim_k 192 or 128 / head_dim_v 128. FP8 cache: 656 bytes/token = 512 float8_e4m3 + "
    "4 float32 scales + 64 bfloat16 RoPE. (Same table as at the seed revision "
    + FLASHMLA_SEED_REVISION + ".)",
)
_SETUP = Source(
    FLASHMLA, "setup.py", "091c15e1c4b31d5dc20172f983e858b437e03a2f",
    "gencode arch=compute_100f,code=sm_100f and arch=compute_90a,code=sm_90a; NVCC <= 12.8 must set "
    "FLASH_MLA_DISABLE_SM100 ('sm100 compilation for Flash MLA requires NVCC 12.9 or higher').",
)
_COMMON_H = Source(
    FLASHMLA, "csrc/api/common.h", "082094b793fcc7452977d0a71a00e266a2e3061e",
    "Arch::is_sm90a() is major == 9 && minor == 0; Arch::is_sm100f() is major == 10.",
)
_DENSE_DECODE_H = Source(
    FLASHMLA, "csrc/api/dense_decode.h", "1aeef780aa12f7cdc034050352f61f94f532c0e7",
    "'Dense decode MLA is only supported on SM90a architecture'; q dtype BF16 (or FP16) and kcache "
    "dtype == q dtype; head_size_k 576 (or 512), head_size_v 512; 'Currently page_block_size must be 64'.",
)
_SPARSE_DECODE_H = Source(
    FLASHMLA, "csrc/api/sparse_decode.h", "4855c772bacb4d2cca413d6fb73cce396256a3c1",
    "dispatches is_sm100f() / is_sm90a(), else 'Unsupported architecture for sparse decode fwd'; "
    "h_kv == 1 (MQA); d_qk 576 (V3.2) or 512 (MODEL1), d_v 512; kv dtype fp8_e4m3fn/int8/uint8; "
    "V3.2 bytes_per_token = 512 + 64*2 + (512/128)*4 = 656; no page_block_size check.",
)
_SPARSE_FWD_H = Source(
    FLASHMLA, "csrc/api/sparse_fwd.h", "02fe0d02e83f15ae5a049cc4acc009a50553e64c",
    "'Sparse Attention Forward Kernel is only supported on SM90a and SM100f architectures.'; "
    "q and kv BF16; d_qk 576 or 512, d_v 512; kv [s_kv, h_kv, d_qk] (not paged).",
)
_DENSE_PREFILL_CU = Source(
    FLASHMLA, "csrc/sm100/prefill/dense/fmha_cutlass_fwd_sm100.cu", "11d11f1a0ae8da3bd8f96f828c2cd0758de894f8",
    "SM100 CUTLASS FMHA forward: BF16 in/out; (head_dim_qk, head_dim_vo) in {(192, 128), (128, 128)}; "
    "varlen (ragged), no paged cache.",
)
_SM120_ISSUE = Source(
    "https://github.com/deepseek-ai/FlashMLA/issues/124", "", "",
    "open request for SM120 (RTX PRO 6000) support; PR #146 (build flags only, untested on SM120) "
    "was closed unmerged.",
)
_NVIDIA_FAMILY = Source(
    "https://docs.nvidia.com/cuda/cuda-programming-guide/05-appendices/compute-capabilities.html", "", "",
    "feature availability: 'a' (architecture-specific) targets run only on that exact capability; "
    "'f' (family-specific, CUDA 12.9+) targets run on the family: compute_100f on 10.0 and 10.3. "
    "(Read via secondary quotes: EESSI support issue #210 and Rust-GPU/rust-cuda PR #306; "
    "the guide's own table was not in the index.)",
)
_NVIDIA_GPUS = Source(
    "https://developer.nvidia.com/cuda-gpus", "", "",
    "10.0 = B200/GB200; 10.3 = B300/GB300; 11.0 = Jetson T5000/T4000 (Thor); 12.0 = RTX 50xx / "
    "RTX PRO 6000 Blackwell; 12.1 = GB10 (DGX Spark); 9.0 = H100/H200/GH200.",
)

SM90_FLASHMLA = ArchTarget("SM90", "Hopper", ((9, 0),), "sm_90a", (12, 8))
SM100_FLASHMLA = ArchTarget("SM100", "datacenter Blackwell", ((10, 0), (10, 3)), "sm_100f", (12, 9))

_FLASHINFER_UTILS = Source(
    FLASHINFER, "flashinfer/utils.py", "",
    "determine_mla_backend(): 'fa3' if is_sm90a_supported(device) (major == 9 and torch CUDA >= 12.3) "
    "else 'fa2'; is_sm100a_supported: major == 10 and CUDA >= 12.8 (12.9 in later revisions); "
    "is_sm120a_supported: 12.0 and CUDA >= 12.8; is_sm121a_supported: 12.1 and CUDA >= 12.9.",
)
_FLASHINFER_MLA = Source(
    FLASHINFER, "flashinfer/mla.py", "00e3d683c3b58850f0678159d6cf7adf96479615",
    "BatchMLAPagedAttentionWrapper backends fa2/fa3/cutlass; cutlass: 128 heads, head dim 576; "
    "trtllm_batch_decode_with_kv_cache_mla: backend 'auto' = 'trtllm-gen' on major 10 ('sm_100 and "
    "sm_103'), else 'xqa'; trtllm-gen block_size 32 or 64, kv_lora_rank 512, rope 64, head dim 576; "
    "xqa: 'XQA MLA only supports fp8 operation on SM120 GPUs' (major == 12), q_len 1.",
)
_FLASHINFER_JIT_MLA = Source(
    FLASHINFER, "flashinfer/jit/mla.py", "",
    "gen_mla_module() (cutlass_mla.cu) compiled for supported_major_versions=[10, 11].",
)
_FLASHINFER_JIT_XQA = Source(
    FLASHINFER, "flashinfer/jit/xqa.py", "",
    "gen_xqa_module_mla: xqa/mla_sm120.cu for supported_major_versions=[12]; head dim 576, head group "
    "ratio 128, fp8 input and cache (later revisions also bf16), page size 16/32/64/128.",
)

# The revision of flashinfer-ai/flashinfer the BatchMLAPagedAttentionWrapper facts (row flashinfer/fa2_mla,
# op flashinfer) were read at.
FLASHINFER_REVISION = "fb28d7242b3506a2348265962041acc1fb56cca4"

_FLASHINFER_MLA_CORE = Source(
    FLASHINFER, "flashinfer/mla/_core.py", FLASHINFER_REVISION,
    "BatchMLAPagedAttentionWrapper(backend='auto'): 'auto' picks 'fa3' on SM90a, else 'fa2' (on SM >= 100 "
    "with a warning that fa2 is not Blackwell-native); plan(qo_indptr, kv_indptr, kv_indices, kv_len_arr, "
    "num_heads, head_dim_ckv, head_dim_kpe, page_size, causal, sm_scale, q_data_type, kv_data_type); kv "
    "dtypes float16, bfloat16 (float8_e4m3fn on SM90 only, with per-tensor or per-128-channel scales); "
    "run(q_nope, q_pe, ckv_cache [pages, page_size, 512], kpe_cache [pages, page_size, 64], return_lse=True) "
    "returns lse in base 2 unless return_lse_base_on_e.",
)
_FLASHINFER_MLA_CUH = Source(
    FLASHINFER, "include/flashinfer/attention/mla.cuh", FLASHINFER_REVISION,
    "fa2 MLA: causal mask drops kv_idx + qo_len > kv_len + q_idx (bottom-right alignment); a query with no "
    "keys writes out 0 and lse -inf (write_empty_o); ckv / kpe read through page and token strides.",
)
_FLASHINFER_JIT_MODULES = Source(
    FLASHINFER, "flashinfer/jit/attention/modules.py", FLASHINFER_REVISION,
    "gen_batch_mla_module: fa2 compiles batch_mla_{plan,run,binding}.cu with no arch-specific flags (JIT "
    "for the device in use); fa3 adds sm90a_nvcc_flags.",
)
_FLASHINFER_README = Source(
    FLASHINFER, "README.md", FLASHINFER_REVISION,
    "architectures: Turing SM 7.5, Ampere SM 8.0 / 8.6, Ada SM 8.9, Hopper SM 9.0, Blackwell SM 10.0 / 10.3, "
    "SM 11.0, SM 12.0 / 12.1; 'Not all features are supported across all compute capabilities'.",
)
_FLASHINFER_MLA_TEST = Source(
    FLASHINFER, "tests/attention/test_deepseek_mla.py", FLASHINFER_REVISION,
    "test_batch_mla_page_attention runs backends fa2 and fa3 (fa3 skipped unless is_sm90a_supported) at page "
    "sizes 1 and 16, causal and not; reference mask arange(kv_len - qo_len, kv_len) >= arange(kv_len); lse "
    "compared as logsumexp * log2(e); 'qo_len > kv_len not supported for causal attention'.",
)

SM90_FI = ArchTarget("SM90", "Hopper", ((9, 0),), "sm_90a", (12, 3))
SM80_FI_FA2 = ArchTarget("SM80", "Ampere", ((8, 0), (8, 6)), "", None)
SM89_FI_FA2 = ArchTarget("SM89", "Ada", ((8, 9),), "", None)
SM90_FI_FA2 = ArchTarget("SM90", "Hopper", ((9, 0),), "", None)
SM100_FI = ArchTarget("SM100", "datacenter Blackwell", ((10, 0), (10, 3)), "sm_100a/sm_100f", (12, 8))
SM120_FI = ArchTarget("SM120", "Blackwell RTX / RTX PRO", ((12, 0),), "sm_120a", (12, 8))
SM121_FI = ArchTarget("SM121", "GB10 DGX Spark", ((12, 1),), "sm_121a", (12, 9))

# The optional op methods' kernels (prefill, merge, write), read at FLASHINFER_REVISION and in vLLM.
_FLASHINFER_PREFILL = Source(
    FLASHINFER, "flashinfer/prefill.py", FLASHINFER_REVISION,
    "BatchPrefillWithRaggedKVCacheWrapper(float_workspace_buffer, kv_layout='NHD', backend='auto'); plan(qo_indptr, "
    "kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo=None, causal=False, sm_scale=None, "
    "q_data_type, kv_data_type, ...); run(q, k, v, return_lse=True) -> (out [nnz_qo, h, d_vo], lse [nnz_qo, h] "
    "float32); backend 'auto' via determine_attention_backend (flashinfer/utils.py): fa3 when is_sm90a_supported "
    "and is_fa3_prefill_head_dim_supported (equal dims 64/128/256, or (192, 128)), else fa2.",
)
_FLASHINFER_PREFILL_CUH = Source(
    FLASHINFER, "include/flashinfer/attention/prefill.cuh", FLASHINFER_REVISION,
    "causal mask by q_idx + kv_len - qo_len (bottom-right); lse written as ptx_log2(d) + m over base-2 scaled "
    "logits (base 2); a fully masked row keeps m = -inf.",
)
_FLASHINFER_CASCADE = Source(
    FLASHINFER, "include/flashinfer/attention/cascade.cuh", FLASHINFER_REVISION,
    "MergeStateKernel: s in base 2 (ptx_exp2 / ptx_log2), max() drops the NaN of two empty (-inf) states and the "
    "d_sum guard keeps their output 0; MergeState dispatches head_dim 64/128/256/512 with num_heads x head_dim / "
    "vec_size threads; csrc/cascade.cu: CHECK_INPUT (contiguous), float16 / bfloat16 v.",
)
_FLASHINFER_PAGE = Source(
    FLASHINFER, "flashinfer/page.py", FLASHINFER_REVISION,
    "append_paged_mla_kv_cache(append_ckv, append_kpe, batch_indices, positions, ckv_cache [page_num, page_size, "
    "ckv_dim], kpe_cache [page_num, page_size, kpe_dim], kv_indices, kv_indptr, kv_last_page_len): 'current only "
    "support ckv=512 and kpe=64'; csrc/page.cu: caches read through their strides (last dim contiguous).",
)
_VLLM = "vllm-project/vllm"
_VLLM_CMAKE = Source(
    _VLLM, "CMakeLists.txt", "000a1ee93b2ddc3cb06c62a71fe769c789cbf7b1",
    "CUDA_SUPPORTED_ARCHS 7.5;8.0;8.6;8.7;8.9;9.0;10.0;10.1;10.3;12.0;12.1 (CUDA 12.8; 10.0f/12.0f family targets "
    "from CUDA 13); csrc/cache_kernels.cu and csrc/attention/merge_attn_states.cu are in the _C extension.",
)
_VLLM_MERGE = Source(
    _VLLM, "vllm/v1/attention/ops/merge_attn_states.py", "15a3fd47ef45622a355ab7be62035231891f5e44",
    "merge_attn_states(output, prefix_output, prefix_lse [h, n], suffix_output, suffix_lse [h, n], output_lse=None, "
    "...): the CUDA kernel (csrc/attention/merge_attn_states.cu) for float32/float16/bfloat16 with head size a "
    "multiple of 16 bytes, else Triton; lse natural (expf/logf), either infinity read as -inf.",
)
_VLLM_CACHE = Source(
    _VLLM, "vllm/_custom_ops.py", "",
    "concat_and_cache_mla(kv_c, k_pe, kv_cache [num_blocks, block_size, entry], slot_mapping, kv_cache_dtype, "
    "scale); csrc/cache_kernels.cu: slot < 0 writes nothing; 'fp8_ds_mla' writes the 656-byte row, tile scale "
    "max(amax / 448, FLT_MIN) as float32 (revision not recorded by the code index).",
)

SM80_VLLM = ArchTarget("SM80", "Ampere", ((8, 0), (8, 6), (8, 7)), "", None)
SM89_VLLM = ArchTarget("SM89", "Ada", ((8, 9),), "", None)
SM90_VLLM = ArchTarget("SM90", "Hopper", ((9, 0),), "", None)
SM100_VLLM = ArchTarget("SM100", "datacenter Blackwell", ((10, 0), (10, 3)), "", None)
SM120_VLLM = ArchTarget("SM120", "Blackwell RTX / RTX PRO / GB10", ((12, 0), (12, 1)), "", None)
_VLLM_TARGETS = (SM80_VLLM, SM89_VLLM, SM90_VLLM, SM100_VLLM, SM120_VLLM)
_FI_JIT_TARGETS = (SM80_FI_FA2, SM89_FI_FA2, SM90_FI_FA2, SM100_FI, SM120_FI, SM121_FI)

MATRIX: tuple[KernelRow, ...] = (
    KernelRow(
        kernel_id="flashmla/dense_decode",
        library="FlashMLA",
        name="FlashMLA dense decode",
        package="flash_mla",
        targets=(SM90_FLASHMLA,),
        kv_dtype="BF16",
        mode="MQA",
        head_dim_k=(576,),
        head_dim_v=(512,),
        page_block_size=(64,),
        sources=(_README, _DENSE_DECODE_H, _COMMON_H, _SETUP),
        confidence="high",
        notes="flash_mla_with_kvcache without indices. Current csrc also accepts FP16 and head_dim_k 512; "
        "the README table lists BF16 / 576.",
    ),
    KernelRow(
        kernel_id="flashmla/sparse_decode",
        library="FlashMLA",
        name="FlashMLA sparse decode",
        package="flash_mla",
        targets=(SM90_FLASHMLA, SM100_FLASHMLA),
        kv_dtype="FP8 (656 bytes/token: 512 float8_e4m3 + 4 float32 scales + 64 bfloat16 RoPE)",
        mode="MQA",
        head_dim_k=(576,),
        head_dim_v=(512,),
        page_block_size=None,
        sources=(_README, _SPARSE_DECODE_H, _COMMON_H, _SETUP, _NVIDIA_FAMILY),
        confidence="high",
        notes="flash_mla_with_kvcache with indices and is_fp8_kvcache. The page block size is not checked "
        "(indices encode block * page_block_size + offset). Current csrc also has a 512-dim MODEL1 "
        "cache format.",
    ),
    KernelRow(
        kernel_id="flashmla/dense_prefill",
        library="FlashMLA",
        name="FlashMLA dense prefill",
        package="flash_mla",
        targets=(SM100_FLASHMLA,),
        kv_dtype="BF16",
        mode="MHA",
        head_dim_k=(192, 128),
        head_dim_v=(128,),
        page_block_size=None,
        sources=(_README, _DENSE_PREFILL_CU, _SETUP, _NVIDIA_FAMILY),
        confidence="high",
        notes="flash_attn_varlen_func (ragged, not paged); the non-absorbed MLA prefill.",
    ),
    KernelRow(
        kernel_id="flashmla/sparse_prefill",
        library="FlashMLA",
        name="FlashMLA sparse prefill",
        package="flash_mla",
        targets=(SM90_FLASHMLA, SM100_FLASHMLA),
        kv_dtype="BF16",
        mode="MQA",
        head_dim_k=(576,),
        head_dim_v=(512,),
        page_block_size=None,
        sources=(_README, _SPARSE_FWD_H, _COMMON_H, _SETUP, _NVIDIA_FAMILY),
        confidence="high",
        notes="flash_mla_sparse_fwd; kv is [s_kv, 1, d_qk], not paged. Current csrc also accepts d_qk 512.",
    ),
    KernelRow(
        kernel_id="flashinfer/fa3_mla",
        library="FlashInfer",
        name="FlashInfer FA3 MLA (BatchMLAPagedAttentionWrapper, backend fa3)",
        package="flashinfer",
        targets=(SM90_FI,),
        kv_dtype="BF16/FP16 (ckv 512 + kpe 64, separate tensors)",
        mode="MQA",
        head_dim_k=(576,),
        head_dim_v=(512,),
        page_block_size=None,
        sources=(_FLASHINFER_UTILS, _FLASHINFER_MLA),
        confidence="medium",
        notes="Any page size. Other devices fall back to backend fa2 (flashinfer/fa2_mla).",
    ),
    KernelRow(
        kernel_id="flashinfer/fa2_mla",
        library="FlashInfer",
        name="FlashInfer FA2 MLA (BatchMLAPagedAttentionWrapper, backend fa2)",
        package="flashinfer",
        targets=(SM80_FI_FA2, SM89_FI_FA2, SM90_FI_FA2, SM100_FI, SM120_FI, SM121_FI),
        kv_dtype="BF16/FP16 (ckv 512 + kpe 64, separate tensors or strided views of one 576-wide page)",
        mode="MQA",
        head_dim_k=(576,),
        head_dim_v=(512,),
        page_block_size=None,
        sources=(_FLASHINFER_MLA_CORE, _FLASHINFER_MLA_CUH, _FLASHINFER_JIT_MODULES, _FLASHINFER_README,
                 _FLASHINFER_MLA_TEST, _NVIDIA_GPUS),
        confidence="medium",
        notes="What backend='auto' runs everywhere but SM90 (there: fa3, row flashinfer/fa3_mla). JIT-compiled "
        "for the device in use, no arch-specific flags; bf16 MMA needs SM80, so Turing (7.5, in FlashInfer's "
        "README) is not accepted here, nor Thor (11.0). Any page size. The op flashinfer drives it.",
    ),
    KernelRow(
        kernel_id="flashinfer/cutlass_mla",
        library="FlashInfer",
        name="FlashInfer CUTLASS MLA decode",
        package="flashinfer",
        targets=(SM100_FI,),
        kv_dtype="BF16/FP16",
        mode="MQA",
        head_dim_k=(576,),
        head_dim_v=(512,),
        page_block_size=None,
        sources=(_FLASHINFER_MLA, _FLASHINFER_JIT_MLA, _FLASHINFER_UTILS),
        confidence="medium",
        notes="128 query heads only; block_num must be a multiple of 128 / page size. Later revisions "
        "also build it for 11.0 (Thor), not accepted here.",
    ),
    KernelRow(
        kernel_id="flashinfer/trtllm_gen_mla",
        library="FlashInfer",
        name="FlashInfer TRTLLM-gen MLA decode",
        package="flashinfer",
        targets=(ArchTarget("SM100", "datacenter Blackwell", ((10, 0), (10, 3)), "", None),),
        kv_dtype="BF16 or FP8",
        mode="MQA",
        head_dim_k=(576,),
        head_dim_v=(512,),
        page_block_size=(32, 64),
        sources=(_FLASHINFER_MLA,),
        confidence="medium",
        notes="Prebuilt cubins; the minimum CUDA version is not stated in the source read.",
    ),
    KernelRow(
        kernel_id="flashinfer/xqa_mla",
        library="FlashInfer",
        name="FlashInfer XQA MLA decode",
        package="flashinfer",
        targets=(SM120_FI, SM121_FI),
        kv_dtype="FP8 (later revisions also BF16)",
        mode="MQA",
        head_dim_k=(576,),
        head_dim_v=(512,),
        page_block_size=(16, 32, 64, 128),
        sources=(_FLASHINFER_MLA, _FLASHINFER_JIT_XQA, _FLASHINFER_UTILS, _NVIDIA_GPUS),
        confidence="medium",
        notes="128 query heads, one query token per request; no attention sinks.",
    ),
    KernelRow(
        kernel_id="flashinfer/fa2_prefill",
        library="FlashInfer",
        name="FlashInfer FA2 ragged prefill (BatchPrefillWithRaggedKVCacheWrapper, backend fa2)",
        package="flashinfer",
        targets=_FI_JIT_TARGETS,
        kv_dtype="BF16/FP16 (per-head K and V, ragged)",
        mode="MHA",
        head_dim_k=(192,),
        head_dim_v=(128,),
        page_block_size=None,
        sources=(_FLASHINFER_PREFILL, _FLASHINFER_PREFILL_CUH, _FLASHINFER_JIT_MODULES, _FLASHINFER_README),
        confidence="medium",
        notes="The op flashinfer's prefill (MHA mode: 128 nope + 64 rope, v 128) where fa3 does not run. JIT for the "
        "device in use, as fa2_mla; lse in base 2.",
    ),
    KernelRow(
        kernel_id="flashinfer/fa3_prefill",
        library="FlashInfer",
        name="FlashInfer FA3 ragged prefill (BatchPrefillWithRaggedKVCacheWrapper, backend fa3)",
        package="flashinfer",
        targets=(SM90_FI,),
        kv_dtype="BF16/FP16 (per-head K and V, ragged)",
        mode="MHA",
        head_dim_k=(192,),
        head_dim_v=(128,),
        page_block_size=None,
        sources=(_FLASHINFER_PREFILL, _FLASHINFER_UTILS),
        confidence="medium",
        notes="What backend='auto' runs on SM90 for head dims (192, 128); elsewhere fa2 (flashinfer/fa2_prefill).",
    ),
    KernelRow(
        kernel_id="flashinfer/merge_state",
        library="FlashInfer",
        name="FlashInfer merge_state",
        package="flashinfer",
        targets=_FI_JIT_TARGETS,
        kv_dtype="FP16/BF16 partial outputs, float32 base-2 lse",
        mode="MHA",
        head_dim_k=(64, 128, 256, 512),
        head_dim_v=(64, 128, 256, 512),
        page_block_size=None,
        sources=(_FLASHINFER_CASCADE, _FLASHINFER_README),
        confidence="medium",
        notes="The op flashinfer's merge; contiguous inputs; empty state -inf.",
    ),
    KernelRow(
        kernel_id="flashinfer/append_paged_mla_kv_cache",
        library="FlashInfer",
        name="FlashInfer append_paged_mla_kv_cache",
        package="flashinfer",
        targets=_FI_JIT_TARGETS,
        kv_dtype="BF16/FP16 (ckv 512 + kpe 64)",
        mode="MQA",
        head_dim_k=(576,),
        head_dim_v=(512,),
        page_block_size=None,
        sources=(_FLASHINFER_PAGE, _FLASHINFER_README),
        confidence="medium",
        notes="The op flashinfer's write (latent format); no slot mapping: the adapter hands one-page requests.",
    ),
    KernelRow(
        kernel_id="vllm/merge_attn_states",
        library="vLLM",
        name="vLLM merge_attn_states",
        package="vllm",
        targets=_VLLM_TARGETS,
        kv_dtype="FP32/FP16/BF16 partial outputs, float32 natural lse [h, T]",
        mode="MHA",
        head_dim_k=(128, 512),
        head_dim_v=(128, 512),
        page_block_size=None,
        sources=(_VLLM_MERGE, _VLLM_CMAKE),
        confidence="medium",
        notes="The op vllm's merge (mla_conformance.impl.ops.vllm_ops). The head sizes MLA merges (v 128 in MHA mode, "
        "512 for latent partials); any head size runs (CUDA kernel for multiples of 16 bytes, Triton otherwise). "
        "bfloat16 from SM80; Turing (7.5, built) is not accepted here.",
    ),
    KernelRow(
        kernel_id="vllm/concat_and_cache_mla",
        library="vLLM",
        name="vLLM concat_and_cache_mla",
        package="vllm",
        targets=_VLLM_TARGETS,
        kv_dtype="BF16/FP16 latent ('auto') or FP8 656-byte rows ('fp8_ds_mla')",
        mode="MQA",
        head_dim_k=(576,),
        head_dim_v=(512,),
        page_block_size=None,
        sources=(_VLLM_CACHE, _VLLM_CMAKE),
        confidence="medium",
        notes="The op vllm's write; slot_mapping with -1 for padding tokens.",
    ),
)

_BY_ID: dict[str, KernelRow] = {row.kernel_id: row for row in MATRIX}


def kernel_ids() -> list[str]:
    """The known kernel ids, in matrix order."""
    return [row.kernel_id for row in MATRIX]


#: The suite's adapters of each kernel (built-in op names; the layer backends ``flashmla`` and
#: ``flashmla-sparse`` are torch projections around the op of the same name).
ADAPTERS: dict[str, tuple[str, ...]] = {
    "flashmla/dense_decode": ("flashmla",),
    "flashmla/sparse_decode": ("flashmla-sparse",),
    "flashinfer/fa3_mla": ("flashinfer",),
    "flashinfer/fa2_mla": ("flashinfer", "flashinfer-fa2"),
    "flashmla/sparse_prefill": ("flashmla-sparse",),
    "flashmla/dense_prefill": ("flashmla",),
    "flashinfer/fa2_prefill": ("flashinfer", "flashinfer-fa2"),
    "flashinfer/fa3_prefill": ("flashinfer",),
    "flashinfer/merge_state": ("flashinfer", "flashinfer-fa2"),
    "flashinfer/append_paged_mla_kv_cache": ("flashinfer", "flashinfer-fa2"),
    "vllm/merge_attn_states": ("vllm",),
    "vllm/concat_and_cache_mla": ("vllm",),
}
#: Kernel ids whose adapter has been run against the real kernel on its hardware and passed the suite there.
#: None yet: add an id only with the report of such a run.
RUN_ON_HARDWARE: frozenset[str] = frozenset()
#: What an adapter that never ran on the real kernel is, said wherever it is advertised.
NOT_RUN_ON_HARDWARE = ("not yet run on hardware: tested only against labelled stand-ins (CPU modules with the "
                       "kernels' signatures, tests/test_flashmla.py and tests/test_op_adapters.py)")


def adapter_status() -> dict[str, dict[str, Any]]:
    """Per kernel with an adapter: its adapter names, whether one has run on the real kernel, and the note."""
    return {kid: {"adapters": list(names), "run_on_hardware": kid in RUN_ON_HARDWARE,
                  "note": None if kid in RUN_ON_HARDWARE else NOT_RUN_ON_HARDWARE}
            for kid, names in ADAPTERS.items()}


def get_kernel(kernel_id: str) -> KernelRow:
    """The matrix row for ``kernel_id``; a ValueError naming it and the known ids otherwise."""
    try:
        return _BY_ID[kernel_id]
    except (KeyError, TypeError):
        known = ", ".join(kernel_ids())
        raise ValueError(f"unknown kernel id {kernel_id!r}; known kernel ids: {known}") from None


def matrix_packages() -> list[str]:
    """The importable packages the matrix's kernels live in (``flash_mla``, ``flashinfer``)."""
    return sorted({row.package for row in MATRIX})
