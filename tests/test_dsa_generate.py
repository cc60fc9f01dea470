"""Generation through a DSA backend on a DeepSeek Sparse Attention variant of the tiny model.

``generate.make_dsa_variant`` copies the dense tiny model and adds an indexer per layer (+ the DSA fields in
config.json). With index_topk >= every sequence, selection keeps every key: reference-dsa must then generate
exactly what reference-absorbed generates on the dense model. The indexer is read from the variant's
safetensors (transformers' DeepseekV2 modules ignore it); its warm-up training lowers the KL to the dense
attention. (Measured once, not here -- 300 warm-up steps take minutes: at index_topk 16 the seeded random
indexer gives tiny-short 0.16 / tiny-long 0.05 accuracy; after 300 warm-up steps on held-out episodes,
1.0 / 1.0.)
"""

import json

import pytest
import torch

from mla_conformance import MLAConfig
from mla_conformance.generation import generate
from mla_conformance.specs import get_backend
from mla_conformance.cli import main
from mla_conformance.errors import MLAInputError


@pytest.fixture(scope="module")
def wide_variant(tmp_path_factory):
    """index_topk 256 (>= every tiny sequence) and 2 warm-up steps on 4 short held-out episodes."""
    out = tmp_path_factory.mktemp("dsa") / "tiny-dsa-256"
    seqs = [s[:24] for s in generate.tiny_training_sequences()[::16]]
    figures = generate.make_dsa_variant(generate.DEFAULT_MODEL, out, index_topk=256, sequences=seqs, steps=2)
    return out, figures, generate.load_model(out)


def test_variant_reads_as_dsa_with_its_indexer(wide_variant):
    out, figures, model = wide_variant
    config = MLAConfig.from_hf(out)
    assert (config.index_n_heads, config.index_head_dim, config.index_topk) == (4, 32, 256)
    assert sum(figures["kl_per_layer"]) < sum(figures["kl_per_layer_initial"])  # the warm-up trains the indexer
    from safetensors.torch import load_file

    saved = load_file(str(out / "model.safetensors"))
    w = generate.layer_weights(model, config)
    assert torch.equal(w[1]["indexer.wq_b.weight"], saved["model.layers.1.self_attn.indexer.wq_b.weight"])
    assert torch.equal(w[0]["q_a_proj.weight"], saved["model.layers.0.self_attn.q_a_proj.weight"])
    with pytest.raises(MLAInputError, match="reference-absorbed does not declare DeepSeek Sparse Attention"):
        generate.run_generation(out, get_backend("reference-absorbed"), prompt_sets=["tiny-long"], max_new_tokens=1,
                         model=model)


def test_topk_above_every_length_generates_as_dense(wide_variant, capsys):
    """Through the CLI, as a user runs it: `generate --model VARIANT --backend reference-dsa`. Every tiny-short
    episode is shorter than index_topk 256, so DSA is dense MLA here and must answer as the dense model does
    (every answer token right on tiny-short, test_generation_golden): the first two tokens of each answer."""
    out, _, _ = wide_variant
    assert main(["generate", "--model", str(out), "--backend", "reference-dsa", "--prompts", "tiny-short",
                 "--max-new-tokens", "2", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["backend"] == "reference-dsa" and len(got["outputs"]) == 8
    assert all(o["correct"] == min(2, len(o["expected"])) for o in got["outputs"]), \
        [(o["id"], o["tokens"], o["expected"]) for o in got["outputs"]]
