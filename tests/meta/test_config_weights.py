"""MLAConfig presets and HF config parsing; MLAWeights from random and from real safetensors files."""

import json

import pytest
import torch
from safetensors.torch import save_file

from mla_conformance import MLAConfig, MLAWeights
from mla_conformance.checks.layer.driver import master_weights
from mla_conformance.errors import CheckpointError, MLAInputError
from mla_conformance.model.weights import V3_REFERENCE_NAMES

pytestmark = pytest.mark.meta

PRESETS = ["deepseek-v2-lite", "deepseek-v2", "deepseek-v3", "deepseek-v3.2", "tiny"]


@pytest.mark.parametrize("name", PRESETS)
def test_presets(name):
    c = MLAConfig.preset(name)
    assert c.latent_dim == c.kv_lora_rank + c.qk_rope_head_dim
    assert c.yarn and c.yarn["rope_type"] == "yarn"


def test_published_values():
    lite, v3 = MLAConfig.preset("deepseek-v2-lite"), MLAConfig.preset("deepseek-v3")
    assert (lite.hidden_size, lite.num_attention_heads, lite.q_lora_rank, lite.num_hidden_layers) == (2048, 16, None, 27)
    assert (v3.hidden_size, v3.num_attention_heads, v3.q_lora_rank, v3.num_hidden_layers) == (7168, 128, 1536, 61)
    assert lite.yarn["mscale_all_dim"] == 0.707 and v3.yarn["mscale_all_dim"] == 1.0


def test_unknown_preset_names_it():
    with pytest.raises(MLAInputError, match="'deepseek-v9'"):
        MLAConfig.preset("deepseek-v9")


def test_from_hf_old_and_new_rope_forms(tmp_path):
    lite = MLAConfig.preset("deepseek-v2-lite")
    old = {**lite.to_hf_dict(), "rope_scaling": {"type": "yarn", **{k: v for k, v in lite.yarn.items() if k != "rope_type"}}}
    new = {k: v for k, v in lite.to_hf_dict().items() if k not in ("rope_scaling", "rope_theta")}
    new["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0,
                              **{k: v for k, v in lite.yarn.items() if k != "rope_type"}}
    assert MLAConfig.from_hf(old) == lite
    assert MLAConfig.from_hf(new) == lite
    (tmp_path / "config.json").write_text(json.dumps(new))
    assert MLAConfig.from_hf(tmp_path) == lite


