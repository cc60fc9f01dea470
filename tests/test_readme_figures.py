"""Every figure README.md states comes from a command it names beside it; each is re-derived here from that
command's output (or the code the command prints from), and the figures nothing re-derives stay out.

The README wraps its lines, so it is compared with whitespace collapsed.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _readme() -> str:
    return " ".join(README.read_text(encoding="utf-8").split())


def _first_screen() -> str:
    text = README.read_text(encoding="utf-8")
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
    text = _readme()
    assert (f"{latent // elem} elements ({cfg['kv_lora_rank']} latent + {cfg['qk_rope_head_dim']} rotated RoPE key)"
            in text)
    assert f"({expanded // elem:,} at DeepSeek-V2-Lite dims: {expanded / latent:.1f}× more; formulas `mla-conformance budget`" in text
    assert f"{latent:,} B for a BF16 latent at DeepSeek dims, {expanded:,} B expanded at V2-Lite dims: `mla-conformance budget`" in text
    assert f"{expanded // elem:,} elements per token per layer at V2-Lite dims" in text  # reference-naive


def test_seed_000_figures_are_what_the_probe_measures(mla_device):
    """29,952 B / 266,240 B / 8.888…x: the probe `mla-conformance run` renders, run here on both references."""
    from mla_conformance import checks
    from mla_conformance.specs import get_backend

    absorbed = checks.v2_lite_cache_probe(get_backend("reference-absorbed"), device=mla_device)["active_nbytes"]
    naive = checks.v2_lite_cache_probe(get_backend("reference-naive"), device=mla_device)["active_nbytes"]
    ratio = math.floor(naive / absorbed * 1000) / 1000
    assert (f"{absorbed:,} B active for the latent cache, {naive:,} B expanded ({ratio:.3f}…x; the \"Cache bytes\" "
            "table of `mla-conformance run`'s conformance.md") in _readme()


def test_sparse_decode_ratios_are_what_bench_measures():
    """BF16 2.88× / 3.51×, FP8 3.07× / 3.79× and reference-dsa's 1,408 B: `bench --json`'s sparse_decode_bytes,
    from bytes per token measured on reference-dsa's cache tensors."""
    from mla_conformance.perf import bench

    got = bench.sparse_decode_bytes()
    ratios = {form: [r["dense_over_sparse"] for r in sorted(got["forms"][form]["contexts"], key=lambda r: r["context"])]
              for form in ("bfloat16", "fp8-e4m3-flashmla")}
    (b16, b32), (f16, f32) = ratios["bfloat16"], ratios["fp8-e4m3-flashmla"]
    text = _readme()
    assert f"(BF16 {b16:.2f}× / {b32:.2f}×, FP8 {f16:.2f}× / {f32:.2f}×)" in text
    total = got["forms"]["bfloat16"]["bytes_per_token"]["total"]
    assert f"{total:,} B per token per layer in BF16 at V3.2 dims, measured from its cache tensors by " \
           "`mla-conformance bench --json`" in text


def test_softmax_scales_are_the_configs():
    """0.0722 / 0.1147: qk_head_dim ** -0.5 and MLAConfig.softmax_scale at V2-Lite dims."""
    from mla_conformance import MLAConfig

    c = MLAConfig.preset("deepseek-v2-lite")
    assert (f"(scaling {c.qk_head_dim ** -0.5:.4f} instead of {c.softmax_scale:.4f} at V2-Lite dims: "
            "`qk_head_dim ** -0.5` and `softmax_scale` of `MLAConfig.preset(\"deepseek-v2-lite\")`)") in _readme()


def test_benchmark_floor_is_the_suites_constant():
    from tests._suite_modules import suite_namespace

    floor = suite_namespace("test_decode_bench")["CLAIM_FLOOR"]
    assert f"({floor:g}x at 16k, `CLAIM_FLOOR` in `suites/test_decode_bench.py`" in _readme()


@pytest.mark.parametrize("gone", ["2.8-3.6x", "2.8–3.6x", "0.12 / 0.07", "266,240 B in the V2-Lite cache probe's setting"])
def test_figures_nothing_re_derives_are_gone(gone):
    assert gone not in _readme()


# --------------------------------------------------------------------------- adapters never run on hardware


def test_adapters_map_to_the_kernels_the_ops_run():
    """arch.ADAPTERS names each built-in adapter under the matrix row its op gates on."""
    from mla_conformance import arch
    from mla_conformance.contract.op import BUILTIN_OPS
    from mla_conformance.impl.ops.flashinfer import FlashInferFA2Op, FlashInferOp
    from mla_conformance.impl.ops.flashmla import FlashMLAOp, FlashMLASparseOp

    sm90, sm80 = arch.DeviceInfo.from_capability((9, 0), "H100"), arch.DeviceInfo.from_capability((8, 0), "A100")
    runs = {(FlashMLAOp.name, FlashMLAOp.kernel_id), (FlashMLASparseOp.name, FlashMLASparseOp.kernel_id),
            (FlashInferOp.name, FlashInferOp().kernel_id(sm90)), (FlashInferOp.name, FlashInferOp().kernel_id(sm80)),
            (FlashInferFA2Op.name, FlashInferFA2Op().kernel_id(sm90))}
    assert runs == {(name, kid) for kid, names in arch.ADAPTERS.items() for name in names}
    assert set(arch.ADAPTERS) <= set(arch.kernel_ids())
    assert {n for names in arch.ADAPTERS.values() for n in names} == set(BUILTIN_OPS) - {"reference-op"}


def test_adapters_say_they_never_ran_on_hardware_where_advertised(capsys):
    """README's first screen and backend list, `mla-conformance matrix` and the report's gating section."""
    from mla_conformance import arch
    from mla_conformance import report as R
    from mla_conformance.cli import main

    assert not arch.RUN_ON_HARDWARE, "an adapter recorded as run on hardware: update the README sentences"
    phrase = "not yet run on hardware: tested only against labelled stand-ins"
    assert phrase in _first_screen() and "adapters for FlashMLA and FlashInfer" in _first_screen()
    assert f"Both are **{phrase}**" in _readme()
    capsys.readouterr()
    assert main(["matrix", "--capability", "9.0"]) == 0
    text = capsys.readouterr().out
    for kid, names in arch.ADAPTERS.items():
        assert f"{', '.join(names)}: not yet run on hardware" in " ".join(text.split()), kid
    assert arch.NOT_RUN_ON_HARDWARE[1:] in text and phrase in arch.NOT_RUN_ON_HARDWARE
    matrix = _cli_json(capsys, "matrix", "--capability", "9.0", "--json")
    assert all(not a["run_on_hardware"] and a["note"] == arch.NOT_RUN_ON_HARDWARE for a in matrix["adapters"].values())
    env = {"suite_version": "0", "python": "3", "torch": "2", "transformers": "5", "device": "cpu", "device_name": "x",
           "kernel_gating": {k: "no CUDA device" for k in arch.kernel_ids()}}
    rep = R.build_report({"backends": [], "ops": ["flashmla"], "tests": []}, name="h", env=env)
    md = R.render_markdown(rep)
    gating = md[md.index("## Kernel gating"):]
    assert f"- flashmla/dense_decode: `flashmla` (judged in this run): {arch.NOT_RUN_ON_HARDWARE}" in gating
