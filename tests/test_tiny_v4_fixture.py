"""The pinned tiny DeepSeek-V4 fixture: fixtures/models/tiny-v4 (trained by fixtures/train_tiny_v4.py; its README.md
has the command and the measured accuracies) and its prompt sets, fixtures/prompts-v4.json.

Fast checks only (no model is built): the manifest's lines for the directory, the config as transformers'
DeepseekV4Config and the suite's V4Config read it, each layer's attention tensors under their HF names, the
prompts (token ids, and the far prompts' facts out of the windows' reach). The generations themselves are
suites/test_v4_golden.py's.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from mla_conformance.model.v4_config import CSA, HCA, SLIDING, V4Config, V4Weights, expected_shapes

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
V4_DIR = FIXTURES / "models" / "tiny-v4"
MLA_DIR = FIXTURES / "models" / "tiny-mla"
MANIFEST = FIXTURES / "MANIFEST.sha256"
PROMPTS = FIXTURES / "prompts-v4.json"
FILES = ("README.md", "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
         "tokenizer_config.json")


def _manifest() -> dict[str, str]:
    out = {}
    for line in MANIFEST.read_text(encoding="utf-8").splitlines():
        digest, sep, rel = line.partition("  ")
        if sep:
            out[rel.strip()] = digest
    return out


def _config() -> dict:
    return json.loads((V4_DIR / "config.json").read_text(encoding="utf-8"))


def test_manifest_lists_and_matches_every_file():
    listed = {rel: d for rel, d in _manifest().items() if rel.startswith("models/tiny-v4/")}
    on_disk = sorted(p.name for p in V4_DIR.iterdir() if p.is_file())
    assert on_disk == sorted(FILES), on_disk
    assert sorted(listed) == [f"models/tiny-v4/{f}" for f in sorted(FILES)], sorted(listed)
    actual = {rel: hashlib.sha256((FIXTURES / rel).read_bytes()).hexdigest() for rel in listed}
    drift = [f"{rel}: MANIFEST.sha256 says {d}, the file has {actual[rel]}" for rel, d in listed.items() if actual[rel] != d]
    assert not drift, "tiny-v4 drift (retrain with fixtures/train_tiny_v4.py):\n" + "\n".join(drift)


def test_tokenizer_and_generation_config_are_tiny_mla_s():
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (V4_DIR / name).read_bytes() == (MLA_DIR / name).read_bytes(), name


def test_config_reads_as_transformers_deepseek_v4():
    from transformers import DeepseekV4Config

    cfg = DeepseekV4Config.from_pretrained(str(V4_DIR), local_files_only=True)
    assert cfg.model_type == "deepseek_v4" and _config()["architectures"] == ["DeepseekV4ForCausalLM"]
    assert cfg.layer_types == [SLIDING, CSA, HCA]
    assert cfg.compress_rates == {CSA: 4, HCA: 8}
    assert (cfg.sliding_window, cfg.index_topk, cfg.hc_mult, cfg.qk_rope_head_dim) == (8, 2, 2, 16)
    assert cfg.mlp_layer_types == ["moe"] * 3  # no hash-routed layer: generation needs no tid2eid table
    compress = cfg.rope_parameters["compress"]
    assert compress["rope_type"] == "yarn" and compress["rope_theta"] == 160000.0
    assert compress.get("attention_factor") == 1.0  # V4 applies no YaRN mscale
    assert cfg.rope_parameters["main"]["rope_theta"] == 10000.0


def test_config_reads_as_v4_config():
    from transformers import DeepseekV4Config

    cfg = V4Config.from_hf(V4_DIR)
    assert cfg.layer_types == (SLIDING, CSA, HCA)
    assert cfg.compress_rates == {CSA: 4, HCA: 8}
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.qk_rope_head_dim) == (128, 4, 64, 16)
    assert (cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank, cfg.sliding_window) == (32, 2, 32, 8)
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk) == (2, 32, 2)
    assert (cfg.rope_theta, cfg.compress_rope_theta) == (10000.0, 160000.0)
    assert cfg.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                "beta_fast": 32, "beta_slow": 1}
    # transformers' reading of the file, handed to V4Config, is the same config
    assert V4Config.from_hf(DeepseekV4Config.from_pretrained(str(V4_DIR), local_files_only=True)) == cfg


@pytest.mark.parametrize("layer", [0, 1, 2])
def test_layer_weights_under_hf_names(layer):
    import torch

    w = V4Weights.from_checkpoint(V4_DIR, layer=layer)
    assert w.config.layer_type == (SLIDING, CSA, HCA)[layer]
    assert set(w) == set(expected_shapes(w.config))
    assert all(t.dtype == torch.float32 and bool(torch.isfinite(t).all()) for t in w.values())


def test_checkpoint_holds_transformers_names():
    from safetensors import safe_open

    with safe_open(str(V4_DIR / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    attn = {n for n in names if ".self_attn." in n}
    expected = {f"model.layers.{L}.self_attn.{n}" for L in range(3)
                for n in expected_shapes(V4Config.from_hf(V4_DIR).for_layer(L))}
    assert attn == expected
    for n in ("model.embed_tokens.weight", "lm_head.weight", "model.hc_head.hc_fn", "model.norm.weight",
              "model.layers.0.attn_hc.fn", "model.layers.2.mlp.experts.gate_up_proj"):
        assert n in names, n


def test_prompts_v4():
    doc = json.loads(PROMPTS.read_text(encoding="utf-8"))
    assert doc["model"] == "tiny-v4" and doc["model_dir"] == "models/tiny-v4"
    sets = doc["sets"]
    assert sorted(sets) == ["tiny-v4-far", "tiny-v4-near"]
    assert len(sets["tiny-v4-far"]) >= 6 and len(sets["tiny-v4-near"]) >= 3
    vocab = json.loads((V4_DIR / "tokenizer.json").read_text(encoding="utf-8"))["model"]["vocab"]
    cfg = V4Config.from_hf(V4_DIR)
    reach = cfg.num_hidden_layers * (cfg.sliding_window - 1)  # what the windows alone reach, layer over layer
    for name, eps in sets.items():
        for e in eps:
            words = e["text"].split()
            assert e["token_ids"] == [vocab["<bos>"], *(vocab[w] for w in words)], e["id"]
            assert e["expected"]["token_ids"] == [vocab[w] for w in e["expected"]["text"].split()], e["id"]
            assert e["max_new_tokens"] == len(e["expected"]["token_ids"]) == 2, e["id"]
            key, value = words[-1], e["expected"]["text"].split()[0]
            at = words.index(key)  # the fact's key (keys are distinct): the value follows it
            assert words[at + 1] == value and words[-2] == "RECALL", e["id"]
            assert e["fact_distance"] == len(words) - 1 - (at + 1), e["id"]
            if name == "tiny-v4-far":
                assert e["fact_distance"] > reach, e["id"]
            else:
                assert e["fact_distance"] < cfg.sliding_window, e["id"]
