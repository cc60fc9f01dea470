"""The KV budget reproduces seed 004's printed figures for DeepSeek-V3.2 (bf16, tile 64x64, 256 threads, 2 stages).

Every expected number below is a literal copied from the seed's output, never recomputed here.
"""

from __future__ import annotations

import json

import pytest

from mla_conformance.kv import budget
from mla_conformance.model.config import MLAConfig

V32 = MLAConfig.preset("deepseek-v3.2")


@pytest.fixture(scope="module")
def report():
    return budget.budget(V32, 8192, preset="deepseek-v3.2")


def test_kv_bytes_per_token_per_layer(report):
    assert report["kv_bytes_per_token_per_layer"] == {
        "mha_128x128": 65_536, "gqa_8": 4_096, "gqa_1": 512, "mla_latent": 1_152, "mla_expanded_naive": 81_920,
    }


def test_whole_model_and_one_sequence(report):
    assert report["layers"] == 61
    assert report["kv_bytes_per_token_model"]["mla_latent"] == 70_272
    assert report["kv_bytes_per_token_model"]["mha_128x128"] == 3_997_696
    assert report["sequence_bytes"]["mla_latent"] == 575_668_224
    assert report["sequence_bytes"]["mla_latent"] / 2**20 == 549.0
    assert budget.fmt_bytes(report["sequence_bytes"]["mla_latent"]) == "549.00 MiB"
    assert report["fraction_of_mha"]["mla_latent"] == pytest.approx(0.0176, abs=5e-5)


def test_arithmetic_intensity(report):
    ai = report["arithmetic_intensity"]
    assert round(ai["mla_latent"], 1) == 241.8
    assert ai["mla_latent"] == pytest.approx(budget.mla_decode_ai(128, 512, 64, 2))
    assert ai["mha_128x128"] == ai["mla_expanded_naive"] == 1.0
    assert ai["gqa_8"] == budget.mha_decode_ai(128, 8, 2) == 16.0
    assert ai["gqa_1"] == 128.0


def test_heads_to_balance(report):
    seed = report["balance"]["h100_sxm_seed004"]
    assert round(seed["balance_flop_per_byte"]) == 333
    assert round(seed["mla_heads_needed"]) == 176
    assert seed["mla_decode_bound"] == "memory"  # 128 heads sit just below the ridge
    for key in ("h100_sxm", "h200_sxm"):
        assert report["balance"][key]["source"]
    assert report["balance"]["h200_sxm"]["balance_flop_per_byte"] < report["balance"]["h100_sxm"]["balance_flop_per_byte"]


def test_tile_account(report):
    t = report["tile"]
    assert (t["acc_o_fp32_elems"], t["acc_o_regs_per_thread"]) == (32_768, 128)
    assert (t["acc_s_fp32_elems"], t["acc_s_regs_per_thread"]) == (4_096, 16)
    assert t["acc_regs_per_thread"] == 144 and t["acc_fits_register_limit"]
    assert t["smem_bytes"] == {"q": 65_536, "q_pe": 8_192, "s": 8_192, "kv": 131_072, "k_pe": 16_384, "o": 65_536}
    assert t["smem_total_bytes"] == 294_912 and t["smem_total_kib"] == 288.0


def test_extra_codec_rows():
    rows = budget.kv_rows(V32, "bfloat16", extra_codecs=[("fp8_latent", 656)])
    extra = rows[-1]
    assert (extra.key, extra.bytes_per_token_per_layer) == ("fp8_latent", 656)
    assert extra.flops_per_token_per_layer == rows[3].flops_per_token_per_layer  # the latent's FLOPs
    with pytest.raises(Exception, match="duplicates"):
        budget.kv_rows(V32, "bfloat16", extra_codecs=[("mla_latent", 1)])


def test_small_preset_drops_meaningless_gqa_rows():
    keys = [r.key for r in budget.kv_rows(MLAConfig.preset("tiny"), "float32")]
    assert keys == ["mha_4x32", "gqa_1", "mla_latent", "mla_expanded_naive"]


