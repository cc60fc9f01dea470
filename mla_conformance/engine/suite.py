"""The engine suite's test bodies (suites/test_engine.py parametrises and calls these): each reads the session's
runs, records its figures under ``engine`` (a dict: the report's engine rows, mla_conformance.engine.report) and
holds one rule of :mod:`mla_conformance.engine.checks`."""

from __future__ import annotations

import json

import pytest

from mla_conformance.engine import checks
from mla_conformance.engine.contract import EngineSpec, parse_engine_spec
from mla_conformance.engine.run import EngineRun
from mla_conformance.engine.session import ENGINE_MODELS, EngineSession, model_dir, prompts_path
from mla_conformance.errors import BackendError, MLAInputError

NO_ENGINE = ("no engine under test: pass --mla-engine SPEC (e.g. vllm:attention_backend=CPU_MLA,dtype=float32; "
             "docs/engines.md)")
#: the project's FP8 latent codec the fp8 configuration is compared through
FP8_CODEC = "fp8-e4m3-flashmla"


class EngineDied(BackendError):
    """The engine aborted, raised or hung in a configuration: an error (not a failure) naming the configuration."""


def specs(config) -> list[EngineSpec | None]:
    given = config.getoption("--mla-engine", None) or []
    try:
        return [parse_engine_spec(s) for s in given] or [None]
    except MLAInputError as exc:
        raise pytest.UsageError(f"--mla-engine: {exc}") from None


def parametrize(metafunc) -> None:
    if "mla_engine" in metafunc.fixturenames:
        objs = specs(metafunc.config)
        metafunc.parametrize("mla_engine", objs, ids=[s.text() if s else "no-engine" for s in objs])


def new_session() -> EngineSession:
    return EngineSession()


def _config(model: str) -> dict:
    return json.loads((model_dir(model) / "config.json").read_text(encoding="utf-8"))


def _usable(run: EngineRun, spec: EngineSpec, model: str) -> EngineRun:
    if run.unsupported:
        pytest.skip(run.unsupported)
    if run.error:
        if not ENGINE_MODELS[model] and run.exit_status and run.exit_status > 0:  # raised, not killed: it declines
            pytest.skip(f"engine {spec.text()} does not take {model} ({_dims(model)}): it raised "
                        f"{'at load' if run.phase == 'loading' else 'at its first step'}: {run.error_line}")
        raise EngineDied(run.error)
    return run


def _dims(model: str) -> str:
    c = _config(model)
    return (f"kv_lora_rank {c['kv_lora_rank']}, qk_rope {c['qk_rope_head_dim']}, qk_nope {c['qk_nope_head_dim']}, "
            f"v {c['v_head_dim']}")


def _cold(session: EngineSession, spec: EngineSpec | None, model: str) -> EngineRun:
    if spec is None:
        pytest.skip(NO_ENGINE)
    if not (model_dir(model) / "config.json").is_file():
        pytest.skip(f"the pinned model {model} is not in fixtures/models of this checkout")
    if not prompts_path(model).is_file():
        pytest.skip(f"the pinned model {model}'s prompts ({prompts_path(model).name}) are not in fixtures/")
    return _usable(session.run(spec, model, "cold"), spec, model)


def _dtype(run: EngineRun, spec: EngineSpec) -> str:
    dtype = run.effective.get("dtype") or spec.options.dtype or "float32"
    return {"float": "float32", "half": "float16", "bf16": "bfloat16", "fp16": "float16"}.get(dtype, dtype)


def _record(figures, run: EngineRun, spec: EngineSpec, model: str, variant: str, **more) -> dict:
    row = {"spec": spec.text(), "model": model, "variant": variant, "engine": spec.engine,
           "attention_backend": run.effective.get("attention_backend"), "dtype": run.effective.get("dtype"),
           "wall_s": round(run.wall_s, 1), "load_s": round(run.load_s, 1) if run.load_s else None,
           "peak_rss_bytes": run.peak_rss_bytes, "effective": run.effective, "versions": run.versions, **more}
    if run.kv_cache:
        row["bytes_per_token_per_layer"] = run.kv_cache["bytes_per_token_per_layer"]
    figures["engine"] = row
    return row


def _comparisons(session, spec, model, run, refs=None, dtype=None):
    """Each prompt's greedy comparison of ``run``'s first pass with ``refs`` (the float64 reference by default), at
    ``dtype``'s bounds (the run's own dtype by default)."""
    p = session.prompts(model)
    refs = refs or session.reference(model)
    dtype, layers = dtype or _dtype(run, spec), int(_config(model)["num_hidden_layers"])
    return [checks.compare_greedy(pid, r, c, dtype=dtype, layers=layers)
            for pid, r, c in zip(p.ids, refs, run.passes[0])], dtype


