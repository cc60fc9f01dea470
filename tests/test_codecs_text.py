"""``mla-conformance codecs`` as text names both kernel FP8 layouts (656-byte V3.2 row, 584-byte MODEL1) with the
figures its ``--json`` holds for them (codec_table.kernel_layouts)."""

from __future__ import annotations

from mla_conformance.cli import main
from mla_conformance.kv.codec_table import kernel_layouts


def test_codecs_text_lists_both_kernel_layouts(capsys):
    layouts = kernel_layouts()  # what --json prints under kernel_layouts
    assert main(["codecs", "--preset", "deepseek-v2-lite"]) == 0
    text = capsys.readouterr().out
    assert {r["name"]: r["total"] for r in layouts} == {"fp8-e4m3-flashmla": 656, "fp8-e4m3-model1": 584}
    for r in layouts:
        lines = [ln for ln in text.splitlines() if ln.split()[:1] == [r["name"]] and r["dims"] in ln]
        assert len(lines) == 1, f"codecs text has {len(lines)} kernel-layout lines for {r['name']}:\n{text}"
        figures = lines[0].split(r["dims"])[1].split()
        want = [f"{r[k]:,}" for k in ("payload", "metadata", "total", "written_bytes_per_token", "page_block_size",
                                       "block_bytes")]
        assert figures == want, f"{r['name']}: text row {figures}, --json {want}"
