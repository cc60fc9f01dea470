"""Checks of the quantized latent caches (KV codecs of mla_conformance.kv.codecs), for
suites/test_quantized_kv.py and the tool's own tests of the codecs (tests/test_codecs.py): bytes per token
against each codec's layout formula, the attention output with a codec against the backend's unquantized output
(itself anchored to float64), every codec's error bound (``ERROR_BOUNDS``) on Gaussian latents and on the tiny
trained model's, FlashMLA's FP8 layout written byte by byte, and seed 001's rankings.
"""

from __future__ import annotations

import functools
import json
import math
import struct

import pytest
import torch

from mla_conformance.dtypes import FP8_E4M3_MAX

from mla_conformance.checks.layer.bytes import cache_bytes
from mla_conformance.checks.layer.driver import (Scenario, inputs_for, require_support, run_scenario, scenario_lengths,
                                           weights_for)
from mla_conformance.checks.metrics import DTYPES, error_metrics
from mla_conformance.checks.tolerances import TOLERANCES, tolerance_figures
from mla_conformance.contract.layer import cache_format_of
from mla_conformance.generation.generate import layer_weights, load_model
from mla_conformance.kv.codecs import CODECS, ERROR_BOUNDS, QUANT_STUDY_SCHEMES, get_codec
from mla_conformance.messages import bound_line, failure, over
from mla_conformance.model import reference
from mla_conformance.model.config import MLAConfig
from mla_conformance.model.reference import reference_attention_f64
from mla_conformance.resources import prompts_file, tiny_model_dir
from mla_conformance.specs import get_backend

MODEL_DIR = tiny_model_dir()
PROMPTS = prompts_file()
INT8 = [n for n in CODECS if n.startswith("int8")]
#: varlen prefill then one decode step, so a token is written after the cache was read once.
ATTENTION_SCENARIO = Scenario("codec-attention", (13, 6), decode_steps=1)

#: The layouts pinned at V2-Lite dims in BF16 (payload, metadata) bytes per token per layer: changing a
#: layout must be deliberate (markers.md lists the same numbers).
V2_LITE_BF16 = {
    "none": (1152, 0), "int8-tensor": (640, 0), "int8-token": (640, 4), "int8-g16": (640, 128),
    "int8-g32": (640, 64), "int8-g16-kpe-int8": (576, 160), "int8-g32-kpe-int8": (576, 96),
    "int4-sym-g16": (384, 128), "int4-sym-g32": (384, 64), "int4-asym-g16": (384, 256),
    "int4-asym-g32": (384, 128), "int4-asym-g16-kpe-int4": (288, 288), "int4-asym-g32-kpe-int4": (288, 160),
    "int2-asym-g32": (256, 128), "fp8-e4m3-flashmla": (640, 16),
}


def codec_error(x_hat: torch.Tensor, x: torch.Tensor) -> dict[str, float]:
    """max / mean abs and relative Frobenius error (no quantiles: these tensors are large)."""
    x_hat, x = x_hat.to(torch.float64), x.to(torch.float64)
    d = (x_hat - x).abs()
    return {"max_abs": float(d.max()), "mean_abs": float(d.mean()), "rel_fro": float(d.norm() / x.norm())}


# --------------------------------------------------------------------------- bytes


