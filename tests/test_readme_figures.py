"""Every figure README.md and docs/*.md state comes from a command or constant they name beside it; each is
re-derived here from that command's output (or the code it prints from), and the figures nothing re-derives stay
out. (The README's verdict and failure excerpts are re-run by tests/meta/test_readme_template.py.)

The pages wrap their lines, so they are compared with whitespace collapsed.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", "markers.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]


def _text(page: str) -> str:
    return " ".join((ROOT / page).read_text(encoding="utf-8").split())


def _first_screen() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return " ".join(text[:text.index("## Set up")].split())


def _cli_json(capsys, *args) -> dict:
    from mla_conformance.cli import main

    capsys.readouterr()
    assert main(list(args)) == 0
    return json.loads(capsys.readouterr().out)


def test_format_figures_are_what_budget_prints(capsys):
    """576 elements (512 + 64), 5,120 expanded at V2-Lite dims, 8.9x; 1,152 B / 10,240 B: `mla-conformance budget`."""
    b = _cli_json(capsys, "budget", "--json")
    assert b["preset"] == "deepseek-v2-lite" and b["dtype"] == "bfloat16"
    cfg, elem = b["config"], b["elem_bytes"]
    latent, expanded = (b["kv_bytes_per_token_per_layer"][k] for k in ("mla_latent", "mla_expanded_naive"))
    assert (f"{latent // elem} elements ({cfg['kv_lora_rank']} latent + {cfg['qk_rope_head_dim']} rotated RoPE key) "
            f"for a latent cache, {expanded // elem:,} expanded at DeepSeek-V2-Lite dims, {expanded / latent:.1f}× more "
            "(`mla-conformance budget`)") in _first_screen()
    table = _text("docs/cache-bytes.md")
    assert "DeepSeek-V2-Lite dims, BF16 (`mla-conformance budget`)" in table
    assert f"| {latent // elem} elements, {latent:,} B |" in table and \
        f"| {expanded // elem:,} elements, {expanded:,} B |" in table
    layer = _text("docs/layer-contract.md")
    assert f"{expanded // elem:,} elements per token per layer at V2-Lite dims" in layer  # reference-naive
    assert f"rotated k_pe ({latent // elem} elements at V2-Lite dims)" in layer  # reference-absorbed


def test_seed_000_figures_are_what_the_probe_measures(mla_device):
    """29,952 B / 266,240 B / 8.888…x: the probe `mla-conformance run` renders, run here on both references."""
    from mla_conformance import checks
    from mla_conformance.specs import get_backend

    absorbed = checks.v2_lite_cache_probe(get_backend("reference-absorbed"), device=mla_device)["active_nbytes"]
    naive = checks.v2_lite_cache_probe(get_backend("reference-naive"), device=mla_device)["active_nbytes"]
    ratio = math.floor(naive / absorbed * 1000) / 1000
    assert (f"{absorbed:,} B active for the latent cache, {naive:,} B expanded ({ratio:.3f}…x; the \"Cache bytes\" "
            "table of `mla-conformance run`'s conformance.md") in _text("docs/cache-bytes.md")


def test_dsa_byte_figures_are_the_formulas():
    """1,408 / 1,284 / 788 B (656 + 132) at V3.2 dims in BF16: checks.format_bytes_per_token, as docs/dsa.md says."""
    import torch

    from mla_conformance import MLAConfig, checks
    from mla_conformance.kv.codecs import get_codec

    c, bf16 = MLAConfig.preset("deepseek-v3.2"), torch.bfloat16
    plain = checks.format_bytes_per_token(c, "latent+indexer", bf16)
    fp8_key = checks.format_bytes_per_token(c, "latent+indexer", bf16, indexer_format="fp8-e4m3-block128")
    fp8 = checks.format_bytes_per_token(c, "latent+indexer", bf16, "fp8-e4m3-flashmla")
    row = get_codec("fp8-e4m3-flashmla").bytes_per_token(c, bf16)["total"]
    key = checks.indexer_bytes_per_token(c, "latent+indexer", bf16, "fp8-e4m3-flashmla")
    assert (f"{plain:,} B per token with the key in the cache dtype, {fp8_key:,} B with the FP8 key, {fp8:,} B with "
            f"`kv_codec=\"fp8-e4m3-flashmla\"` (FlashMLA's {row}-byte latent row plus a {key} B FP8 key)") \
        in _text("docs/dsa.md")


def test_sparse_decode_ratios_are_what_bench_measures():
    """BF16 2.88× / 3.51×, FP8 3.07× / 3.79× and reference-dsa's 1,408 B: `bench --json`'s sparse_decode_bytes,
    from bytes per token measured on reference-dsa's cache tensors."""
    from mla_conformance.perf.sparse import sparse_decode_bytes

    got = sparse_decode_bytes()
    assert got["preset"] == "deepseek-v3.2" if "preset" in got else True
    ratios = {form: [r["dense_over_sparse"] for r in sorted(got["forms"][form]["contexts"], key=lambda r: r["context"])]
              for form in ("bfloat16", "fp8-e4m3-flashmla")}
    contexts = sorted(r["context"] for r in got["forms"]["bfloat16"]["contexts"])
    (b16, b32), (f16, f32) = ratios["bfloat16"], ratios["fp8-e4m3-flashmla"]
    text = _text("docs/dsa.md")
    assert contexts == [16384, 32768] and "for 16k and 32k contexts" in text
    assert f"(BF16 {b16:.2f}× / {b32:.2f}×, FP8 {f16:.2f}× / {f32:.2f}×)" in text
    total = got["forms"]["bfloat16"]["bytes_per_token"]["total"]
    assert f"{total:,} B per token per layer in BF16 at V3.2 dims, measured from its cache tensors by " \
           "`mla-conformance bench --json`" in text


