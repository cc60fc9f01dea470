"""The layer contract across real ranks (mla_conformance.contract.distributed): W processes started by torch's own
launcher (``torch.multiprocessing.start_processes``, spawn), one torch.distributed process group over them (gloo on
CPU), every case of a launch run in the same processes (one spawn shared by the cases). Each rank gets its shard of
the weights by :data:`~mla_conformance.contract.distributed.TP_PLAN`, the same hidden states, a cache poisoned with
NaN right after ``new_cache``; it returns its outputs and what its cache holds. The parent holds every rank's output
to the single-process float64 reference (:func:`assert_rank_outputs`) and every rank's cache to the tokens it must
hold (:func:`assert_rank_cache`).

A rank that raises, exits or hangs is a verdict naming the rank (:class:`RankFailure`): what it raised and where,
its exit code or signal, or -- a rank that makes no progress for :data:`STALL_S` seconds -- where each live rank's
stack was (faulthandler, on SIGUSR1) and which of them were waiting in a collective; the other ranks' results of the
cases they finished are kept, and every process is ended before the verdict.
"""

from __future__ import annotations

import dataclasses
import datetime
import faulthandler
import math
import os
import pickle
import shutil
import signal
import tempfile
import time
import traceback
from pathlib import Path

import torch

from mla_conformance.checks.metrics import row_metrics
from mla_conformance.checks.tolerances import TOLERANCES
from mla_conformance.contract.dcp import owned_count
from mla_conformance.contract.distributed import TP_PLAN, Parallel, declared_plans
from mla_conformance.model.config import MLAConfig
from mla_conformance.model.reference import reference_attention_f64
from mla_conformance.model.weights import MLAWeights
from mla_conformance.specs import get_backend

#: a rank that writes no progress for this long is hung (each attend call and case writes some); the environment's
#: MLA_DIST_STALL_S overrides it, read at each launch (tests/meta/test_distributed_meta.py shortens it to 5 s)
STALL_S = 20.0
#: the longest a launch waits for its processes to start and join the group (importing torch on a loaded 2-core
#: machine: seconds per process)
START_S = 45.0
#: after a rank raised or exited, how long the others get to finish (they usually wait in a collective on it)
GRACE_S = 2.0


@dataclasses.dataclass(frozen=True)
class DistCase:
    """One distributed case: a plan, the DCP interleave, a batch prefilled in one call then decoded token by token,
    on the ``tiny`` preset with ``heads`` query heads (8: every W of the suite splits them)."""

    plan: str
    interleave: int = 1
    prefill: tuple[int, ...] = (7, 3)
    decode_steps: int = 2
    heads: int = 8
    seed: int = 0

    @property
    def name(self) -> str:
        return f"{self.plan}-S{self.interleave}"

    def lengths(self) -> tuple[int, ...]:
        return tuple(p + self.decode_steps for p in self.prefill)


def cases_for(plans) -> list[DistCase]:
    """The cases of the declared plans: TP at S 1; DCP and TP x DCP at S 1 and 2 (an interleave above one token)."""
    out = []
    for plan in plans:
        out += [DistCase(plan, s) for s in ((1,) if plan == "tp" else (1, 2))]
    return out


# --------------------------------------------------------------------------- inputs (the same in every rank)


def config_of(case: DistCase):

    return dataclasses.replace(MLAConfig.preset("tiny"), num_attention_heads=case.heads)


def full_weights(case: DistCase):

    return MLAWeights.random(config_of(case), seed=case.seed, dtype=torch.float64)


def hidden_states(case: DistCase) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + case.seed)
    return torch.randn(len(case.prefill), max(case.lengths()), config_of(case).hidden_size, generator=g,
                       dtype=torch.float64)