def check_codec_bytes(backend, codec: str, preset: str, dtype: str, device, figures: dict) -> None:
    """Write tokens through attend(); bytes per stored token measured from the cache == the codec's formula.

    The same rule as test_cache_bytes.py (cache_bytes): written bytes from the poisoned tensors,
    slots reported, self-reports checked."""
    __tracebackhide__ = True
    dt = DTYPES[dtype]
    config = MLAConfig.preset(preset)
    require_support(backend, config, dtype=dt, device=device, kv_codec=codec)
    if cache_format_of(backend) != "latent":
        pytest.skip(f"{backend.name}: an expanded cache is no latent codec layout (its bytes: test_cache_bytes.py)")
    got = cache_bytes(backend, preset, dt, prefill=4, decode=1, batch=2, capacity=12, device=device,
                      kv_codec=codec, figures=figures)
    if got["cache_format"] != "latent":  # the cache itself says expanded (e.g. transformers 4.x): bytes checked above
        pytest.skip(f"{backend.name}: its cache declares {got['cache_format']!r} (held to that format's "
                    f"{got['format_bytes_per_token']:,} B/token above); an expanded cache is no latent codec layout")
    c = get_codec(codec)
    formula = c.bytes_per_token(config, dt)
    per_token, model = got["bytes_per_token"], formula["total"] * config.num_hidden_layers
    elem = torch.empty(0, dtype=dt).element_size()
    where = f"{backend.name} kv_codec {codec} {preset} {dtype}"
    figures.update(payload=formula["payload"], metadata=formula["metadata"], global_bytes=c.global_nbytes(config),
                   model_bytes_per_token=model, kpe=c.kpe, ratio_vs_latent=config.latent_dim * elem / per_token,
                   ratio_vs_expanded=config.expanded_dim * elem / per_token)
    if preset == "deepseek-v2-lite":
        if dtype == "bfloat16":
            assert (formula["payload"], formula["metadata"]) == V2_LITE_BF16[codec], where
            if codec == "none":
                assert per_token == 1152
            if codec == "fp8-e4m3-flashmla":
                assert per_token == 656
        for scheme, info in QUANT_STUDY_SCHEMES.items():
            if "bytes_per_token_layer" in info and codec in (info["codec"], info["alt_codec"]):
                seed_model = info["bytes_per_token_layer"] * 27
                figures["quant_study"] = {"scheme": scheme, "reported": info["reported"],
                                          "seed_model_bytes_per_token": seed_model,
                                          "seed_ratio_vs_expanded": 276_480 / seed_model,
                                          "honest_model_bytes_per_token": model,
                                          "honest_ratio_vs_expanded": 276_480 / model,
                                          "difference_bytes": model - seed_model}


# --------------------------------------------------------------------------- layouts in detail


def flashmla_fp8_bytes(c: torch.Tensor, k_pe: torch.Tensor) -> bytes:
    """One token in FlashMLA's V3.2 FP8 layout, written from FlashMLA tests/quant.py's description."""
    out = bytearray()
    scales = []
    for t in range(4):
        tile = c[t * 128:(t + 1) * 128].to(torch.float32)
        amax = float(tile.abs().max())
        scale = 2.0 ** math.ceil(math.log2(max(amax / FP8_E4M3_MAX, 1e-4)))
        scales.append(scale)
        out += (tile / scale).to(torch.float8_e4m3fn).view(torch.uint8).numpy().tobytes()
    out += struct.pack("<4f", *scales)
    out += struct.pack("<64H", *[v & 0xFFFF for v in k_pe.view(torch.int16).tolist()])
    return bytes(out)


# --------------------------------------------------------------------------- errors


@functools.cache
def gaussian_latent_errors() -> dict[str, dict[str, dict[str, float]]]:
    """N(0, 1) latents at V2-Lite dims in BF16 through every codec's round trip."""
    gen = torch.Generator().manual_seed(0)
    c = torch.randn(2, 128, 512, generator=gen).to(torch.bfloat16)
    k_pe = torch.randn(2, 128, 64, generator=gen).to(torch.bfloat16)
    out = {}
    for name, codec in CODECS.items():
        c2, k2 = codec.roundtrip(c, k_pe, torch.bfloat16)
        out[name] = {"c": codec_error(c2, c), "k_pe": codec_error(k2, k_pe)}
    return out


@functools.cache
def _attention_run(backend, codec: str, device: str) -> torch.Tensor:
    __tracebackhide__ = True
    w = weights_for("deepseek-v2-lite", torch.bfloat16, device)
    return run_scenario(backend, w, attention_inputs(), ATTENTION_SCENARIO, device=device, kv_codec=codec)[0]


def attention_error(backend, codec: str, device: str) -> dict[str, float]:
    """V2-Lite random weights in BF16, varlen batch: the codec's output vs the same backend's kv_codec none
    output, so only the cache's rounding differs (test_attention_error anchors that baseline to float64)."""
    __tracebackhide__ = True
    base, o = _attention_run(backend, "none", device), _attention_run(backend, codec, device)
    valid = torch.arange(base.shape[1])[None, :] < scenario_lengths(ATTENTION_SCENARIO)[:, None]
    return codec_error(o[valid], base[valid])


