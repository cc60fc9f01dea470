"""Quantized latent caches (KV codecs of mla_conformance.kv.codecs): bytes, errors, the FP8 layout, the CLI.

* bytes per token per layer measured from the cache tensors after tokens went through ``attend`` equal
  the layout formula (V2-Lite BF16: plain 1,152 B, FlashMLA FP8 656 B), next to seed 001's figures;
* the latent round trip and the attention output stay within each codec's bound of
  ``codecs.ERROR_BOUNDS`` (Gaussian latents, V2-Lite random weights, and the tiny trained model);
  the INT2 negative control lands far outside every INT8 bound; seed 001's rankings are recorded;
* the FP8 codec is FlashMLA's V3.2 layout byte for byte against an encoding written here;
* ``mla-conformance codecs --json``.
"""

import pytest

from mla_conformance.checks.layer import codecs
from mla_conformance.kv.codecs import CODECS

BYTES_CASES = ([(c, p, "bfloat16") for p in ("tiny", "deepseek-v2-lite") for c in CODECS]
               + [(c, "deepseek-v2-lite", "float16") for c in ("none", "int8-g32", "int4-asym-g16-kpe-int4",
                                                              "fp8-e4m3-flashmla")])



@pytest.mark.mla_section("codec-bytes")
@pytest.mark.parametrize("codec,preset,dtype", BYTES_CASES)
def test_codec_bytes(mla_backend, codec, preset, dtype, mla_device, mla_figures):
    """Write tokens through attend(); bytes per stored token measured from the cache == the codec's formula.

    The same rule as test_cache_bytes.py (checks.cache_bytes): written bytes from the poisoned tensors,
    slots reported, self-reports checked."""
    codecs.check_codec_bytes(mla_backend, codec, preset, dtype, mla_device, mla_figures)


@pytest.mark.mla_section("codec-attention")
@pytest.mark.parametrize("codec", list(CODECS))
def test_attention_error(mla_backend, codec, mla_device, mla_figures):
    """The attention output with the codec (V2-Lite, BF16, varlen 13/6 + 1 decode).

    The backend's unquantized output is first held to the float64 reference (BF16 tolerance); the codec's
    output is then compared with that anchored baseline, so the figure is the cache's rounding alone."""
    codecs.check_attention_error(mla_backend, codec, mla_device, mla_figures)