def test_softmax_scales_are_the_configs():
    """0.0722 / 0.1147: qk_head_dim ** -0.5 and MLAConfig.softmax_scale at V2-Lite dims."""
    from mla_conformance import MLAConfig

    c = MLAConfig.preset("deepseek-v2-lite")
    assert (f"(scaling {c.qk_head_dim ** -0.5:.4f} instead of {c.softmax_scale:.4f} at V2-Lite dims: "
            "`qk_head_dim ** -0.5` and `softmax_scale` of `MLAConfig.preset(\"deepseek-v2-lite\")`)") \
        in _text("docs/transformers-notes.md")


def test_pins_are_the_ones_ci_installs():
    """README's torch pin is .ci/run's; docs/transformers-notes.md's pinned release is constraints.txt's."""
    ci = (ROOT / ".ci/run").read_text(encoding="utf-8")
    (torch_pin,) = set(re.findall(r"torch==[\d.]+", ci))
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert set(re.findall(r"torch==[\d.]+", readme)) == {torch_pin}
    assert re.search(r"^pytest$", ci, re.M), ".ci/run runs the README's test command, a plain `pytest`"
    assert f"install {torch_pin} -e . && pytest\n" in readme.replace("pip install torch", "install torch")
    (tf_pin,) = re.findall(r"^transformers==[\d.]+", (ROOT / "constraints.txt").read_text(encoding="utf-8"), re.M)
    assert f"(`constraints.txt`: `{tf_pin}`" in _text("docs/transformers-notes.md")


def test_benchmark_floor_is_derived():
    """docs/report.md names the floor's derivation and types no figure of it (the code derives it)."""
    from mla_conformance.perf.cases import CLAIM_CONTEXT, CLAIM_FLOOR

    assert CLAIM_CONTEXT == 16384
    text = _text("docs/report.md")
    assert ("the absorbed speed-up at 16k is held to a floor derived from the config, not typed: the cache byte ratio, "
            "expanded over latent bytes per token") in text
    assert "`cache_byte_ratio`, `CLAIM_MARGIN`, `CLAIM_FLOOR` and `CLAIM_CONTEXT` in `mla_conformance/perf/cases.py`" \
        in text
    assert f"{CLAIM_FLOOR:.2f}x" not in text and f"{CLAIM_FLOOR:.1f}x at 16k" not in text


def test_isolation_defaults_are_the_plugins():
    """default 900 s; the watchdog a tenth of the timeout later, 0.5-30 s (pytest_plugin.isolation)."""
    from mla_conformance.pytest_plugin import isolation

    text = _text("docs/report.md")
    assert f"default {isolation.DEFAULT_TIMEOUT_S:g} s, 0 = none" in text
    assert isolation.hard_deadline(1.0) - 1.0 == 0.5 and isolation.hard_deadline(1000.0) - 1000.0 == 30.0
    assert isolation.hard_deadline(100.0) == 110.0 and "a tenth of the timeout later (0.5-30 s)" in text


def test_anchor_tolerances_are_the_tables():
    from mla_conformance.checks import ANCHOR_TOLERANCES as anchors
    from tools.docs import num

    assert anchors["reference-naive"] == anchors["reference-absorbed"]
    assert (f"reference-naive and reference-absorbed to {num(anchors['reference-naive'])}, hf-transformers to "
            f"{num(anchors['hf-transformers'])}") in _text("docs/tolerances.md")


def test_op_contract_figures_are_the_contracts():
    """The op contract's dims (576 = 512 + 64, the 656-byte FP8 row), as contract/op.py has them (its methods and
    declaration defaults are a generated table: python tools/docs.py)."""
    from mla_conformance.contract.op import D_QK, D_ROPE, D_V, FP8_ROW_BYTES

    text = _text("docs/op-contract.md")
    assert f"| `q` | [B, s_q, h_q, {D_QK}] | q's dtype: the absorbed nope part ({D_V}, already x W_UK), then the " \
           f"rotated rope part ({D_ROPE})" in text
    assert f"uint8 [..., {FP8_ROW_BYTES}]" in text and f"| `out` | [B, s_q, h_q, {D_V}] |" in text
    assert f"the default ({D_QK}, {D_V})" in text


