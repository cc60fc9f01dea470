"""``mla-conformance matrix``: the kernel support matrix and a verdict per kernel, for this host or a stated device.

The text fits the terminal (:func:`shutil.get_terminal_size`, 100 columns when there is none): one block per
kernel, long sentences wrapped. ``--format md`` prints the full table (the one ``python tools/docs.py`` writes
into markers.md), ``--format json`` (or ``--json``) every field with its upstream sources.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import textwrap
from typing import Any

from mla_conformance.arch.capability import cap_str, parse_cuda_version, version_str
from mla_conformance.arch.gating import matrix_report
from mla_conformance.arch.matrix import MATRIX, NOT_RUN_ON_HARDWARE, KernelRow
from mla_conformance.cli.common import capability_arg

#: The width used when stdout is not a terminal and COLUMNS is unset.
FALLBACK_COLUMNS = 100
#: Narrower than this, the text is wrapped at this width anyway (a kernel id is 25 characters).
MIN_COLUMNS = 40
_LABEL = 10  # "  runs on " : the indent of a block's wrapped lines


def _cuda_arg(text: str) -> str:
    try:
        return parse_cuda_version(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_cli(sub: Any) -> None:
    """Register ``mla-conformance matrix``."""
    p = sub.add_parser(
        "matrix",
        help="print the kernel support matrix and a verdict per kernel for this device",
        description=(
            "Print the MLA kernel support matrix (architectures, minimum CUDA, KV cache, mode, head dims, page "
            "block) and, for this host or the capability given, whether each kernel can run and why not. The text "
            "fits the terminal; --format md prints the full table, --format json every field with its sources."
        ),
    )
    p.add_argument("--capability", type=capability_arg, metavar="X.Y",
                   help="judge a device of this compute capability (e.g. 9.0, 10.3, 12.0, sm_100) instead of this "
                        "host; only the architecture counts unless --cuda is given")
    p.add_argument("--name", metavar="NAME", help="device name to show with --capability")
    p.add_argument("--cuda", type=_cuda_arg, metavar="X.Y", help="with --capability: also judge this CUDA version")
    p.add_argument("--format", choices=("text", "md", "json"), default="text",
                   help="text (fits the terminal; default), md (the full table) or json (with the sources)")
    p.add_argument("--json", action="store_const", const="json", dest="format", help="same as --format json")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.capability is None and (args.cuda or args.name):
        print("mla-conformance matrix: error: --cuda and --name need --capability", file=sys.stderr)
        return 2
    report = matrix_report(args.capability, name=args.name, cuda_version=args.cuda)
    if args.format == "json":
        text = json.dumps(report, sort_keys=True, indent=2)
    elif args.format == "md":
        text = render_markdown(report)
    else:
        text = render_text(report, terminal_columns())
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:  # `matrix --json | head`: the reader left; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def terminal_columns() -> int:
    """The terminal's width (COLUMNS, else the terminal's, else :data:`FALLBACK_COLUMNS`)."""
    return shutil.get_terminal_size((FALLBACK_COLUMNS, 24)).columns


# --------------------------------------------------------------------------- words shared by both renderings


def device_label(report: dict[str, Any]) -> str:
    """``Device: SM90 (NVIDIA H100, compute capability 9.0), as given; judged on architecture``."""
    dev = report["device"]
    if dev["capability"] is not None:
        label = f"{dev['sm']} (" + (f"{dev['name']}, " if dev["name"] else "") + f"compute capability {dev['capability']})"
    else:
        label = dev["device_type"] + (f" ({dev['name']})" if dev["name"] else "")
    origin = "detected on this host" if dev["detected"] else "as given"
    return f"Device: {label}, {origin}; judged on {dev['judged_on']}"


def packages_line(report: dict[str, Any]) -> str | None:
    """``torch 2.13.0, CUDA none; flash_mla not installed, flashinfer not installed`` (a detected device only)."""
    dev = report["device"]
    if not dev["detected"]:
        return None
    pk = ", ".join(f"{m} {v['version'] or ''}".rstrip() if v["installed"] else f"{m} not installed"
                   for m, v in sorted(dev["packages"].items()))
    return f"torch {dev['torch_version']}, CUDA {dev['cuda_version'] or 'none'}; {pk}"


def runs_here(report: dict[str, Any]) -> str:
    """One sentence: which kernels do run on the device judged, by library (and when FlashInfer's auto picks FA2)."""
    dev = report["device"]
    where = f"On {dev['sm']} ({dev['capability']})" if dev["capability"] is not None else "On this host (no CUDA device)"
    runs = [k for k, v in report["verdicts"].items() if v["supported"]]
    parts = []
    for lib, prefix in (("FlashMLA", "flashmla/"), ("FlashInfer", "flashinfer/"), ("vLLM", "vllm/")):
        mine = [k for k in runs if k.startswith(prefix)]
        parts.append(f"{lib}'s {', '.join(mine)}" if mine else f"none of {lib}'s")
    text = f"{where}: " + "; ".join(parts)
    cap = dev["capability"]
    if cap is not None and "flashinfer/fa3_mla" not in runs and "flashinfer/fa2_mla" in runs:
        text += " (FlashInfer's backend auto falls back to FA2 off SM90)"
    elif cap is None:
        text += " (a CUDA GPU is needed for all of them)"
    return text + "."


def adapter_lines(report: dict[str, Any]) -> list[str]:
    """The suite's adapters, one line per kernel, then the hardware note where it applies."""
    status = report["adapters"]
    width = max(len(k) for k in status)
    lines = [f"{kid:<{width}}  {', '.join(st['adapters'])}: "
             + ("run on hardware" if st["run_on_hardware"] else "not yet run on hardware")
             for kid, st in status.items()]
    if any(not st["run_on_hardware"] for st in status.values()):
        lines.append(NOT_RUN_ON_HARDWARE[0].upper() + NOT_RUN_ON_HARDWARE[1:] + ".")
    return lines


def _verdict(verdict: dict[str, Any]) -> str:
    return "supported" if verdict["supported"] else f"no: {verdict['reason']}"


# --------------------------------------------------------------------------- text: fits the terminal


def _runs_on(row: KernelRow) -> str:
    return "; ".join(f"{t.name} ({', '.join(cap_str(c) for c in t.capabilities)})"
                     + (f" with CUDA >= {version_str(t.min_cuda)}" if t.min_cuda else "") for t in row.targets)


def _layout(row: KernelRow) -> str:
    dims = " or ".join(map(str, row.head_dim_k)) + "/" + " or ".join(map(str, row.head_dim_v))
    page = ("page block " + "/".join(map(str, row.page_block_size)) if row.page_block_size
            else "no page-block rule")
    return f"{row.kv_dtype.split(' (')[0]} KV cache, {row.mode}, head dims K/V {dims}, {page}; " \
           f"confidence {row.confidence}"


def render_text(report: dict[str, Any], columns: int = FALLBACK_COLUMNS) -> str:
    """The matrix and the verdicts, every line at most ``columns`` wide (at least :data:`MIN_COLUMNS`)."""
    width = max(columns, MIN_COLUMNS)

    def para(text: str, indent: str = "") -> list[str]:
        return textwrap.wrap(text, width, initial_indent=indent, subsequent_indent=indent or "  ",
                             break_on_hyphens=False)

    def field(label: str, text: str) -> list[str]:
        return textwrap.wrap(text, width, initial_indent=f"  {label:<{_LABEL - 3}} ",
                             subsequent_indent=" " * _LABEL, break_on_hyphens=False)

    lines = para("MLA kernel support matrix (the full table: mla-conformance matrix --format md; with the "
                 "upstream sources: --format json)")
    lines += [""] + para(device_label(report))
    extra = packages_line(report)
    if extra:
        lines += para(extra)
    for row in MATRIX:
        lines += ["", row.kernel_id]
        lines += field("runs on", _runs_on(row))
        lines += field("layout", _layout(row))
        lines += field("here", _verdict(report["verdicts"][row.kernel_id]))
    lines += [""] + para(runs_here(report))
    lines += [""] + para("The suite's adapters (built-in ops; `flashmla` and `flashmla-sparse` also as layer "
                         "backends):")
    for line in adapter_lines(report):
        lines += para(line, "  ")
    return "\n".join(lines)


# --------------------------------------------------------------------------- markdown: the full table


def _table(headers: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    def cell(text: str) -> str:
        return str(text).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join("---" for _ in headers) + " |"]
    return "\n".join([*lines, *("| " + " | ".join(cell(c) for c in row) + " |" for row in rows)]) + "\n"


def _ver(v: tuple[int, int] | None) -> str:
    return "not stated" if v is None else f"{v[0]}.{v[1]}"


def _min_cuda(targets) -> str:
    first = _ver(targets[0].min_cuda)
    rest = [f"{_ver(t.min_cuda)} on {t.name}" for t in targets[1:] if t.min_cuda != targets[0].min_cuda]
    return "; ".join([first, *rest])


def support_matrix_table() -> str:
    """The full support table (docs/support-matrix.md carries it: tools/docs.py), one row per kernel of MATRIX."""
    rows = []
    for row in MATRIX:
        runs_on = ", ".join(f"{t.name} ({', '.join(f'{c[0]}.{c[1]}' for c in t.capabilities)})"
                            for t in row.targets)
        dims = " or ".join(map(str, row.head_dim_k)) + "/" + " or ".join(map(str, row.head_dim_v))
        page = "-" if row.page_block_size is None else "/".join(map(str, row.page_block_size))
        rows.append((f"`{row.kernel_id}`", runs_on, _min_cuda(row.targets), row.kv_dtype, page,
                     f"{row.mode}, {dims}", row.confidence))
    return _table(("kernel id", "runs on (compute capability)", "min CUDA", "KV cache", "page block",
                   "mode, head dims K/V", "confidence"), rows)


def render_markdown(report: dict[str, Any]) -> str:
    """The full support table (as markers.md has it), then the device, a verdict per kernel and the adapters."""
    lines = ["# MLA kernel support matrix", "", support_matrix_table().rstrip("\n"), "", device_label(report)]
    extra = packages_line(report)
    if extra:
        lines += ["", extra]
    lines += ["", "| kernel id | on this device |", "| --- | --- |"]
    lines += [f"| `{kid}` | {_verdict(v).replace('|', chr(92) + '|')} |" for kid, v in report["verdicts"].items()]
    lines += ["", runs_here(report), "", "The suite's adapters (built-in ops; `flashmla` and `flashmla-sparse` also "
              "as layer backends):", ""]
    lines += [f"- {line}" for line in adapter_lines(report)]
    return "\n".join(lines)