def test_from_hf_errors_name_the_file(tmp_path):
    with pytest.raises(CheckpointError, match="config.json: no such file"):
        MLAConfig.from_hf(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json: not valid JSON"):
        MLAConfig.from_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(CheckpointError, match="missing MLA field 'num_attention_heads'"):
        MLAConfig.from_hf(tmp_path)


def test_random_weights_deterministic_and_well_scaled():
    from mla_conformance.model.reference import reference_attention_f64

    c = MLAConfig.preset("tiny")
    a, b = MLAWeights.random(c, seed=3), MLAWeights.random(c, seed=3)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["o_proj.weight"], MLAWeights.random(c, seed=4)["o_proj.weight"])
    x = torch.randn(1, 32, c.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    rms = reference_attention_f64(a.to(torch.float64), x).pow(2).mean().sqrt()
    assert 0.3 < float(rms) < 5, f"output rms {float(rms)} is not of order one"


def _write_layer(path, weights, layer, names="hf"):
    prefix = f"model.layers.{layer}.self_attn." if names == "hf" else f"layers.{layer}.attn."
    inverse = {hf: v3 for v3, hf in V3_REFERENCE_NAMES.items()}
    return {prefix + (k if names == "hf" else inverse[k]): v.contiguous() for k, v in weights.items()}


_RANDOM: dict = {}


def _random(config, seed):  # V2-Lite dims draw in float64: once per (config, seed), not once per parametrisation
    for preset in ("tiny", "deepseek-v2-lite"):  # the session's own draw of a preset (the suites' oracles use it)
        if config == MLAConfig.preset(preset):
            return master_weights(preset, seed)
    key = (json.dumps(config.to_hf_dict(), sort_keys=True), seed)
    if key not in _RANDOM:
        _RANDOM[key] = MLAWeights.random(config, seed=seed)
    return _RANDOM[key]


def _checkpoint(tmp_path, config, *, names="hf", sharded=False):
    w = _random(config, 1)
    tensors = {**_write_layer(tmp_path, _random(config, 0), 0, names),
               **_write_layer(tmp_path, w, 1, names)}
    tensors["model.embed_tokens.weight"] = torch.zeros(4, config.hidden_size)
    (tmp_path / "config.json").write_text(json.dumps(config.to_hf_dict()))
    if sharded:
        keys = sorted(tensors)
        half = len(keys) // 2
        shards = {"model-00001-of-00002.safetensors": keys[:half], "model-00002-of-00002.safetensors": keys[half:]}
        for fname, ks in shards.items():
            save_file({k: tensors[k] for k in ks}, str(tmp_path / fname))
        index = {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        save_file(tensors, str(tmp_path / "model.safetensors"))
    return w


#: naming and sharding are the same at any dims: tried at tiny dims; V2-Lite dims (two 55 MB layers) once
@pytest.mark.parametrize("preset,names,sharded", [("tiny", "hf", False), ("tiny", "hf", True), ("tiny", "v3", False),
                                                  ("deepseek-v2-lite", "hf", False)])
def test_from_checkpoint(tmp_path, preset, names, sharded):
    config = MLAConfig.preset(preset)
    w = _checkpoint(tmp_path, config, names=names, sharded=sharded)
    got = MLAWeights.from_checkpoint(tmp_path, layer=1)
    assert got.config == config and set(got) == set(w)
    assert all(torch.equal(got[k], w[k]) for k in w)
    assert got.to(torch.bfloat16).dtype == torch.bfloat16


def test_checkpoint_errors_name_file_and_tensor(tmp_path):
    config = MLAConfig.preset("tiny")
    _checkpoint(tmp_path, config)
    with pytest.raises(CheckpointError, match=r"layer 5 attention tensor 'model.layers.5.self_attn"):
        MLAWeights.from_checkpoint(tmp_path, layer=5)
    wrong = MLAConfig(**{**config.to_hf_dict(), "kv_lora_rank": 32})
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor 'model.layers.0.self_attn.kv_a_proj_with_mqa.weight' has shape"):
        MLAWeights.from_checkpoint(tmp_path, layer=0, config=wrong)
    f = tmp_path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model.safetensors: truncated safetensors file"):
        MLAWeights.from_checkpoint(tmp_path)
    f.write_bytes(b"\xff" * 8 + data[8:100])
    with pytest.raises(CheckpointError, match=r"model.safetensors: corrupt safetensors header"):
        MLAWeights.from_checkpoint(tmp_path)
    f.unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors file"):
        MLAWeights.from_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        MLAWeights.from_checkpoint(tmp_path / "nope")


# --------------------------------------------------------------------------- DeepSeek Sparse Attention fields


def test_dsa_fields_published_and_dense_default(tmp_path):
    v32 = MLAConfig.preset("deepseek-v3.2")
    assert (v32.index_n_heads, v32.index_head_dim, v32.index_topk) == (64, 128, 2048) and v32.dsa
    v3 = MLAConfig.preset("deepseek-v3")
    assert not v3.dsa and "index_topk" not in v3.to_hf_dict() and "dsa" not in v3.describe()
    assert "topk=2048" in v32.describe() and v32.to_hf_dict()["index_topk"] == 2048
    assert MLAConfig.from_hf(v32.to_hf_dict()) == v32
    tiny_dsa = MLAConfig.preset("tiny-dsa")
    assert MLAConfig(**{**tiny_dsa.to_hf_dict(), "index_n_heads": None, "index_head_dim": None,
                        "index_topk": None}) == MLAConfig.preset("tiny")
    # a deepseek_v32 config.json without the fields gets transformers' DeepseekV32Config defaults
    assert MLAConfig.from_hf({**v3.to_hf_dict(), "model_type": "deepseek_v32"}) == v32
    with pytest.raises(MLAInputError, match="index_head_dim, index_topk unset"):
        MLAConfig(**{**v3.to_hf_dict(), "index_n_heads": 4})
    with pytest.raises(MLAInputError, match="needs q_lora_rank"):
        MLAConfig(**{**MLAConfig.preset("deepseek-v2-lite").to_hf_dict(), "index_n_heads": 4,
                     "index_head_dim": 64, "index_topk": 8})


@pytest.mark.parametrize("names", ["hf", "v3"])
def test_dsa_weights_random_and_checkpoint(tmp_path, names):
    config = MLAConfig.preset("tiny-dsa")
    w = MLAWeights.random(config, seed=0)
    dense = MLAWeights.random(MLAConfig.preset("tiny"), seed=0)
    assert all(torch.equal(w[k], dense[k]) for k in dense)  # indexer drawn after the dense tensors
    assert {k for k in w if k.startswith("indexer.")} == {
        "indexer.wq_b.weight", "indexer.wk.weight", "indexer.k_norm.weight", "indexer.k_norm.bias",
        "indexer.weights_proj.weight"}
    assert w["indexer.wq_b.weight"].shape == (4 * 32, 64) and w["indexer.weights_proj.weight"].shape == (4, 128)
    assert w["indexer.k_norm.bias"].abs().max() < 1.0 and (w["indexer.k_norm.weight"] - 1).abs().max() < 1.0
    with pytest.raises(CheckpointError, match="missing attention tensor"):
        MLAWeights(config, dict(dense))
    with pytest.raises(CheckpointError, match="dense: no indexer"):
        MLAWeights(dense.config, dict(w))
    written = _checkpoint(tmp_path, config, names=names)
    loaded = MLAWeights.from_checkpoint(tmp_path, layer=1)
    assert loaded.config == config and set(loaded) == set(written) and not loaded.changed_from(written)
