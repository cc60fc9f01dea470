"""The tiny model at DeepSeek's own latent dims: fixtures/models/tiny-mla-576 (kv_lora_rank 512 + qk_rope_head_dim
64 = 576 / 512, qk_nope / v 128, 2 heads; trained by ``fixtures/train_tiny.py --variant tiny-mla-576``, its
README.md has the command and what was measured) and its prompts, fixtures/prompts-576.json.

* the files: the manifest's lines, the config (tiny-mla's but the attention dims), tiny-mla's tokenizer and
  generation config byte for byte, a few MB;
* which model a golden test picks (mla_conformance.checks.layer.golden.golden_model): tiny-mla for every backend
  that takes it, tiny-mla-576 for one that takes only 576 / 512, and a skip naming both refusals otherwise;
* its goldens (``golden/generation/cpu-float32/tiny576-*``) through reference-absorbed, reference-op and
  hf-transformers, each restricted to 576 / 512 (tests/only_576.py) so the golden check itself picks the model, as
  it does for ``--mla-backend op:vllm-cpu``: each set once (every backend on both sets, and every codec, is
  the command in fixtures/models/tiny-mla-576/README.md); a 576-only op decoding without rope fails it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mla_conformance.checks.layer import golden
from mla_conformance.impl.ops.layer import OpBackend
from mla_conformance.model.config import MLAConfig
from mla_conformance.specs import get_backend

from . import only_576

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
DIR = FIXTURES / "models" / "tiny-mla-576"
MLA_DIR = FIXTURES / "models" / "tiny-mla"
FILES = ("README.md", "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
         "tokenizer_config.json")
#: the attention dims that differ from tiny-mla's config (fixtures/train_tiny.py ARCH_576)
DIMS = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
        "num_attention_heads": 2, "num_key_value_heads": 2}


def _config(directory: Path) -> dict:
    return json.loads((directory / "config.json").read_text(encoding="utf-8"))


# ------------------------------------------------------------------------------------------- files
def test_the_directory_holds_its_files_only():
    """Exactly FILES (their hashes: tests/test_fixtures.py, which checks every line of MANIFEST.sha256)."""
    assert sorted(p.name for p in DIR.iterdir() if p.is_file()) == sorted(FILES)


def test_config_is_tiny_mla_s_at_deepseek_dims():
    """The same architecture as tiny-mla (MoE, YaRN, old rope form) but the attention dims; the latent the suite
    reads is 576 / 512."""
    mine, tiny = _config(DIR), _config(MLA_DIR)
    assert {k: mine[k] for k in DIMS} == DIMS
    assert {k: v for k, v in mine.items() if k not in DIMS} == {k: v for k, v in tiny.items() if k not in DIMS}
    cfg = MLAConfig.from_hf(DIR)
    assert (cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.kv_lora_rank) == only_576.DIMS_576


def test_tokenizer_and_generation_config_are_tiny_mla_s():
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (DIR / name).read_bytes() == (MLA_DIR / name).read_bytes(), name


def test_a_few_megabytes():
    size = (DIR / "model.safetensors").stat().st_size
    assert size < 5_000_000, f"{DIR / 'model.safetensors'}: {size:,} bytes; the fixture is meant to stay a few MB"


# ------------------------------------------------------------------------------------ the choice
def test_golden_model_follows_what_the_backend_takes():
    kw = dict(dtype=golden.model_dtype("cpu"), device="cpu")
    assert golden.golden_model(get_backend("reference-absorbed"), **kw) is golden.TINY
    assert golden.golden_model(get_backend("op:reference-op"), **kw) is golden.TINY  # head_dims "any"
    assert golden.golden_model(only_576.Absorbed576(), **kw) is golden.TINY_576
    assert golden.golden_model(OpBackend(only_576.ReferenceOp576()), **kw) is golden.TINY_576
    assert golden.golden_model(only_576.Absorbed576(), kv_codec="int8-g32", **kw) is golden.TINY_576
    assert golden.TINY_576.golden_name("tiny-short+tiny-long") == "tiny576-short+tiny576-long"


def test_a_backend_taking_neither_skips_naming_both():
    """tiny-mla's sentence first (the verdict every backend had), then tiny-mla-576's where it differs."""
    with pytest.raises(pytest.skip.Exception) as info:
        golden.golden_model(only_576.HF576(), dtype=golden.model_dtype("cpu"), device="cpu", kv_codec="int8-g32")
    msg = str(info.value)
    assert msg.startswith("hf-transformers-576: hf-transformers-576 takes DeepSeek's latent only") and "80 / 64" in msg
    assert "; tiny-mla-576 (576/512): hf-transformers-576: hf-transformers caches what" in msg, msg
    with pytest.raises(pytest.skip.Exception) as info:  # the same refusal for both: said once
        golden.golden_model(get_backend("hf-transformers"), dtype=golden.model_dtype("cpu"), device="cpu",
                            kv_codec="int8-g32")
    assert "tiny-mla-576" not in str(info.value)


# ------------------------------------------------------------------------------------- goldens
@pytest.fixture(scope="module")
def model_576(mla_device):
    return golden.load_tiny_model(mla_device, model=golden.TINY_576)


#: built-ins restricted to 576 / 512 (tests/only_576.py), so the golden check picks tiny-mla-576 itself
BACKENDS = {"reference-absorbed": only_576.Absorbed576, "hf-transformers": only_576.HF576,
            "op:reference-op": lambda: OpBackend(only_576.ReferenceOp576())}
#: the default run's cases: each set once (the long one, 5 prompts of 120-240 tokens, through reference-absorbed)
CASES = [("reference-absorbed", "tiny-long"), ("hf-transformers", "tiny-short"), ("op:reference-op", "tiny-short")]


@pytest.mark.parametrize("backend, prompt_set", CASES)
def test_goldens_576(backend, prompt_set, model_576, request, snapshot, mla_device):
    """The suite's golden check (accuracy >= 0.99, the tokens of golden/generation/<class>/tiny576-*.none.json) on a
    built-in that takes only 576 / 512: it generates with tiny-mla-576."""
    figures: dict = {}
    golden.check_golden_generation(BACKENDS[backend](), request, snapshot, prompt_set=prompt_set, device=mla_device,
                                   figures=figures, model=lambda name: model_576)
    assert figures["golden_model"] == "tiny-mla-576" and figures["accuracy"] >= 0.99, figures


class RopeDropped576(only_576.ReferenceOp576):
    """Broken: its decode drops the query's rope part (positions), as a kernel reading only the latent would."""

    name = "broken-576-decode-without-rope"

    def decode(self, q, *args, **kwargs):
        q = q.clone()
        q[..., 512:] = 0
        return super().decode(q, *args, **kwargs)


def test_a_broken_576_op_fails_its_golden(model_576, request, snapshot, mla_device):
    """The check can fail: a decode without rope through the same path (tiny-mla-576 picked, prefill through the
    op's prefill) collapses the answers (measured: 0.1117 over both sets)."""
    with pytest.raises(AssertionError, match=r"op:broken-576-decode-without-rope tiny-mla-576 tiny-short: accuracy 0\.\d+ vs bound >= 0\.99"):
        golden.check_golden_generation(OpBackend(RopeDropped576()), request, snapshot, prompt_set="tiny-short",
                                       device=mla_device, figures={}, model=lambda name: model_576)