def test_cli_json(capsys):
    from mla_conformance.cli import main

    assert main(["budget", "--preset", "deepseek-v3.2", "--seq", "8192", "--json"]) == 0
    text = capsys.readouterr().out
    data = json.loads(text)
    assert text == budget.to_json(data) + "\n"  # sorted keys, stable layout
    assert data["kv_bytes_per_token_per_layer"]["mla_latent"] == 1_152
    assert data["kv_bytes_per_token_per_layer"]["mla_expanded_naive"] == 81_920
    assert data["sequence_bytes"]["mla_latent"] == 575_668_224
    assert round(data["arithmetic_intensity"]["mla_latent"], 1) == 241.8
    assert round(data["balance"]["h100_sxm_seed004"]["mla_heads_needed"]) == 176
    assert data["tile"]["acc_regs_per_thread"] == 144
    assert data["tile"]["smem_total_bytes"] == 294_912
    # DSA: the latent (seed 004's 1,152) and the indexer key apart and together, BF16 and FP8
    dsa = data["dsa"]
    assert (dsa["cache_dtype"]["latent_bytes_per_token_per_layer"], dsa["cache_dtype"]["indexer_bytes_per_token_per_layer"],
            dsa["cache_dtype"]["total_bytes_per_token_per_layer"]) == (1_152, 256, 1_408)
    assert (dsa["fp8"]["latent_bytes_per_token_per_layer"], dsa["fp8"]["indexer_bytes_per_token_per_layer"],
            dsa["fp8"]["total_bytes_per_token_per_layer"]) == (656, 132, 788)
    assert dsa["cache_dtype"]["total_sequence_bytes"] == 1_408 * 61 * 8192
    # DeepSeek's V3.2-Exp reference: a BF16 latent beside the FP8 block-128 indexer key; the byte tests' formula agrees
    assert (dsa["fp8_indexer"]["latent_bytes_per_token_per_layer"], dsa["fp8_indexer"]["indexer_bytes_per_token_per_layer"],
            dsa["fp8_indexer"]["total_bytes_per_token_per_layer"]) == (1_152, 132, 1_284)
    import torch

    from mla_conformance.checks import format_bytes_per_token

    assert format_bytes_per_token(MLAConfig.preset("deepseek-v3.2"), "latent+indexer", torch.bfloat16,
                                  indexer_format="fp8-e4m3-block128") == 1_284


def test_cli_table(capsys):
    from mla_conformance.cli import main

    assert main(["budget", "--preset", "deepseek-v3.2", "--seq", "8192"]) == 0
    out = capsys.readouterr().out
    assert "549.00 MiB" in out and "241.8" in out and "294,912" in out
    assert "latent alone (seed 004's 1,152 B/token/layer)" in out and "1,152 + indexer  256 =  1,408" in out
    assert "656 + indexer  132 =    788" in out


def test_dense_config_has_no_dsa_block():
    assert budget.budget(MLAConfig.preset("deepseek-v3"), 1024)["dsa"] is None


def test_cli_unknown_preset(capsys):
    from mla_conformance.cli import main

    assert main(["budget", "--preset", "deepseek-v9", "--seq", "8192"]) == 2
    assert "deepseek-v9" in capsys.readouterr().err


def test_cli_bad_sequence_length(capsys):
    from mla_conformance.cli import main

    assert main(["budget", "--seq", "0"]) == 2
    assert "--seq" in capsys.readouterr().err


def test_codec_rows_are_the_codecs_formulas():
    """The quantized rows the budget adds are kv.codecs' own formulas (no silent empty list: codecs always ship)."""
    import torch

    from mla_conformance.kv.codecs import CODECS

    rows = dict(budget.codec_rows(V32, "bfloat16"))
    assert rows and "none" not in rows
    for name, nbytes in rows.items():
        assert nbytes == int(CODECS[name].bytes_per_token(V32, torch.bfloat16)["total"])


@pytest.mark.parametrize("typed", ["9.0", "sm_90", "SM90", "sm90a"])
def test_cli_capability_spellings(typed, capsys):
    """--capability takes what matrix --capability takes (arch.capability.parse_capability)."""
    from mla_conformance.cli import main

    assert main(["budget", "--preset", "tiny", "--capability", typed, "--json"]) == 0
    assert list(json.loads(capsys.readouterr().out)["tile"]["smem_verdicts"]) == ["9.0"]


def test_cli_capability_not_a_capability(capsys):
    from mla_conformance.cli import main

    assert main(["budget", "--capability", "banana"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--capability banana: expected a compute capability" in err
