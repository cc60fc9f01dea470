"""What the plugin prints: the header (version, backends and ops, device, torch / transformers / python) and,
once at the end, the skips grouped by reason with their counts, what was deselected and how to run it, and
the RoPE convention each backend matched.

The skips are printed here once: pytest's own ``-rs`` / ``-ra`` lines list every skip again, so when the run
asks for them this block leaves the skips out (the project's ``addopts`` ask for ``-rfE``: failures and
errors only).
"""

from __future__ import annotations

import os
import platform

from mla_conformance.pytest_plugin import selection
from mla_conformance import __version__
from mla_conformance.arch.device import installed_version

#: how to run the decode benchmarks the default run deselects
BENCHMARK_HINT = "pytest -m benchmark --benchmark-only -n 0"
#: skip reasons shown; the rest are counted on one line
SKIP_LINES = 12
#: a reason longer than this is cut (with an ellipsis): the block is one line per reason
REASON_CHARS = 200


def header_lines(config) -> list[str]:
    kind = selection.deselected_kind(config)
    parts = []
    if kind != "layer":
        parts.append(f"backends {', '.join(b.name for b in selection.backends(config))}")
    if kind != "op":
        parts.append(f"ops {', '.join(o.name for o in selection.ops(config))}")
    lines = [f"mla-conformance {__version__}: {'; '.join(parts)}"]
    dev = selection.device_of(config)
    if dev.startswith("cuda"):
        import torch  # the device was resolved through torch already

        idx = torch.device(dev).index or 0
        cap = torch.cuda.get_device_capability(idx)
        lines.append(f"device {dev}: {torch.cuda.get_device_name(idx)}, SM{cap[0]}{cap[1]} "
                     f"(capability {cap[0]}.{cap[1]}), CUDA {torch.version.cuda}")
    else:
        lines.append(f"device cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    lines.append(f"torch {installed_version('torch') or 'not installed'}, transformers "
                 f"{installed_version('transformers') or 'not installed'}, "
                 f"python {platform.python_version()}")
    ckpt = config.getoption("--mla-checkpoint")
    if ckpt:
        lines.append(f"checkpoint {ckpt}")
    return lines


def skip_reasons(stats: dict) -> dict[str, int]:
    """reason -> count of the skipped reports (xfails are not skips), each reason its first line, cut at
    :data:`REASON_CHARS`."""
    counts: dict[str, int] = {}
    for rep in stats.get("skipped", []):
        if hasattr(rep, "wasxfail"):
            continue
        longrepr = rep.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
        reason = (reason.removeprefix("Skipped: ").strip().splitlines() or ["(no reason)"])[0]
        reason = reason if len(reason) <= REASON_CHARS else reason[:REASON_CHARS - 1] + "…"
        counts[reason] = counts.get(reason, 0) + 1
    return counts


def summary(tr, config) -> None:
    """The plugin's block at the end of a run of the suite (nothing for another project's run)."""
    state = selection.engaged(config)
    if not (state.get("header") or state.get("items") or selection.options_given(config)):
        return
    listed_by_pytest = "s" in getattr(tr, "reportchars", "")  # -rs / -ra: pytest lists every skip itself
    counts = {} if listed_by_pytest else skip_reasons(tr.stats)
    deselected = state.get("benchmarks_deselected", 0)
    kind_deselected = state.get("kind_deselected")
    kind = selection.deselected_kind(config)
    if kind_deselected is None and kind and config.pluginmanager.hasplugin("dsession"):
        kind_deselected = (kind, None)  # xdist: the workers deselected, uncounted here
    conventions = rope_conventions(tr)
    if not counts and not deselected and not kind_deselected and not conventions:
        return
    tr.write_sep("=", "mla-conformance skips by reason" if counts else "mla-conformance")
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    width = len(str(ranked[0][1])) if ranked else 1
    for reason, n in ranked[:SKIP_LINES]:
        tr.write_line(f"{n:>{width}} {reason}")
    if len(ranked) > SKIP_LINES:
        rest = ranked[SKIP_LINES:]
        tr.write_line(f"… {len(rest)} more reasons ({sum(n for _, n in rest)} skips); -rs lists every skip "
                      "instead of this block")
    if deselected:
        tr.write_line(f"{deselected} decode benchmarks deselected: run them with `{BENCHMARK_HINT}`")
    if kind_deselected:
        kind, n = kind_deselected
        n = "" if n is None else f"{n} "
        if kind == "op":
            tr.write_line(f"{n}op tests deselected: --mla-backend was given without --mla-op (a verdict on "
                          "backends); add --mla-op SPEC (e.g. --mla-op reference-op) to run them too")
        else:
            tr.write_line(f"{n}layer tests deselected: --mla-op was given without --mla-backend (a verdict on "
                          "ops); add --mla-backend SPEC to run them too")
    if conventions:
        tr.write_line("RoPE convention (YaRN cos/sin factor, test_conventions.py): "
                      + "; ".join(f"{b} {c}" for b, c in sorted(conventions.items())))


def rope_conventions(tr) -> dict[str, str]:
    """Per backend, the ``rope_convention`` its conventions test recorded in its figures (the test id's
    parameter is the backend's name); from the reports, so xdist workers' count too."""
    out: dict[str, str] = {}
    for key in ("passed", "failed"):
        for rep in tr.stats.get(key, []):
            if getattr(rep, "when", None) != "call":
                continue
            for name, value in getattr(rep, "user_properties", ()) or ():
                if name == "mla_figures" and isinstance(value, dict) and value.get("rope_convention"):
                    backend = rep.nodeid.rsplit("[", 1)[-1].rstrip("]") if "[" in rep.nodeid else rep.nodeid
                    out[backend] = str(value["rope_convention"])
    return out
