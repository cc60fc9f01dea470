"""The pinned fixtures: tiny-mla checkpoint integrity, offline loading, config and pinned prompts.

fixtures/models/tiny-mla is a 2-layer DeepSeek-V2 (MLA with the ``tiny`` attention preset, YaRN,
one MoE layer) trained by fixtures/train_tiny.py on in-context copy / recall tasks; fixtures/prompts.json
holds held-out episodes with their expected greedy answers. fixtures/models/tiny-mla-dsa is its DeepSeek Sparse
Attention variant (the same weights plus a trained lightning indexer; its README.md has the command that built it).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from mla_conformance.model import config as mla_config

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
MODEL_DIR = FIXTURES / "models" / "tiny-mla"
DSA_DIR = FIXTURES / "models" / "tiny-mla-dsa"
MANIFEST = FIXTURES / "MANIFEST.sha256"
PROMPTS = FIXTURES / "prompts.json"
TINY_SETS = ("tiny-short", "tiny-long")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _manifest() -> dict[str, str]:
    entries: dict[str, str] = {}
    for lineno, line in enumerate(MANIFEST.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        digest, sep, rel = line.partition("  ")
        assert sep and len(digest) == 64, f"{MANIFEST}:{lineno}: not a `sha256  path` line: {line!r}"
        entries[rel.strip()] = digest.lower()
    return entries


def _prompts() -> dict:
    return json.loads(PROMPTS.read_text(encoding="utf-8"))


def _episodes() -> list[dict]:
    sets = _prompts()["sets"]
    return [e for name in TINY_SETS for e in sets[name]]


@pytest.fixture(scope="module")
def offline():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        yield mp


@pytest.fixture(scope="module")
def hf_model(offline):
    import torch
    from transformers import DeepseekV2ForCausalLM

    torch.manual_seed(0)
    model, info = DeepseekV2ForCausalLM.from_pretrained(
        str(MODEL_DIR), attn_implementation="eager", local_files_only=True, output_loading_info=True
    )
    return model.eval(), info


@pytest.fixture(scope="module")
def tokenizer(offline):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(MODEL_DIR), local_files_only=True)


# ----------------------------------------------------------------------------------- manifest
def test_manifest_hashes_match():
    drift = []
    for rel, expected in sorted(_manifest().items()):
        path = FIXTURES / rel
        if not path.is_file():
            drift.append(f"{rel}: listed in MANIFEST.sha256 (sha256 {expected}) but missing")
            continue
        actual = _sha256(path)
        if actual != expected:
            drift.append(f"{rel}: MANIFEST.sha256 says {expected}, file has {actual}")
    assert not drift, "fixture drift (retrain with fixtures/train_tiny.py or fix MANIFEST.sha256):\n" + \
        "\n".join(drift)


def test_manifest_lists_every_model_file():
    listed = set(_manifest())
    on_disk = {p.relative_to(FIXTURES).as_posix() for p in (FIXTURES / "models").rglob("*") if p.is_file()}
    unlisted = sorted(on_disk - listed)
    assert not unlisted, "files under fixtures/models/ missing from MANIFEST.sha256:\n" + "\n".join(
        f"{rel}: sha256 {_sha256(FIXTURES / rel)}" for rel in unlisted)
    for model in ("tiny-mla", "tiny-mla-dsa", "tiny-mla-576"):
        assert f"models/{model}/model.safetensors" in listed
        assert f"models/{model}/config.json" in listed


def test_dsa_variant_is_tiny_mla_plus_an_indexer():
    """tiny-mla-dsa holds tiny-mla's tensors unchanged (a retrained tiny-mla leaves it stale) plus one indexer per
    layer, and its config.json is tiny-mla's plus the three DSA fields."""
    import dataclasses

    import torch
    from safetensors.torch import load_file

    dense = json.loads((MODEL_DIR / "config.json").read_text(encoding="utf-8"))
    dsa = json.loads((DSA_DIR / "config.json").read_text(encoding="utf-8"))
    extra = {k: dsa.pop(k) for k in ("index_n_heads", "index_head_dim", "index_topk")}
    assert dsa == dense and extra == {"index_n_heads": 4, "index_head_dim": 32, "index_topk": 6}
    assert mla_config.MLAConfig.from_hf(DSA_DIR) == dataclasses.replace(mla_config.MLAConfig.preset("tiny-dsa"),
                                                                        index_topk=6)
    a, b = load_file(str(MODEL_DIR / "model.safetensors")), load_file(str(DSA_DIR / "model.safetensors"))
    stale = [k for k in a if k not in b or not torch.equal(a[k], b[k])]
    assert not stale, f"tiny-mla-dsa's copies of tiny-mla's tensors differ (rebuild it, see its README.md): {stale}"
    indexer = {k for k in b if k not in a}
    assert indexer == {f"model.layers.{i}.self_attn.indexer.{n}" for i in range(dense["num_hidden_layers"])
                       for n in ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")}
    for rel in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (DSA_DIR / rel).read_bytes() == (MODEL_DIR / rel).read_bytes(), rel


# ------------------------------------------------------------------------------------- model
def test_model_loads_offline_with_moe_and_yarn(hf_model):
    import torch
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as mdv2

    model, info = hf_model
    assert not info["missing_keys"], info["missing_keys"]
    assert not info["unexpected_keys"], info["unexpected_keys"]
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.config._attn_implementation == "eager"
    moe = [i for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, getattr(mdv2, "DeepseekV2Moe", None) or mdv2.DeepseekV2MoE)]
    assert moe, "tiny-mla should have at least one MoE layer"
    assert model.config.n_routed_experts >= 2 and model.config.num_experts_per_tok >= 1
    rope = dict(getattr(model.config, "rope_parameters", None) or {**model.config.rope_scaling, "rope_theta": model.config.rope_theta})
    assert rope.get("rope_type") == "yarn"
    assert rope["rope_theta"] == 10000.0
    for key, value in {"factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
                       "beta_slow": 1, "mscale": 0.8, "mscale_all_dim": 0.8}.items():
        assert rope[key] == value, (key, rope[key], value)


