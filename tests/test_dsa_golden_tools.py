"""The DSA tiny model's goldens have teeth: its answers depend on the keys the indexer selects.

fixtures/models/tiny-mla-dsa is the dense tiny model plus a lightning indexer per layer (index_topk 6, below every
prompt's length -- the shortest recall prompt has 8 tokens -- so every answer token attends to 6 selected keys
only), warm-up trained; its goldens (suites/test_generation_golden.py, ``tiny-dsa-short`` / ``tiny-dsa-long``)
need accuracy >= 0.99 (1.0 on both when it was built). Here the same model runs with the indexer replaced by the
seeded random draw the warm-up started from (``MLAWeights.random(config, seed=0)``, what ``mla-conformance
dsa-variant`` writes with --warmup-steps 0): everything else identical, the answers collapse. (Measured on
cpu-float32 when the fixture was built: tiny-short 0.1176, tiny-long 0.0745; the recall answers 0.25 of their
tokens -- the <eos> after a wrong value -- and 0 of the 4 recalled values.)
"""

import pytest

from mla_conformance import MLAConfig
from mla_conformance.checks.layer.golden import PROMPT_SETS, load_tiny_model, model_dtype
from mla_conformance.generation import generate
from mla_conformance.generation.generate import DSA_MODEL
from mla_conformance.model.weights import MLAWeights
from mla_conformance.specs import get_backend


@pytest.fixture(scope="module")
def tiny_dsa_model(mla_device):
    return load_tiny_model(mla_device, dsa=True)


def _accuracy(outputs) -> float:
    total = sum(len(o["expected"]) for o in outputs)
    return sum(o["correct"] for o in outputs) / total if total else 1.0


def test_random_indexer_collapses_the_answers(tiny_dsa_model, mla_device, mla_figures, monkeypatch):
    """Negative control: the trained indexer gives >= 0.99 (the goldens); a random one selects the wrong 6 keys
    and the copy and recall answers fail -- measured, asserted below 0.5 on each prompt set, on the recall answers'
    tokens and on the recalled values (each recall answer's first token)."""
    dtype = model_dtype(mla_device)
    config = MLAConfig.from_hf(DSA_MODEL)
    assert config.index_topk == 6
    drawn = MLAWeights.random(config, seed=0, dtype=dtype)
    trained = generate.layer_weights

    def random_indexer(model, cfg, model_dir=None):
        return [MLAWeights(cfg, {**dict(w), **{n: drawn[n].to(w[n].device) for n in w if n.startswith("indexer.")}},
                           source=f"{w.source} (random indexer)") for w in trained(model, cfg, model_dir)]

    monkeypatch.setattr(generate, "layer_weights", random_indexer)
    result = generate.run_generation(DSA_MODEL, get_backend("reference-dsa"), prompt_sets=PROMPT_SETS, dtype=dtype,
                              device=mla_device, model=tiny_dsa_model)
    per_set = {s: _accuracy([o for o in result["outputs"] if o["set"] == s]) for s in PROMPT_SETS}
    recalls = [o for o in result["outputs"] if "recall" in o["id"]]
    assert recalls, "the prompt sets have no recall episode"
    recall = _accuracy(recalls)
    values = sum(int(o["tokens"][:1] == o["expected"][:1]) for o in recalls) / len(recalls)
    mla_figures.update(random_indexer=per_set, random_indexer_recall=recall, random_indexer_recall_values=values)
    print("measured accuracy with a random indexer: " + ", ".join(f"{s} {a:.4f}" for s, a in per_set.items())
          + f", recall answers {recall:.4f}, recalled values {values:.4f}")
    assert all(a < 0.5 for a in per_set.values()) and recall < 0.5 and values < 0.5, (per_set, recall, values)