def shard_weights(weights, par: Parallel, plan: dict | None = None):
    """This rank's shard by ``plan`` (the backend's ``tp_plan``, else TP_PLAN: heads split over tp_size, the rest
    replicated), as MLAWeights of H / tp heads."""

    plan = TP_PLAN if plan is None else {**TP_PLAN, **plan}
    cfg = weights.config
    tp, r = par.tp_size, par.tp_rank
    if tp == 1:
        return weights.clone()
    local = dataclasses.replace(cfg, num_attention_heads=cfg.num_attention_heads // tp)
    out = {}
    for name, t in weights.items():
        how = plan.get(name, "replicate")
        if how == "heads-rows":
            out[name] = t.unflatten(0, (tp, -1))[r].clone()
        elif how == "heads-cols":
            out[name] = t.unflatten(1, (tp, -1))[:, r].clone()
        else:
            out[name] = t.clone()
    return MLAWeights(local, out, source=f"rank {par.rank} of {par.world_size} ({par.plan})")


# --------------------------------------------------------------------------- one rank


def _progress(tmp: Path, rank: int, what: str) -> None:
    (tmp / f"rank{rank}.progress").write_text(what)


def _rank_main(rank: int, world_size: int, jobs: list, tmp: str) -> None:
    """One rank: join the gloo group, run every (spec, case) job, write each result as it is done."""
    tmp = Path(tmp)
    stack = open(tmp / f"rank{rank}.stack", "w")
    faulthandler.register(signal.SIGUSR1, file=stack, all_threads=True)
    _progress(tmp, rank, "starting")
    torch.set_num_threads(1)
    import torch.distributed as dist


    try:
        dist.init_process_group("gloo", init_method=f"file://{tmp / 'rendezvous'}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=300))
        for spec, case in jobs:
            _progress(tmp, rank, f"{case.name}: starting")
            backend = get_backend(spec)
            result = _run_case(backend, case, rank, world_size, dist.group.WORLD, tmp)
            with open(tmp / f"{_key(spec, case)}.rank{rank}.pkl", "wb") as f:
                pickle.dump(result, f)
        _progress(tmp, rank, "done")
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - the verdict of this rank, for the parent
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/torch/" not in f.filename]
        at = f" (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
        text = (str(exc).splitlines() or [""])[0][:300]
        where = (tmp / f"rank{rank}.progress").read_text()
        (tmp / f"rank{rank}.raised").write_text(f"raised {type(exc).__name__}: {text}{at}, during {where}")
        stack.flush()
        os._exit(1)


def _key(spec: str, case: DistCase) -> str:
    import hashlib

    return f"{hashlib.sha1(spec.encode()).hexdigest()[:10]}-{case.name}"


def _run_case(backend, case: DistCase, rank: int, world_size: int, group, tmp: Path) -> dict:
    par = Parallel.of(case.plan, world_size, rank, group=group, interleave=case.interleave)
    if case.plan not in declared_plans(backend):
        return {"skip": f"{backend.name} does not declare distributed plan {case.plan!r}"}
    backend.distribute(par)
    full = full_weights(case).to(torch.float32)
    reason = backend.unsupported_reason(full.config, dtype=torch.float32, device="cpu", kv_codec="none")
    if reason:  # before sharding: a plan the backend declines may not divide the weights at all (heads over W)
        return {"skip": f"{backend.name}: {reason}"}
    weights = shard_weights(full, par, getattr(backend, "tp_plan", None))
    x = hidden_states(case).to(torch.float32)
    B, T = x.shape[:2]
    cache = backend.new_cache(weights.config, batch_size=B, capacity=T, dtype=torch.float32, device="cpu")
    tensors = dict(cache.tensors())
    for t in tensors.values():
        if t.is_floating_point():
            t.fill_(math.nan)                                             # unwritten slots: NaN
    out = torch.zeros(B, T, x.shape[-1], dtype=torch.float64)
    done = torch.zeros(B, dtype=torch.int64)
    calls = [tuple(case.prefill)] + [(1,) * B] * case.decode_steps
    for k, new in enumerate(calls):
        _progress(tmp, rank, f"{case.name}: attend call {k + 1} of {len(calls)}")
        lengths = torch.tensor(new, dtype=torch.int64)
        S = int(lengths.max())
        idx = (done[:, None] + torch.arange(S)[None, :]).clamp(max=T - 1)
        h = torch.gather(x, 1, idx[..., None].expand(-1, -1, x.shape[-1]))
        o = backend.attend(weights, h, done[:, None] + torch.arange(S)[None, :], cache, lengths)
        if tuple(o.shape) != (B, S, x.shape[-1]):
            raise ValueError(f"attend returned {tuple(o.shape)}, expected {(B, S, x.shape[-1])}")
        for b in range(B):
            out[b, int(done[b]):int(done[b]) + int(lengths[b])] = o[b, :int(lengths[b])].double()
        done += lengths
    written = sum(int((~torch.isnan(t)).sum()) * t.element_size() for t in tensors.values() if t.is_floating_point())
    token = weights.config.latent_dim * torch.empty(0, dtype=torch.float32).element_size()  # the cache's dtype
    return {"out": out, "written_bytes": written, "token_bytes": token}


# --------------------------------------------------------------------------- the launch (parent)


@dataclasses.dataclass
class Launch:
    """What a launch left: per (spec, case name) the ranks' results; per rank its failure (a sentence), if any."""

    world_size: int
    results: dict
    failures: dict

    def culprits(self) -> list[int]:
        """The failed ranks that failed first-hand (not a peer's failure seen from a collective)."""
        return [r for r, text in sorted(self.failures.items()) if not _peer_failure(text)] or sorted(self.failures)

    def failure_lines(self) -> list[str]:
        """One line per failed rank, the first-hand failures first."""
        first = self.culprits()
        return [f"rank {r} {_short(self.failures[r])}" for r in first] + [
            f"rank {r} {_short(self.failures[r])}" for r in sorted(self.failures) if r not in first]


def _peer_failure(text: str) -> bool:
    """A rank's failure that is its peer's, seen from a collective (gloo's lost connection, or waiting)."""
    return text.startswith("waiting in a collective") or text.startswith("killed after") or (
        "gloo" in text and ("by peer" in text or "Timed out" in text or "Connection" in text))


def _short(text: str) -> str:
    if "gloo" in text and "by peer" in text:
        during = text[text.rfind(", during "):] if ", during " in text else ""
        return f"lost its peer in a collective (gloo: connection closed by peer){during}"
    return text


def launch(jobs: list, world_size: int) -> Launch:
    """Run ``jobs`` ((backend spec, DistCase) pairs) in ``world_size`` spawned ranks; every process is ended before
    this returns."""
    import torch.multiprocessing as mp

    start_s, stall_s = START_S, float(os.environ.get("MLA_DIST_STALL_S", STALL_S))
    t0 = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="mla-dist-"))
    ctx = mp.start_processes(_rank_main, args=(world_size, jobs, str(tmp)), nprocs=world_size, join=False,
                             start_method="spawn")
    procs = ctx.processes
    failures: dict[int, str] = {}
    first_failure = None
    try:
        while any(p.is_alive() for p in procs):
            now = time.monotonic()
            for r, p in enumerate(procs):
                if p.exitcode not in (None, 0) and r not in failures:
                    failures[r] = _exit_verdict(tmp, r, p.exitcode)
                    first_failure = first_failure or now
            if first_failure is not None and now - first_failure > GRACE_S:
                for r, p in enumerate(procs):
                    if p.is_alive():
                        failures[r] = "killed after the failure above: " + _stack_verdict(tmp, r, p)
                break
            marks = [f.stat().st_mtime for f in tmp.glob("rank*.progress")]
            started = len(marks) == world_size
            last = max(marks) if marks else None
            if (not started and now - t0 > start_s) or (started and time.time() - last > stall_s):
                stacks = {r: _stack_verdict(tmp, r, p) for r, p in enumerate(procs) if p.is_alive()}
                waiting = {r for r, s in stacks.items() if "torch.distributed" in s}
                for r, s in stacks.items():
                    kind = "waiting in a collective" if r in waiting and len(waiting) < len(stacks) else "hung"
                    failures[r] = (f"{kind}: no progress for {stall_s:.0f} s" if started else
                                   f"hung: not started within {start_s:.0f} s") + f" ({s})"
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)
    for r, p in enumerate(procs):
        if r not in failures and p.exitcode not in (0, None):
            failures[r] = _exit_verdict(tmp, r, p.exitcode)
    results: dict = {}
    for f in tmp.glob("*.pkl"):
        key, rank = f.stem.rsplit(".rank", 1)
        with open(f, "rb") as fh:
            results.setdefault(key, {})[int(rank)] = pickle.load(fh)
    shutil.rmtree(tmp, ignore_errors=True)
    return Launch(world_size, results, failures)


