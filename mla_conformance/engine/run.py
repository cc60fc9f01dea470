"""Each engine configuration in a subprocess of its own (:mod:`mla_conformance.engine.worker`), under a timeout: an
engine that aborts, segfaults or hangs becomes a verdict sentence naming the configuration, the phase it died in
and its last error line, and the other configurations' results are kept."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from mla_conformance.engine.contract import Completion, EngineSpec

#: bound on one engine configuration (load + generation): generous, because a GPU build compiles its graphs before
#: the first token; a configuration past it is a hang, reported as such
ENGINE_TIMEOUT_S = 900.0
#: the environment each configuration starts in, unless the caller's environment sets it: one process (the worker
#: is the isolation), one OpenMP thread on a CPU (the engine's figures do not depend on the host's core count)
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}
_ERROR_LINE = re.compile(r"(\b[A-Za-z_.]*(Error|Exception)\b:|Assertion .* failed|\bassert\b|Aborted|"
                         r"Segmentation fault|Fatal|terminate called)")


@dataclasses.dataclass
class EngineRun:
    """One configuration's outcome: ``unsupported`` (the adapter's sentence: not installed, ...), or ``error`` (the
    engine died, raised or timed out: the verdict sentence), or the passes' completions and the cache it allocated."""

    spec: str
    phase: str
    wall_s: float
    unsupported: str | None = None
    error: str | None = None
    declined: list[str] = dataclasses.field(default_factory=list)
    effective: dict[str, Any] = dataclasses.field(default_factory=dict)
    passes: list[list[Completion]] = dataclasses.field(default_factory=list)
    kv_cache: dict[str, Any] | None = None
    load_s: float | None = None
    peak_rss_bytes: int | None = None
    versions: dict[str, str] = dataclasses.field(default_factory=dict)
    stderr_tail: str = ""
    exit_status: int | None = None
    error_line: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.unsupported is None


def error_line(stderr: str) -> str:
    """The engine's own last error line in ``stderr`` (a Python exception, a C++ assertion, a signal's words), else
    its last line."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for line in reversed(lines):
        if _ERROR_LINE.search(line) and not line.startswith(("File ", "raise ", "^")):
            return re.sub(r"^\[rank\d+\]:\s*", "", line)[:300]
    return lines[-1][:300] if lines else "(nothing on stderr)"


def run_engine(spec: EngineSpec, model_dir, prompts: list[list[int]], max_new_tokens: list[int], *, top_k: int = 5,
               passes: int = 1, timeout_s: float = ENGINE_TIMEOUT_S, env: dict[str, str] | None = None,
               varied: str | None = None, require: tuple[str, ...] = ()) -> EngineRun:
    """Run ``spec`` on ``model_dir`` in a fresh Python process; ``varied`` names the option this configuration
    changes (e.g. "kv_cache_dtype=fp8"), for the verdict sentence; ``require``: options that, if the engine turns
    them off, leave nothing to generate (``declined`` lists them)."""
    with tempfile.TemporaryDirectory(prefix="mla-engine-") as tmp:
        req, res, err = Path(tmp) / "request.json", Path(tmp) / "result.json", Path(tmp) / "stderr.txt"
        req.write_text(json.dumps({"spec": spec.text(), "model_dir": str(model_dir), "prompts": prompts,
                                   "max_new_tokens": max_new_tokens, "top_k": top_k, "passes": passes,
                                   "require": list(require)}),
                       encoding="utf-8")
        child_env = {**ENGINE_ENV, **os.environ, **(env or {})}
        child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), child_env.get("PYTHONPATH")]))
        start = time.perf_counter()
        with open(err, "w", encoding="utf-8") as stderr:
            proc = subprocess.Popen([sys.executable, "-m", "mla_conformance.engine.worker", str(req), str(res)],
                                    stdout=subprocess.DEVNULL, stderr=stderr, env=child_env,
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                rc, timed_out = proc.wait(), True
        wall = time.perf_counter() - start
        stderr_text = err.read_text(encoding="utf-8", errors="replace")
        result = json.loads(res.read_text(encoding="utf-8")) if res.is_file() else {"phase": "starting"}
    run = EngineRun(spec.text(), result.get("phase", "starting"), wall, unsupported=result.get("unsupported"),
                    kv_cache=result.get("kv_cache"), load_s=result.get("load_s"),
                    peak_rss_bytes=result.get("peak_rss_bytes"), versions=result.get("versions") or {},
                    stderr_tail="\n".join(stderr_text.splitlines()[-40:]), declined=result.get("declined") or [],
                    effective=result.get("effective") or {})
    run.passes = [[_completion(c) for c in p["completions"]] for p in result.get("passes", [])]
    run.exit_status = None if timed_out else rc
    if timed_out:
        run.error = _died(spec, varied, run.phase, f"no result after {timeout_s:g} s (killed)")
    elif rc != 0 or run.phase != "done":
        how = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit status {rc}"
        run.error_line = error_line(stderr_text)
        run.error = _died(spec, varied, run.phase, f"{how}: {error_line(stderr_text)}")
    return run


def _died(spec: EngineSpec, varied: str | None, phase: str, what: str) -> str:
    where = {"loading": "while loading the model", "generating": "while generating, before returning any output",
             "checking": "before loading", "starting": "before it started"}.get(phase, f"in phase {phase}")
    text = spec.text()
    if varied and varied in text:  # name the option this configuration adds apart from the rest
        base = ",".join(p for p in text.partition(":")[2].split(",") if p != varied)
        text = f"{spec.engine}:{base}" if base else spec.engine
    return f"engine {text}{f' with {varied}' if varied else ''} died {where}: {what}"


def _completion(c: dict) -> Completion:
    return Completion(c["tokens"], c["logprobs"], [{int(t): v for t, v in top.items()} for top in c["top"]],
                      c.get("cached_tokens"))