def _summary(comps) -> dict:
    return {"tokens_matched": sum(c.matched for c in comps), "tokens_compared": sum(c.generated for c in comps),
            "prompts": len(comps),
            "ties": [{"prompt": c.prompt, "position": c.diverged_at, "margin": c.margin, "bound": c.tie_bound}
                     for c in comps if c.tie],
            "worst_logprob_delta": max(c.worst_delta for c in comps),
            "worst_logprob_ratio": max(c.worst_delta / c.worst_tolerance for c in comps)}


def check_greedy_tokens(session, spec, model, figures) -> None:
    run = _cold(session, spec, model)
    comps, dtype = _comparisons(session, spec, model, run)
    _record(figures, run, spec, model, "cold", **_summary(comps))
    checks.assert_greedy_tokens(comps, dtype=dtype)


def check_logprobs(session, spec, model, figures) -> None:
    run = _cold(session, spec, model)
    comps, dtype = _comparisons(session, spec, model, run)
    _record(figures, run, spec, model, "cold", **_summary(comps))
    checks.assert_logprobs(comps, dtype=dtype)


def _same_as_cold(session, spec, model, figures, variant: str, warm_of, what: str) -> None:
    cold = _cold(session, spec, model)
    run = cold if variant == "cold" else _usable(session.run(spec, model, variant), spec, model)
    if run.declined:
        pytest.skip(f"engine {run.spec} runs this model with {', '.join(run.declined)} turned off by the engine "
                    f"(as it runs: {_effective(run)}): nothing to compare")
    warm, reason = warm_of(run)
    if warm is None:
        pytest.skip(reason)
    p = session.prompts(model)
    worst = checks.assert_same_as_cold(p.ids, session.reference(model), cold.passes[0], warm, dtype=_dtype(cold, spec),
                                       layers=int(_config(model)["num_hidden_layers"]), what=what)
    _record(figures, run, spec, model, variant, worst_logprob_delta_vs_cold=worst)


def _effective(run: EngineRun) -> str:
    return ",".join(f"{k}={v}" for k, v in run.effective.items())


def check_prefix_cache(session, spec, model, figures) -> None:
    def warm_of(run):
        if not run.effective.get("prefix_caching"):
            return None, (f"engine {run.spec} runs {model} with prefix caching off (as it runs: {_effective(run)}): "
                          "no reuse to compare")
        second = run.passes[1]
        if not any(c.cached_tokens for c in second):
            return None, (f"engine {run.spec} served no prompt token of the second pass from its prefix cache "
                          f"(prompts of {min(len(t) for t in session.prompts(model).tokens)}+ tokens): no reuse")
        return second, None

    _same_as_cold(session, spec, model, figures, "cold", warm_of, "prefix-cache reuse")


def check_chunked_prefill(session, spec, model, figures) -> None:
    _same_as_cold(session, spec, model, figures, "chunked", lambda run: (run.passes[0], None), "chunked prefill")


def check_fp8(session, spec, model, figures) -> None:
    _cold(session, spec, model)
    run = session.run(spec, model, "fp8")
    if run.error:
        _record(figures, run, spec, model, "fp8", died=run.error)
    run = _usable(run, spec, model)
    refs = session.reference(model, FP8_CODEC)  # the codec through reference-absorbed in bfloat16 (reference.py)
    comps, _ = _comparisons(session, spec, model, run, refs, dtype="bfloat16")
    _record(figures, run, spec, model, "fp8", **_summary(comps))
    checks.assert_greedy_tokens(comps, dtype="bfloat16")


def check_kv_bytes(session, spec, model, figures) -> None:
    run = _cold(session, spec, model)
    if not run.kv_cache:
        pytest.skip(f"engine {spec.engine} does not expose its KV cache tensors")
    cfg = _config(model)
    latent = int(cfg["kv_lora_rank"]) + int(cfg["qk_rope_head_dim"])
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "uint8": 1}[run.kv_cache["tensors"][0]["dtype"]]
    expanded = session.run(spec, model, "expanded")
    more = {"latent_bytes": latent * itemsize}
    if expanded.ok and not expanded.declined and expanded.kv_cache:
        more["expanded_bytes_per_token_per_layer"] = expanded.kv_cache["bytes_per_token_per_layer"]
        more["expanded_over_latent"] = round(more["expanded_bytes_per_token_per_layer"] /
                                             run.kv_cache["bytes_per_token_per_layer"], 3)
    else:
        more["expanded"] = expanded.error or expanded.unsupported or f"declined: {', '.join(expanded.declined)}"
    _record(figures, run, spec, model, "cold", **more)
    checks.assert_latent_cache(run.kv_cache, latent_elements=latent, dtype_bytes=itemsize)