def _exit_verdict(tmp: Path, rank: int, code: int) -> str:
    raised = tmp / f"rank{rank}.raised"
    if raised.is_file():
        return raised.read_text()
    where = (tmp / f"rank{rank}.progress")
    during = f", during {where.read_text()}" if where.is_file() else ""
    if code < 0:
        return f"crashed: killed by signal {signal.Signals(-code).name}{during}"
    return f"crashed: exited with code {code}{during}"


def _stack_verdict(tmp: Path, rank: int, proc) -> str:
    """Where a live rank is: its progress and its stack's innermost frame outside torch (faulthandler, SIGUSR1)."""
    where = tmp / f"rank{rank}.progress"
    during = where.read_text() if where.is_file() else "before its first step"
    stack_file = tmp / f"rank{rank}.stack"
    try:
        os.kill(proc.pid, signal.SIGUSR1)
        for _ in range(40):
            time.sleep(0.05)
            if stack_file.stat().st_size:
                break
        time.sleep(0.1)
        text = stack_file.read_text()
    except OSError:
        text = ""
    frames = [line.strip() for line in text.splitlines() if line.strip().startswith("File ")]
    # faulthandler prints innermost first
    inner = next((f for f in frames if "/torch/" not in f and "multiprocessing" not in f), "")
    coll = "in torch.distributed, " if any("torch/distributed" in f for f in frames[:3]) else ""
    return f"during {during}; {coll}at {inner.removeprefix('File ')}" if inner else f"during {during}"


