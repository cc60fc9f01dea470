"""DeepSeek-V4's KV-cache budget (mla_conformance.kv.v4_budget, ``mla-conformance budget --v4``): the per-component
formulas of DeepSeek's V4 inference/model.py caches, the whole-model sum, the V3 / V3.2 rows beside them, the claim
comparison, and the output docs/cache-bytes.md quotes. Arithmetic only: no model runs."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest

from mla_conformance.errors import MLAInputError
from mla_conformance.kv import budget
from mla_conformance.kv import v4_budget as V
from mla_conformance.model.config import MLAConfig
from mla_conformance.model.v4_config import CSA, HCA, SLIDING, V4Config

ROOT = Path(__file__).resolve().parents[1]
FLASH, PRO = V4Config.preset("deepseek-v4-flash"), V4Config.preset("deepseek-v4-pro")
K128, M1 = 128 * 1024, 1024 * 1024


@pytest.fixture(scope="module")
def report():
    return V.v4_report()


@pytest.fixture(scope="module")
def printed():
    from mla_conformance.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["budget", "--v4"]) == 0
    return buf.getvalue()


# ------------------------------------------------------------------------- components
@pytest.mark.parametrize("config", [FLASH, PRO], ids=["flash", "pro"])
def test_window_is_constant_past_the_window(config):
    assert config.sliding_window == 128
    assert [V.window_rows(config, t) for t in (1, 127, 128, 129, 4096, M1)] == [1, 127, 128, 128, 128, 128]
    for layer_type in set(config.layer_types):
        short, long = (V.layer_bytes(config, layer_type, t, "bf16") for t in (200, M1))
        assert short["window"] == long["window"] == 128 * 512 * 2


@pytest.mark.parametrize("layer_type, ratio", [(CSA, 4), (HCA, 128)])
def test_compressed_entries_grow_one_row_per_ratio_tokens(layer_type, ratio):
    cfg = PRO
    assert [V.compressed_rows(cfg, layer_type, t) for t in (1, ratio - 1, ratio, 2 * ratio - 1, 2 * ratio)] == \
        [0, 0, 1, 1, 2]
    for t in (ratio, 1000, K128, M1 - ratio):
        assert V.compressed_rows(cfg, layer_type, t + ratio) - V.compressed_rows(cfg, layer_type, t) == 1
    assert V.compressed_rows(cfg, layer_type, M1) == M1 // ratio
    # indexer keys: one per compressed entry in CSA layers, none in HCA
    assert V.indexer_rows(cfg, layer_type, M1) == (M1 // 4 if layer_type == CSA else 0)


def test_window_only_layers_hold_the_window_alone():
    one = V.layer_bytes(FLASH, SLIDING, M1, "bf16")
    assert (one["compressed"], one["indexer"], one["state"]) == (0, 0, 0)
    assert one["total"] == one["window"] == 128 * 1024
    with pytest.raises(MLAInputError, match="no sliding_attention layer"):
        V.layer_bytes(PRO, SLIDING, M1, "bf16")  # V4-Pro has none


def test_compressor_state_is_the_open_window_in_float32():
    # kv_state + score_state, float32 [coff * ratio, coff * width] each; coff 2 for CSA's overlapping compressor
    csa, hca = V.compressor_state_bytes(PRO, CSA), V.compressor_state_bytes(PRO, HCA)
    assert csa == {"compressor": 2 * (2 * 4) * (2 * 512) * 4, "indexer_compressor": 2 * (2 * 4) * (2 * 128) * 4,
                   "total": 2 * 8 * 1024 * 4 + 2 * 8 * 256 * 4}
    assert hca == {"compressor": 2 * 128 * 512 * 4, "indexer_compressor": 0, "total": 2 * 128 * 512 * 4}
    for layer_type in (CSA, HCA):
        assert len({V.layer_bytes(PRO, layer_type, t, f)["state"] for t in (5, K128, M1) for f in V.FORMATS}) == 1


def test_row_bytes_come_from_their_owners():
    from mla_conformance.kv import model1

    assert V.row_bytes(PRO, "bf16") == {"row": 1024, "indexer_key": 256}
    # MODEL1: 448 e4m3 nope + 64 bf16 rope (128 B) + 7 e8m0 scales + 1 padding byte
    assert model1.bytes_per_token()["total"] == 448 + 64 * 2 + 8 == 584
    assert V.row_bytes(PRO, "fp8") == {"row": 584, "indexer_key": 256}
    # the FP8 indexer key is the DSA budget's: 128 e4m3 + one float32 scale per 128 values
    v32 = budget.dsa_bytes(MLAConfig.preset("deepseek-v3.2"), 1, 2)
    assert V.row_bytes(PRO, "fp8+fp8-indexer") == {"row": 584, "indexer_key": v32["fp8"]["indexer_bytes_per_token_per_layer"]}
    assert v32["fp8"]["indexer_bytes_per_token_per_layer"] == 128 + 4
    with pytest.raises(MLAInputError, match="MODEL1"):
        V.row_bytes(V4Config.preset("v4-tiny"), "fp8")  # head_dim 32: no MODEL1 row
    with pytest.raises(MLAInputError, match="unknown V4 cache format"):
        V.row_bytes(PRO, "int4")


@pytest.mark.parametrize("seq_len", [1000, K128])
def test_csa_and_hca_layer_at_two_lengths(seq_len):
    state_csa, state_hca = (V.compressor_state_bytes(PRO, t)["total"] for t in (CSA, HCA))
    csa = V.layer_bytes(PRO, CSA, seq_len, "fp8+fp8-indexer")
    assert csa["rows"] == {"window": 128, "compressed": seq_len // 4, "indexer": seq_len // 4}
    assert csa["total"] == (128 + seq_len // 4) * 584 + (seq_len // 4) * 132 + state_csa
    hca = V.layer_bytes(PRO, HCA, seq_len, "bf16")
    assert hca["total"] == (128 + seq_len // 128) * 1024 + state_hca
    assert hca["bytes_per_token"] == hca["total"] / seq_len


# ------------------------------------------------------------------------- the whole model
@pytest.mark.parametrize("config", [FLASH, PRO], ids=["flash", "pro"])
@pytest.mark.parametrize("fmt", list(V.FORMATS))
def test_model_is_the_sum_over_layer_types(config, fmt):
    for seq_len in (100, K128, M1):
        model = V.model_bytes(config, seq_len, fmt)
        per_layer = [V.layer_bytes(config, t, seq_len, fmt) for t in config.layer_types]
        assert model["total"] == sum(p["total"] for p in per_layer)
        for part in ("window", "compressed", "indexer", "state"):
            assert model[part] == sum(p[part] for p in per_layer)
        assert model["total"] == sum(n * V.layer_bytes(config, t, seq_len, fmt)["total"]
                                     for t, n in V.layer_counts(config).items())
        # the printed formula line evaluates to the total it states
        formula, stated = V.derivation(config, seq_len, fmt).rsplit(" = ", 1)
        expr = re.sub(r"\b(swa|csa|hca)\b", "", formula).replace(",", "").replace("x", "*").replace("[", "(") \
            .replace("]", ")")
        assert eval(expr) == int(stated.removesuffix(" B").replace(",", "")) == model["total"]


def test_layer_counts_are_the_presets():
    assert V.layer_counts(FLASH) == {SLIDING: 2, CSA: 21, HCA: 20}
    assert V.layer_counts(PRO) == {CSA: 30, HCA: 31}


# ------------------------------------------------------------------------- V3 / V3.2 and the claim
def test_v3_rows_are_the_budgets_own(report):
    for t in report["contexts"]:
        rows = report["v3"][str(t)]
        v3 = budget.budget(MLAConfig.preset("deepseek-v3"), t, extra_codecs=budget.codec_rows(MLAConfig.preset("deepseek-v3"), "bfloat16"))
        v32 = budget.budget(MLAConfig.preset("deepseek-v3.2"), t)
        assert rows["deepseek-v3"]["formats"]["bf16"]["total"] == v3["sequence_bytes"]["mla_latent"] == 61 * t * 1152
        assert rows["deepseek-v3"]["formats"]["fp8"]["total"] == v3["sequence_bytes"]["fp8-e4m3-flashmla"]
        assert rows["deepseek-v3.2"]["formats"]["bf16"]["total"] == v32["dsa"]["cache_dtype"]["total_sequence_bytes"]
        assert rows["deepseek-v3.2"]["formats"]["fp8"]["total"] == v32["dsa"]["fp8"]["total_sequence_bytes"] \
            == 61 * t * (656 + 132)


def test_claim_ratio_is_v4_over_v32_at_1m(report):
    claim = report["claim"]
    assert claim["context"] == M1 and claim["claimed"] == {"deepseek-v4-pro": 0.10, "deepseek-v4-flash": 0.07}
    assert [(p["v4_format"], p["v32_format"]) for p in claim["pairings"] if p["like_for_like"]] == \
        [("fp8+fp8-indexer", "fp8")]
    v32 = V.v3_rows(M1)["deepseek-v3.2"]["formats"]
    for p in claim["pairings"]:
        for preset, r in p["ratios"].items():
            ours = V.model_bytes(V4Config.preset(preset), M1, p["v4_format"])["total"]
            assert (r["v4_bytes"], r["v32_bytes"]) == (ours, v32[p["v32_format"]]["total"])
            assert r["measured"] == ours / v32[p["v32_format"]]["total"]
            assert r["agrees"] == (abs(r["measured"] - r["claimed"]) <= V.CLAIM_TOLERANCE + 1e-12)


# ------------------------------------------------------------------------- the command and the docs
def test_cli_prints_the_v4_rows_and_the_claim(printed, report):
    for label, layers in (("V4-Flash", 43), ("V4-Pro", 61)):
        assert f"{label}: {layers} layers" in printed and f"model ({layers} layers)" in printed
    for scope in ("swa layer (x2)", "csa layer (x21)", "hca layer (x20)", "csa layer (x30)", "hca layer (x31)",
                  "V3 MLA (61 layers)", "V3.2 DSA (61 layers)"):
        for fmt in ("bf16", "fp8"):
            assert re.search(rf"^  {re.escape(scope)} +{re.escape(fmt)} ", printed, re.M), (scope, fmt)
    assert "128k (131,072): sequence" in printed and "1M (1,048,576): sequence" in printed
    assert "DeepSeek's claim: at 1M tokens V4-Pro needs 10% of V3.2's KV cache, V4-Flash 7%" in printed
    assert "fp8+fp8-indexer / fp8: the like-for-like pairing" in printed
    pro = report["claim"]["pairings"][0]["ratios"]["deepseek-v4-pro"]
    assert f"V4-Pro: {pro['verdict']}" in printed and f"{pro['measured']:.1%} measured vs 10% claimed" in printed
    assert f"V4-Pro = {V.derivation(PRO, M1, 'fp8+fp8-indexer')}" in printed
    assert f"V3.2 = 61 x 1,048,576 x 788 = {61 * M1 * 788:,} B" in printed
    assert budget.fmt_bytes(V.model_bytes(PRO, M1, "bf16")["total"]) in printed


def test_cli_json(capsys):
    from mla_conformance.cli import main

    assert main(["budget", "--v4", "--json"]) == 0
    text = capsys.readouterr().out
    data = json.loads(text)
    assert text == budget.to_json(data) + "\n"
    assert data["contexts"] == [K128, M1]
    pro = data["models"]["deepseek-v4-pro"]
    assert pro["layer_counts"] == {"csa": 30, "hca": 31}
    assert pro["model"]["fp8"][str(M1)]["total"] == V.model_bytes(PRO, M1, "fp8")["total"]
    assert pro["per_layer"]["bf16"]["hca"][str(K128)]["total"] == V.layer_bytes(PRO, HCA, K128, "bf16")["total"]


def test_docs_quote_the_commands_output(printed):
    """Every line docs/cache-bytes.md quotes from `mla-conformance budget --v4` is a line that command prints."""
    text = (ROOT / "docs" / "cache-bytes.md").read_text(encoding="utf-8")
    section = text[text.index("## DeepSeek-V4"):]
    block = re.search(r"```text\n\$ mla-conformance budget --v4\n(.*?)```", section, re.S)
    assert block, "docs/cache-bytes.md quotes no `mla-conformance budget --v4` output"
    lines = [line for line in block.group(1).splitlines() if line.strip() and line.strip() != "..."]
    assert len(lines) > 10
    out = set(printed.splitlines())
    assert [line for line in lines if line not in out] == []


def test_docs_verdict_is_the_commands(report):
    """docs/cache-bytes.md says the measured ratio agrees with the claim for neither model in any pairing."""
    text = " ".join((ROOT / "docs" / "cache-bytes.md").read_text(encoding="utf-8").split())
    assert "in the lines above it does not, for either model in any pairing" in text
    assert not any(r["agrees"] for p in report["claim"]["pairings"] for r in p["ratios"].values())


@pytest.mark.parametrize("preset", ["deepseek-v4-flash", "deepseek-v4-pro"])
def test_v4_preset_names_print_the_v4_tables(capsys, printed, preset):
    """``budget --preset deepseek-v4-pro`` (a V4 preset name) prints what ``budget --v4`` prints."""
    from mla_conformance.cli import main

    assert main(["budget", "--preset", preset]) == 0
    assert capsys.readouterr().out == printed
