"""``mla-conformance merge``: the options; the merge itself is :func:`mla_conformance.report.merge.merge_command`."""

from __future__ import annotations

from mla_conformance.report.merge import merge_command


def add_cli(sub) -> None:
    m = sub.add_parser("merge", help="merge conformance.json reports of several hosts into one matrix",
                       description="Merge conformance.json reports into one matrix (rows: checks; columns: report "
                                   "x backend). Reports with the same name are kept apart by their run id; the "
                                   "order of the arguments does not change the result.")
    m.add_argument("reports", nargs="+", metavar="REPORT.json")
    m.add_argument("--out", required=True, metavar="DIR",
                   help="output directory: new, empty, or holding an earlier matrix of this tool")
    m.set_defaults(func=lambda args: merge_command(args.reports, args.out))