def test_config_json_uses_old_rope_form():
    cfg = json.loads((MODEL_DIR / "config.json").read_text(encoding="utf-8"))
    assert cfg["model_type"] == "deepseek_v2"
    assert cfg["rope_theta"] == 10000.0
    assert cfg["rope_scaling"]["type"] == cfg["rope_scaling"]["rope_type"] == "yarn"
    assert "rope_parameters" not in cfg


def test_mla_config_matches_tiny_preset():
    assert mla_config.MLAConfig.from_hf(MODEL_DIR) == mla_config.MLAConfig.preset("tiny")


# ----------------------------------------------------------------------------------- prompts
#: each dense tiny model's prompts file (fixtures/train_tiny.py writes both with their models: the same tasks)
PROMPT_FILES = {"tiny-mla": PROMPTS, "tiny-mla-576": FIXTURES / "prompts-576.json"}


@pytest.mark.parametrize("model", list(PROMPT_FILES))
def test_prompt_sets_shape(model):
    """Short episodes under 64 tokens, long ones of 120..240 past YaRN's original 64 positions, each generating its
    answer's length; the set sizes fixtures/train_tiny.py's write_prompts draws (8 short, 5 long)."""
    doc = json.loads(PROMPT_FILES[model].read_text(encoding="utf-8"))
    assert doc["model"] == model and doc["model_dir"] == f"models/{model}"
    sets = doc["sets"]
    assert (len(sets["tiny-short"]), len(sets["tiny-long"])) == (8, 5)
    for e in sets["tiny-short"]:
        assert len(e["token_ids"]) + e["max_new_tokens"] < 64, e["id"]
    orig = mla_config.MLAConfig.from_hf(FIXTURES / "models" / model).yarn["original_max_position_embeddings"]
    for e in sets["tiny-long"]:
        total = len(e["token_ids"]) + e["max_new_tokens"]
        assert 120 <= total <= 240 and len(e["token_ids"]) > orig, e["id"]
    for e in (e for name in TINY_SETS for e in sets[name]):
        assert e["max_new_tokens"] == len(e["expected"]["token_ids"]), e["id"]
    (seed,) = sets["seed-000"]
    assert seed["id"] == "seed-000-sparse-experts" and seed["num_tokens"] == 26 and seed["token_ids"] is None


def test_prompts_retokenize(tokenizer):
    for e in _episodes():
        assert tokenizer(e["text"])["input_ids"] == e["token_ids"], e["id"]
        assert tokenizer(e["expected"]["text"], add_special_tokens=False)["input_ids"] == \
            e["expected"]["token_ids"], e["id"]


def _generate_batch(model, episodes: list[dict]) -> list[list[int]]:
    """One left-padded ``model.generate`` call (greedy, KV cache) for a whole prompt set."""
    import torch

    pad = model.config.pad_token_id
    width = max(len(e["token_ids"]) for e in episodes)
    x = torch.full((len(episodes), width), pad, dtype=torch.long)
    mask = torch.zeros_like(x)
    for r, e in enumerate(episodes):
        x[r, width - len(e["token_ids"]):] = torch.tensor(e["token_ids"])
        mask[r, width - len(e["token_ids"]):] = 1
    with torch.no_grad():
        out = model.generate(x, attention_mask=mask, max_new_tokens=max(e["max_new_tokens"] for e in episodes),
                             do_sample=False, use_cache=True, pad_token_id=pad)
    return [out[r, width:width + e["max_new_tokens"]].tolist() for r, e in enumerate(episodes)]


@pytest.mark.parametrize("set_name", TINY_SETS)
def test_greedy_decoding_accuracy(hf_model, set_name):
    model, _ = hf_model
    episodes = _prompts()["sets"][set_name]
    hit = total = 0
    misses = []
    for e, got in zip(episodes, _generate_batch(model, episodes)):
        expected = e["expected"]["token_ids"]
        ok = sum(1 for i, t in enumerate(expected) if i < len(got) and got[i] == t)
        hit, total = hit + ok, total + len(expected)
        if ok != len(expected):
            misses.append(f"{e['id']}: expected {expected}, got {got}")
    accuracy = hit / total
    assert accuracy >= 0.99, f"{set_name}: greedy accuracy {accuracy:.4f} < 0.99:\n" + "\n".join(misses)