@functools.cache
def reference_attention_errors(device: str) -> dict[str, dict[str, float]]:
    """_attention_error of reference-absorbed for every codec it supports at V2-Lite BF16."""
    backend = get_backend("reference-absorbed")
    config = MLAConfig.preset("deepseek-v2-lite")
    return {name: attention_error(backend, name, device) for name in CODECS
            if not backend.unsupported_reason(config, dtype=torch.bfloat16, device=device, kv_codec=name)}


def check_bound(name: str, what: str, err: dict[str, float], bound: float, where: str):
    __tracebackhide__ = True
    if not err["rel_fro"] <= bound:
        raise AssertionError(failure(f"kv_codec {name} {where}: {what} relative error {over(err['rel_fro'], bound)}",
                                     f"max_abs {err['max_abs']:.3e}",
                                     bound_line(f'ERROR_BOUNDS["{name}"]', doc="docs/codecs.md")))


def check_attention_error(backend, codec: str, device, figures: dict) -> None:
    """The attention output with the codec (V2-Lite, BF16, varlen 13/6 + 1 decode).

    The backend's unquantized output is first held to the float64 reference (BF16 tolerance); the codec's
    output is then compared with that anchored baseline, so the figure is the cache's rounding alone."""
    __tracebackhide__ = True
    w = weights_for("deepseek-v2-lite", torch.bfloat16, device)
    require_support(backend, w.config, dtype=torch.bfloat16, device=device, kv_codec=codec)
    require_support(backend, w.config, dtype=torch.bfloat16, device=device, kv_codec="none")
    valid = torch.arange(attention_inputs().shape[1])[None, :] < scenario_lengths(ATTENTION_SCENARIO)[:, None]
    base = _attention_run(backend, "none", device)
    oracle = attention_oracle()
    anchor = error_metrics(base[valid], oracle[valid])
    tol = TOLERANCES["bfloat16"]
    figures.update(baseline_vs_float64=anchor["rel_fro"], **tolerance_figures(tol))
    assert anchor["rel_fro"] <= tol.rel_fro and anchor["max_rel"] <= tol.max_rel, (
        f"{backend.name} V2-Lite BF16 kv_codec none: the unquantized output differs from the float64 reference: "
        f"rel_fro {anchor['rel_fro']:.3e} (tolerance {tol.rel_fro:g}), max_abs/rms {anchor['max_rel']:.3e} "
        f"(tolerance {tol.max_rel:g})")
    if codec == "none":
        return
    e = codec_error(_attention_run(backend, codec, device)[valid], base[valid])
    bound = ERROR_BOUNDS[codec].attention
    figures.update(attention=e, bound=bound, reason=ERROR_BOUNDS[codec].reason)
    check_bound(codec, "attention output", e, bound, f"{backend.name} V2-Lite BF16 varlen 13/6 + 1 decode")
    if codec.startswith("int2"):  # the negative control must be caught by any INT8 bound, with room
        worst_int8 = max(ERROR_BOUNDS[n].attention for n in INT8)
        assert e["rel_fro"] > 5 * worst_int8, f"INT2 error {e['rel_fro']:.3e} is not far outside INT8's {worst_int8:g}"
        assert gaussian_latent_errors()[codec]["c"]["rel_fro"] > 5 * max(ERROR_BOUNDS[n].latent for n in INT8)


@functools.cache
def attention_inputs() -> torch.Tensor:
    """The V2-Lite layer inputs of ATTENTION_SCENARIO (float64)."""
    return inputs_for(MLAConfig.preset("deepseek-v2-lite"), ATTENTION_SCENARIO)


@functools.cache
def attention_oracle() -> torch.Tensor:
    """The float64 reference of attention_inputs() as a BF16 backend gets them."""
    w64 = weights_for("deepseek-v2-lite", torch.float64)
    return reference_attention_f64(w64, attention_inputs().to(torch.bfloat16).to(torch.float64),
                                   scenario_lengths(ATTENTION_SCENARIO))