# --------------------------------------------------------------------------- the rules


def reference_output(case: DistCase) -> torch.Tensor:

    return reference_attention_f64(full_weights(case), hidden_states(case), torch.tensor(case.lengths()))


def rank_results(run: Launch, spec: str, case: DistCase) -> dict:
    """The ranks' results of a case; a rank without one fails naming why (its verdict)."""
    __tracebackhide__ = True
    got = run.results.get(_key(spec, case), {})
    missing = [r for r in range(run.world_size) if r not in got]
    if missing:
        lines = run.failure_lines() or ["no verdict recorded"]
        kept = f"; rank(s) {sorted(got)} finished this case" if got else ""
        raise AssertionError(f"{case.name} at W={run.world_size}: {lines[0]}; rank(s) {missing} returned no result"
                             f"{kept}" + "".join(f"\n  {line}" for line in lines[1:]))
    skips = {r: v["skip"] for r, v in got.items() if "skip" in v}
    if skips:
        import pytest

        pytest.skip(next(iter(skips.values())))
    return got


def assert_rank_outputs(run: Launch, spec: str, case: DistCase, *, name: str, figures: dict) -> None:
    """Every rank's output (after its own reduction) against the single-process float64 reference, within the
    float32 layer tolerance."""
    __tracebackhide__ = True
    got = rank_results(run, spec, case)
    ref = reference_output(case)
    tol = TOLERANCES["float32"]
    errs = {}
    for r in range(run.world_size):  # a NaN output gives NaN metrics, which no bound passes
        m = row_metrics(got[r]["out"], ref)
        errs[r] = (m["rel_fro"], m["max_rel"])
    figures.update(case=f"{case.name}, W={run.world_size}", backend=name, check="distributed output vs float64",
                   rank_rel_fro=[e[0] for e in errs.values()], rank_max_rel=[e[1] for e in errs.values()])
    for r, (fro, mx) in errs.items():
        if not (fro <= tol.rel_fro and mx <= tol.max_rel):
            other = [q for q, e in errs.items() if e[0] <= tol.rel_fro and e[1] <= tol.max_rel]
            raise AssertionError(
                f"{name} [{case.name}, W={run.world_size}] rank {r}'s output differs from the single-process float64 "
                f"reference: rel_fro {fro:.3e} (bound {tol.rel_fro:.0e}), max_rel {mx:.3e} (bound {tol.max_rel:.0e})"
                f"; rank(s) {other} within the bounds")


def expected_tokens(case: DistCase, world_size: int, rank: int) -> int:
    """The tokens rank ``rank`` must hold: every token under TP alone, its owned ones under DCP."""
    if "dcp" not in case.plan:
        return sum(case.lengths())
    return sum(owned_count(L, world_size, rank, case.interleave) for L in case.lengths())


def assert_rank_cache(run: Launch, spec: str, case: DistCase, *, name: str, figures: dict) -> dict:
    """Every rank's cache holds exactly the tokens it must (measured: the elements of its floating tensors that are no
    longer the NaN poison); figures: per-rank bytes and the redundancy (stored tokens over all ranks / tokens)."""
    __tracebackhide__ = True
    got = rank_results(run, spec, case)
    total = sum(case.lengths())
    per = []
    for r in range(run.world_size):
        per.append(got[r]["written_bytes"])
    token_bytes = got[0]["token_bytes"]
    stored = [b / token_bytes for b in per]
    figures.update(case=f"{case.name}, W={run.world_size}", backend=name, check="distributed cache bytes per rank",
                   rank_cache_bytes=per, rank_tokens=stored, tokens=total,
                   cache_redundancy=sum(stored) / total)
    for r in range(run.world_size):
        want = expected_tokens(case, run.world_size, r)
        if stored[r] != want:
            rule = ("every token (TP: the latent cache is whole on each rank)" if "dcp" not in case.plan else
                    f"its owned tokens (token g on rank (g // {case.interleave}) % {run.world_size})")
            raise AssertionError(f"{name} [{case.name}, W={run.world_size}] rank {r}'s cache holds {per[r]} bytes = "
                                 f"{stored[r]:g} tokens of {token_bytes} B, expected {want} ({rule}; {total} tokens "
                                 f"in all)")
    return figures
