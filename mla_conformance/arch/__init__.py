"""Architecture gating: which MLA kernels can run on which device, and why not.

The support matrix is kept as *data* (:data:`MATRIX`): one :class:`KernelRow` per kernel,
each naming the architectures it runs on, the KV-cache format, the MLA mode, the head
dimensions, the page block size, the minimum CUDA version and the upstream files (with
the revision) every fact was read from.  Nothing here imports a kernel library: whether a
package is installed is found with :func:`importlib.util.find_spec`, so a broken or
wrong-architecture build can never crash the decision.

Public API
----------
* :func:`detect` -> :class:`DeviceInfo` (this host, or ``"cpu"`` / ``"cuda:1"`` / a torch.device)
* :meth:`DeviceInfo.from_capability` -> a device stated as data (``(9, 0)``, ``"12.0"``, ``"sm_100"``)
* :func:`why_not` -> ``None`` when the kernel is supported, else one sentence saying why not
* :func:`kernel_skip_reason` -> what the ``requires_kernel`` pytest marker uses to decide a skip
* :func:`add_cli` -> registers ``mla-conformance matrix``

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

import argparse
import functools
import importlib.metadata
import importlib.util
import json
import re
import sys
from dataclasses import dataclass
from typing import Any, Iterable

__all__ = [
    "ArchTarget",
    "DeviceInfo",
    "KernelRow",
    "MATRIX",
    "PackageInfo",
    "Source",
    "add_cli",
    "detect",
    "get_kernel",
    "kernel_ids",
    "kernel_skip_reason",
    "parse_capability",
    "why_not",
]

Capability = tuple[int, int]

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
        caps = " or ".join(_cap_str(c) for c in self.capabilities)
        word = "capability" if len(self.capabilities) == 1 else "capabilities"
        return f"{self.name} ({self.family}, compute {word} {caps})"

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "family": self.family,
            "capabilities": [_cap_str(c) for c in self.capabilities],
            "build_target": self.build_target,
            "min_cuda": _ver_str(self.min_cuda),
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


def adapter_lines() -> list[str]:
    """The adapters as text, one line per kernel, with the hardware note where it applies."""
    status = adapter_status()
    width = max(len(k) for k in status)
    lines = [f"{kid:<{width}}  {', '.join(st['adapters'])}: "
             + ("run on hardware" if st["run_on_hardware"] else "not yet run on hardware")
             for kid, st in status.items()]
    if any(not st["run_on_hardware"] for st in status.values()):
        lines.append(NOT_RUN_ON_HARDWARE[0].upper() + NOT_RUN_ON_HARDWARE[1:] + ".")
    return lines


def get_kernel(kernel_id: str) -> KernelRow:
    """The matrix row for ``kernel_id``; a ValueError naming it and the known ids otherwise."""
    try:
        return _BY_ID[kernel_id]
    except (KeyError, TypeError):
        known = ", ".join(kernel_ids())
        raise ValueError(f"unknown kernel id {kernel_id!r}; known kernel ids: {known}") from None


# --------------------------------------------------------------------------------------
# Devices
# --------------------------------------------------------------------------------------

_CAP_RE = re.compile(r"^\s*(\d{1,2})\s*\.\s*(\d)\s*$")
_SM_RE = re.compile(r"^\s*(?:sm|compute)_?(\d{2,3})[af]?\s*$", re.IGNORECASE)


def parse_capability(value: Any) -> Capability:
    """``(9, 0)``, ``"9.0"``, ``"sm_90"``, ``"sm90a"``, ``"SM120"`` -> ``(major, minor)``.

    Raises ValueError for anything else (the message says what was expected).
    """
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        return (int(value[0]), int(value[1]))
    if isinstance(value, str):
        m = _CAP_RE.match(value)
        if m:
            return (int(m.group(1)), int(m.group(2)))
        m = _SM_RE.match(value)
        if m:
            digits = m.group(1)
            return (int(digits[:-1]), int(digits[-1]))
    raise ValueError(f"expected a compute capability such as 9.0, 12.0 or sm_100, got {value!r}")


def _cap_str(cap: Capability) -> str:
    return f"{cap[0]}.{cap[1]}"


def _sm(cap: Capability) -> str:
    return f"SM{cap[0]}{cap[1]}"


def _parse_version(text: str | None) -> tuple[int, int] | None:
    if not text:
        return None
    m = re.match(r"^\s*(\d+)\.(\d+)", str(text))
    return (int(m.group(1)), int(m.group(2))) if m else None


def _ver_str(ver: tuple[int, int] | None) -> str | None:
    return None if ver is None else f"{ver[0]}.{ver[1]}"


@dataclass(frozen=True)
class PackageInfo:
    """Whether an importable module is present (found, never imported) and its distribution version."""

    module: str
    installed: bool
    version: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"module": self.module, "installed": self.installed, "version": self.version}


def _package_info(module: str) -> PackageInfo:
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError, AttributeError):
        found = False
    version = None
    if found:
        for dist in (module, module.replace("_", "-"), f"{module}-python".replace("_", "-")):
            try:
                version = importlib.metadata.version(dist)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
            except Exception:  # a broken distribution must not break detection
                break
    return PackageInfo(module, found, version)


def _matrix_packages() -> list[str]:
    return sorted({row.package for row in MATRIX})


@dataclass(frozen=True)
class DeviceInfo:
    """A device to judge: detected on this host (:func:`detect`) or stated as data."""

    device_type: str  # "cpu", "cuda", "rocm", "mps", ...
    capability: Capability | None = None
    name: str | None = None
    index: int | None = None
    cuda_version: str | None = None  # torch.version.cuda (the CUDA torch was built with)
    torch_version: str | None = None
    cuda_available: bool = False  # whether this host has a usable CUDA device at all
    packages: tuple[PackageInfo, ...] = ()
    detected: bool = False  # False: stated as data (packages and CUDA may be unknown)

    # -- constructors -------------------------------------------------------------------
    @classmethod
    def from_capability(
        cls,
        capability: Any,
        name: str | None = None,
        *,
        cuda_version: str | None = None,
        packages: Iterable[PackageInfo] | None = None,
    ) -> "DeviceInfo":
        """A CUDA device stated as data, e.g. ``DeviceInfo.from_capability((12, 0), "NVIDIA GeForce RTX 5090")``.

        ``cuda_version`` (e.g. ``"12.8"``) makes the CUDA requirement count; ``packages`` the
        package check.  Left out, only the architecture is judged.
        """
        return cls(
            device_type="cuda",
            capability=parse_capability(capability),
            name=name,
            cuda_version=cuda_version,
            cuda_available=True,
            packages=tuple(packages or ()),
            detected=False,
        )

    @classmethod
    def cpu(cls) -> "DeviceInfo":
        """A host without a CUDA device, stated as data."""
        return cls(device_type="cpu", detected=False)

    # -- views --------------------------------------------------------------------------
    @property
    def is_cuda(self) -> bool:
        return self.device_type == "cuda" and self.capability is not None

    @property
    def sm(self) -> str | None:
        return _sm(self.capability) if self.capability is not None else None

    def package(self, module: str) -> PackageInfo | None:
        for p in self.packages:
            if p.module == module:
                return p
        return None

    @property
    def flash_mla_installed(self) -> bool | None:
        p = self.package("flash_mla")
        return None if p is None else p.installed

    @property
    def flash_mla_version(self) -> str | None:
        p = self.package("flash_mla")
        return None if p is None else p.version

    def describe(self) -> str:
        """``"SM120 (NVIDIA GeForce RTX 5090, compute capability 12.0)"``, ``"cpu"``, ..."""
        if self.capability is None:
            return self.device_type
        parts = [self.name] if self.name else []
        parts.append(f"compute capability {_cap_str(self.capability)}")
        return f"{_sm(self.capability)} ({', '.join(parts)})"

    def to_dict(self) -> dict[str, Any]:
        return {
            "device_type": self.device_type,
            "capability": None if self.capability is None else _cap_str(self.capability),
            "sm": self.sm,
            "name": self.name,
            "index": self.index,
            "cuda_version": self.cuda_version,
            "torch_version": self.torch_version,
            "cuda_available": self.cuda_available,
            "packages": {p.module: {"installed": p.installed, "version": p.version} for p in self.packages},
            "detected": self.detected,
        }


def _normalize_device(device: Any) -> str | None:
    if device is None:
        return None
    return str(device).strip()


def detect(device: Any = None) -> DeviceInfo:
    """Detect ``device`` (None: the default CUDA device when there is one, else the CPU).

    ``device`` may be a ``torch.device`` or a string such as ``"cpu"``, ``"cuda"``, ``"cuda:1"``.
    Never imports a kernel library; the results are cached per device.
    """
    return _detect_cached(_normalize_device(device))


@functools.lru_cache(maxsize=None)
def _detect_cached(device: str | None) -> DeviceInfo:
    import torch

    torch_version = str(torch.__version__)
    cuda_version = torch.version.cuda
    hip_version = getattr(torch.version, "hip", None)
    packages = tuple(_package_info(m) for m in _matrix_packages())
    try:
        cuda_available = bool(torch.cuda.is_available())
    except Exception:
        cuda_available = False

    if device is None:
        dev = torch.device("cuda" if cuda_available else "cpu")
    else:
        dev = torch.device(device)

    common = dict(
        torch_version=torch_version,
        cuda_version=cuda_version,
        cuda_available=cuda_available,
        packages=packages,
        detected=True,
    )
    if dev.type != "cuda" or not cuda_available:
        return DeviceInfo(device_type=dev.type, **common)

    index = dev.index if dev.index is not None else torch.cuda.current_device()
    name = torch.cuda.get_device_name(index)
    capability = tuple(torch.cuda.get_device_capability(index))
    if hip_version:
        # ROCm builds of torch expose AMD GPUs as "cuda" devices with gfx numbers as the
        # "capability" (an MI250 reports 9.0): never mistake one for an SM90.
        return DeviceInfo(device_type="rocm", name=name, index=index, capability=None, **common)
    return DeviceInfo(device_type="cuda", capability=capability, name=name, index=index, **common)


def _clear_detect_cache() -> None:
    _detect_cached.cache_clear()


detect.cache_clear = _clear_detect_cache  # type: ignore[attr-defined]


# --------------------------------------------------------------------------------------
# Decisions
# --------------------------------------------------------------------------------------


def _device_phrase(info: DeviceInfo) -> str:
    if info.device_type == "cpu":
        if info.cuda_available:
            return "the device under test is the CPU (cpu), not a CUDA device"
        return "this host has no CUDA device (cpu)"
    if info.device_type == "cuda" and info.capability is None:
        return "this host has no CUDA device (cuda is not available)"
    if info.device_type == "rocm":
        label = f" ({info.name})" if info.name else ""
        return f"this device is an AMD ROCm GPU{label}, not an NVIDIA CUDA device"
    if info.device_type != "cuda":
        return f"the device under test is {info.device_type}, not a CUDA device"
    return f"this device is {info.describe()}"


def why_not(kernel_id: str, device_info: DeviceInfo | None = None, *, check_package: bool = True) -> str | None:
    """None when ``kernel_id`` can run on the device; otherwise one sentence saying why not.

    ``device_info`` None means this host (:func:`detect`).  The checks, in order: a CUDA device,
    an architecture the kernel is built for, the CUDA version torch was built with (when known;
    a proxy for the toolkit the kernel was compiled with), and — with ``check_package`` and when
    the device info knows it — whether the kernel's package is installed.  A device stated as data
    (:meth:`DeviceInfo.from_capability`) without ``cuda_version``/``packages`` is judged on its
    architecture alone.  Unknown ids raise ValueError.
    """
    row = get_kernel(kernel_id)
    info = detect() if device_info is None else device_info
    needs = row.needs()

    if not info.is_cuda:
        return f"{row.name} needs {needs}; {_device_phrase(info)}"

    target = row.target_for(info.capability)  # type: ignore[arg-type]
    if target is None:
        return f"{row.name} needs {needs}; {_device_phrase(info)}"

    have = _parse_version(info.cuda_version)
    if target.min_cuda is not None and have is not None and have < target.min_cuda:
        return (
            f"{row.name} needs CUDA >= {_ver_str(target.min_cuda)} on {target.name}; "
            f"this torch was built with CUDA {info.cuda_version} and this device is {info.describe()}"
        )

    if check_package:
        pkg = info.package(row.package)
        if pkg is not None and not pkg.installed:
            return (
                f"{row.name} runs on this device, {info.describe()}, "
                f"but the {row.package} package is not installed"
            )
    return None


def kernel_skip_reason(kernel_id: str, device: Any = None) -> str | None:
    """The skip reason for ``@pytest.mark.requires_kernel(kernel_id)``, or None to run the test.

    ``device`` is what the test runs on (a torch.device, ``"cpu"``, ``"cuda:0"``; None: this host's
    default).  Checks architecture, CUDA version and that the kernel's package is installed.
    """
    return why_not(kernel_id, detect(device), check_package=True)


# --------------------------------------------------------------------------------------
# CLI: mla-conformance matrix
# --------------------------------------------------------------------------------------


def _capability_arg(text: str) -> Capability:
    try:
        return parse_capability(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _cuda_arg(text: str) -> str:
    ver = _parse_version(text)
    if ver is None or not re.match(r"^\s*\d+\.\d+(\.\d+)?\s*$", text):
        raise argparse.ArgumentTypeError(f"expected a CUDA version such as 12.8, got {text!r}")
    return f"{ver[0]}.{ver[1]}"


def add_cli(subparsers: Any) -> None:
    """Register ``mla-conformance matrix``."""
    p = subparsers.add_parser(
        "matrix",
        help="print the kernel support matrix and a verdict per kernel for this device",
        description=(
            "Print the MLA kernel support matrix (architectures, KV cache, mode, head dims, page "
            "block, minimum CUDA, sources) and, for this host or the capability given, whether each "
            "kernel can run and why not."
        ),
    )
    p.add_argument(
        "--capability",
        type=_capability_arg,
        metavar="X.Y",
        help="judge a device of this compute capability (e.g. 9.0, 10.3, 12.0, sm_100) instead of this "
        "host; only the architecture counts unless --cuda is given",
    )
    p.add_argument("--name", metavar="NAME", help="device name to show with --capability")
    p.add_argument("--cuda", type=_cuda_arg, metavar="X.Y", help="with --capability: also judge this CUDA version")
    p.add_argument("--json", action="store_true", help="print one JSON object (device, matrix, verdicts)")
    p.set_defaults(func=_cmd_matrix)


def _judge_all(info: DeviceInfo, check_package: bool) -> dict[str, dict[str, Any]]:
    verdicts = {}
    for kid in kernel_ids():
        reason = why_not(kid, info, check_package=check_package)
        verdicts[kid] = {"supported": reason is None, "reason": reason}
    return verdicts


def matrix_report(capability: Any = None, *, name: str | None = None, cuda_version: str | None = None) -> dict[str, Any]:
    """The object ``matrix --json`` prints."""
    if capability is not None:
        info = DeviceInfo.from_capability(capability, name, cuda_version=cuda_version)
        judged_on = "architecture and CUDA version" if cuda_version else "architecture"
        check_package = False
    else:
        info = detect()
        judged_on = "architecture, CUDA version and installed packages"
        check_package = True
    device = info.to_dict()
    device["judged_on"] = judged_on
    return {
        "device": device,
        "matrix": [row.to_dict() for row in MATRIX],
        "verdicts": _judge_all(info, check_package),
        "adapters": adapter_status(),
    }


def _fmt_dims(dims: tuple[int, ...] | None) -> str:
    return "-" if dims is None else "/".join(str(d) for d in dims)


def _render_text(report: dict[str, Any]) -> str:
    headers = ("KERNEL", "ARCHITECTURES", "MIN CUDA", "KV CACHE", "MODE", "D_K", "D_V", "PAGE", "CONF")
    rows = []
    for row in MATRIX:
        archs = ", ".join(f"{t.name} ({'/'.join(_cap_str(c) for c in t.capabilities)})" for t in row.targets)
        cuda = ", ".join(f"{t.name}>={_ver_str(t.min_cuda) or '?'}" for t in row.targets)
        kv = row.kv_dtype.split(" (")[0]
        rows.append(
            (row.kernel_id, archs, cuda, kv, row.mode, _fmt_dims(row.head_dim_k), _fmt_dims(row.head_dim_v),
             _fmt_dims(row.page_block_size), row.confidence)
        )
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = ["MLA kernel support matrix (sources: mla-conformance matrix --json)", ""]
    lines.append(fmt.format(*headers).rstrip())
    lines.extend(fmt.format(*r).rstrip() for r in rows)

    dev = report["device"]
    if dev["capability"] is not None:
        label = f"{dev['sm']} (" + (f"{dev['name']}, " if dev["name"] else "") + f"compute capability {dev['capability']})"
    else:
        label = dev["device_type"] + (f" ({dev['name']})" if dev["name"] else "")
    origin = "detected on this host" if dev["detected"] else "as given"
    lines += ["", f"Device: {label}, {origin}; judged on {dev['judged_on']}"]
    if dev["detected"]:
        pk = ", ".join(
            f"{m} {v['version'] or ''}".rstrip() if v["installed"] else f"{m} not installed"
            for m, v in sorted(dev["packages"].items())
        )
        lines.append(f"torch {dev['torch_version']}, CUDA {dev['cuda_version'] or 'none'}; {pk}")
    lines.append("")
    kw = max(len(k) for k in report["verdicts"])
    for kid, verdict in report["verdicts"].items():
        if verdict["supported"]:
            lines.append(f"{kid:<{kw}}  supported")
        else:
            lines.append(f"{kid:<{kw}}  no: {verdict['reason']}")
    lines += ["", _runs_here(report)]
    lines += ["", "The suite's adapters (built-in ops; `flashmla` and `flashmla-sparse` also as layer backends):"]
    lines += ["  " + line for line in adapter_lines()]
    return "\n".join(lines)


def _runs_here(report: dict[str, Any]) -> str:
    """One sentence: which kernels do run on the device judged, by library (and when FlashInfer's auto picks FA2)."""
    dev = report["device"]
    where = f"On {dev['sm']} ({dev['capability']})" if dev["capability"] is not None else "On this host (no CUDA device)"
    runs = [k for k, v in report["verdicts"].items() if v["supported"]]
    parts = []
    for lib, prefix in (("FlashMLA", "flashmla/"), ("FlashInfer", "flashinfer/")):
        mine = [k for k in runs if k.startswith(prefix)]
        parts.append(f"{lib}'s {', '.join(mine)}" if mine else f"none of {lib}'s")
    text = f"{where}: " + "; ".join(parts)
    cap = dev["capability"]
    if cap is not None and "flashinfer/fa3_mla" not in runs and "flashinfer/fa2_mla" in runs:
        text += " (FlashInfer's backend auto falls back to FA2 off SM90)"
    elif cap is None:
        text += " (a CUDA GPU is needed for all of them)"
    return text + "."


def _cmd_matrix(args: argparse.Namespace) -> int:
    if args.capability is None and (args.cuda or args.name):
        print("mla-conformance matrix: error: --cuda and --name need --capability", file=sys.stderr)
        return 2
    report = matrix_report(args.capability, name=args.name, cuda_version=args.cuda)
    text = json.dumps(report, sort_keys=True, indent=2) if args.json else _render_text(report)
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:  # `matrix --json | head`: the reader left; not an error of ours
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