# --------------------------------------------------------------------------- the tiny trained model


@functools.cache
def trained():
    """Layer inputs and latents of the tiny trained model on its pinned prompts (float32)."""
    model = load_model(MODEL_DIR)
    config = MLAConfig.from_hf(model.config.to_dict())
    seqs = []
    if PROMPTS.is_file():
        data = json.loads(PROMPTS.read_text(encoding="utf-8"))
        sets = [[ep["token_ids"] for ep in eps if ep.get("token_ids")] for eps in data.get("sets", {}).values()]
        seqs = [s for eps in sets for s in eps[:2]][:3]  # short ones and a long one (past position 64)
    if not seqs:
        gen = torch.Generator().manual_seed(0)
        seqs = [torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist() for n in (40, 64, 23, 90)]
    lengths = torch.tensor([len(s) for s in seqs])
    ids = torch.zeros(len(seqs), int(lengths.max()), dtype=torch.int64)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = torch.tensor(s)
    valid = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
    with torch.no_grad():
        hidden = model(input_ids=ids, attention_mask=valid.long(), output_hidden_states=True).hidden_states
        layers = []
        for i, (layer, w) in enumerate(zip(model.model.layers, layer_weights(model, config))):
            x = layer.input_layernorm(hidden[i])
            positions = torch.arange(ids.shape[1]).expand(len(seqs), -1)
            _, _, c, k_pe = reference.project(w, x, positions)
            layers.append({"weights": w, "x": x, "c": c[valid], "k_pe": k_pe[valid],
                           "none": attend_once(w, x, lengths, "none")})
    return {"config": config, "lengths": lengths, "valid": valid, "layers": layers}


def trained_or_skip():
    if not (MODEL_DIR / "config.json").is_file():
        pytest.skip(f"the tiny trained model is not there ({MODEL_DIR}; train it with fixtures/train_tiny.py)")
    return trained()


def attend_once(weights, x: torch.Tensor, lengths: torch.Tensor, codec: str) -> torch.Tensor:
    """One varlen prefill of layer inputs x [B, S, hidden] through reference-absorbed with this codec."""
    backend = get_backend("reference-absorbed")
    B, S, _ = x.shape
    cache = backend.new_cache(weights.config, batch_size=B, capacity=S, dtype=x.dtype, device="cpu", kv_codec=codec)
    with torch.no_grad():
        return backend.attend(weights, x, torch.arange(S).expand(B, -1), cache, lengths)


@functools.cache
def trained_errors(codec: str) -> dict[str, dict[str, float]]:
    t = trained()
    out = {}
    for i, layer in enumerate(t["layers"]):
        c2, k2 = get_codec(codec).roundtrip(layer["c"], layer["k_pe"], torch.float32)
        out[f"layer{i}_latent"] = codec_error(c2, layer["c"])
        out[f"layer{i}_k_pe"] = codec_error(k2, layer["k_pe"])
        o = attend_once(layer["weights"], layer["x"], t["lengths"], codec)
        out[f"layer{i}_attention"] = codec_error(o[t["valid"]], layer["none"][t["valid"]])
    return out


def rankings(errors: dict[str, float]) -> dict[str, object]:
    """Seed 001's claims, evaluated on one error table (codec -> relative error)."""
    return {
        "grouped_int8_beats_per_tensor": errors["int8-g16"] < errors["int8-tensor"]
                                          and errors["int8-g32"] < errors["int8-tensor"],
        "grouped_int8_beats_per_token": errors["int8-g16"] < errors["int8-token"],
        "per_tensor_over_grouped": errors["int8-tensor"] / errors["int8-g16"],
        "asym_int4_beats_sym_int4": errors["int4-asym-g16"] < errors["int4-sym-g16"]
                                     and errors["int4-asym-g32"] < errors["int4-sym-g32"],
        "asym_over_sym_g16": errors["int4-asym-g16"] / errors["int4-sym-g16"],
        "int2_collapses": errors["int2-asym-g32"] > 0.2,
    }