@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("gone", ["2.8-3.6x", "2.8–3.6x", "0.12 / 0.07", "266,240 B in the V2-Lite cache probe's setting",
                                  "15,552 B (15.2 KiB", "about two minutes"])
def test_figures_nothing_re_derives_are_gone(page, gone):
    assert gone not in _text(page)


# --------------------------------------------------------------------------- adapters never run on hardware


def test_adapters_map_to_the_kernels_the_ops_run():
    """arch.ADAPTERS names each built-in adapter under the matrix row its op gates on."""
    from mla_conformance import arch
    from mla_conformance.contract.op import BUILTIN_OPS
    from mla_conformance.impl.ops.flashinfer import FlashInferFA2Op, FlashInferOp
    from mla_conformance.impl.ops.flashmla import (DENSE_PREFILL_KERNEL, SPARSE_PREFILL_KERNEL, FlashMLAOp,
                                                   FlashMLASparseOp)
    from mla_conformance.impl.ops.vllm_ops import MERGE_KERNEL, WRITE_KERNEL, VLLMOp

    sm90, sm80 = arch.DeviceInfo.from_capability((9, 0), "H100"), arch.DeviceInfo.from_capability((8, 0), "A100")
    runs = {(FlashMLAOp.name, FlashMLAOp.kernel_id), (FlashMLASparseOp.name, FlashMLASparseOp.kernel_id),
            (FlashMLASparseOp.name, SPARSE_PREFILL_KERNEL), (FlashMLAOp.name, DENSE_PREFILL_KERNEL),
            (FlashInferOp.name, FlashInferOp().kernel_id(sm90)), (FlashInferOp.name, FlashInferOp().kernel_id(sm80)),
            (FlashInferFA2Op.name, FlashInferFA2Op().kernel_id(sm90)),
            (VLLMOp.name, MERGE_KERNEL), (VLLMOp.name, WRITE_KERNEL)}
    for op in (FlashInferOp(), FlashInferFA2Op()):  # the optional methods' kernels (prefill picks FA3 on SM90)
        runs |= {(op.name, op.method_kernel_id(m, info)) for m in ("prefill", "merge", "write") for info in (sm90, sm80)}
    assert runs == {(name, kid) for kid, names in arch.ADAPTERS.items() for name in names}
    assert set(arch.ADAPTERS) <= set(arch.kernel_ids())
    # reference-op and triton are this project's own code (torch; Triton, docs/triton.md), not adapters over a
    # published kernel; vllm-cpu / vllm-amx are CPU kernels, gated by the host's CPU and vLLM's own backend choice
    # (docs/vllm-cpu.md): no GPU matrix row gates them
    assert {n for names in arch.ADAPTERS.values() for n in names} == \
        set(BUILTIN_OPS) - {"reference-op", "triton", "vllm-cpu", "vllm-amx"}


def test_adapters_say_they_never_ran_on_hardware_where_advertised(capsys):
    """README's first screen, the built-in backends and ops of docs/, `mla-conformance matrix` and the report's
    gating section."""
    from mla_conformance import arch
    from mla_conformance.cli import main

    assert not arch.RUN_ON_HARDWARE, "an adapter recorded as run on hardware: update the README and docs sentences"
    phrase = "not yet run on hardware: tested only against labelled stand-ins"
    assert phrase in _first_screen() and "adapters for FlashMLA and FlashInfer" in _first_screen()
    assert f"Both are **{phrase}**" in _text("docs/layer-contract.md")          # the flashmla backends
    assert f"The adapters are **{phrase}**" in _text("docs/op-contract.md")     # the built-in ops
    assert f"**{phrase}**" in _text("docs/support-matrix.md")
    capsys.readouterr()
    assert main(["matrix", "--capability", "9.0"]) == 0
    text = capsys.readouterr().out
    for kid, names in arch.ADAPTERS.items():
        assert f"{', '.join(names)}: not yet run on hardware" in " ".join(text.split()), kid
    assert phrase in arch.NOT_RUN_ON_HARDWARE and arch.NOT_RUN_ON_HARDWARE[1:] in " ".join(text.split())
    matrix = _cli_json(capsys, "matrix", "--capability", "9.0", "--json")
    assert all(not a["run_on_hardware"] and a["note"] == arch.NOT_RUN_ON_HARDWARE for a in matrix["adapters"].values())
    from mla_conformance.report.build import build_report
    from mla_conformance.report.markdown import render_markdown

    env = {"suite_version": "0", "python": "3", "torch": "2", "transformers": "5", "device": "cpu", "device_name": "x",
           "kernel_gating": {k: "no CUDA device" for k in arch.kernel_ids()}}
    md = render_markdown(build_report({"backends": [], "ops": ["flashmla"], "tests": []}, name="h", env=env))
    gating = md[md.index("## Kernel gating"):]
    assert f"- flashmla/dense_decode: `flashmla` (judged in this run): {arch.NOT_RUN_ON_HARDWARE}" in gating
