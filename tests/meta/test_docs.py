"""markers.md's tables are generated from the code (``mla-conformance docs``); this fails when they differ."""

import pytest

from mla_conformance.report import docs
from mla_conformance.cli import main

pytestmark = pytest.mark.meta


def test_markers_md_tables_match_the_code():
    text = docs.DEFAULT_PATH.read_text(encoding="utf-8")
    new, stale = docs.render(text)
    assert not stale and new == text, (
        f"markers.md is out of date with the code: stale generated section(s) {', '.join(stale) or '(markers)'} "
        f"(from the plugin's options, TOLERANCES, OP_TOLERANCES, the op suite's sections, CODECS/ERROR_BOUNDS, "
        f"arch.MATRIX); regenerate with `{docs.REGENERATE}` and commit")


def test_docs_check_names_stale_sections_and_rewrite_fixes_them(tmp_path, capsys):
    text = docs.DEFAULT_PATH.read_text(encoding="utf-8")
    stale = text.replace("| float32 | 1e-5 |", "| float32 | 2e-5 |")
    assert stale != text
    path = tmp_path / "markers.md"
    path.write_text(stale, encoding="utf-8")
    assert main(["docs", "--check", "--path", str(path)]) == 1
    err = capsys.readouterr().err
    assert "tolerances" in err and "kv_codecs" not in err and docs.REGENERATE in err
    assert path.read_text(encoding="utf-8") == stale  # --check writes nothing
    assert main(["docs", "--path", str(path)]) == 0
    assert path.read_text(encoding="utf-8") == text
    assert main(["docs", "--check", "--path", str(path)]) == 0


def test_docs_missing_markers_is_an_input_error(tmp_path, capsys):
    path = tmp_path / "markers.md"
    path.write_text("# no generated sections\n", encoding="utf-8")
    assert main(["docs", "--check", "--path", str(path)]) == 2
    assert "no markers for section(s)" in capsys.readouterr().err


def test_generated_op_tables_follow_the_code(monkeypatch):
    from mla_conformance import checks

    assert "| `--mla-op SPEC` | op under test" in docs.options_table()
    sections = docs.op_sections_table()
    assert "| `op-numerics` | `test_op_numerics.py::test_out_lse_vs_oracle`" in sections
    assert "| `bfloat16` | 2^-8 | 52 x 2^-24 | 256 x 2^-24 |" in docs.op_tolerances_table()
    monkeypatch.delattr(checks, "OP_TOLERANCES")  # a checkout without the op table renders, saying so
    assert "no `OP_TOLERANCES` table" in docs.op_tolerances_table()


@pytest.mark.parametrize("value, text", [(1e-6, "1e-6"), (2.5e-2, "2.5e-2"), (0.2, "2e-1"), (0.0, "0"),
                                         (1.5e-1, "1.5e-1"), (3.0, "3")])
def test_bound_format_is_deterministic(value, text):
    assert docs.num(value) == text
    assert docs.bound(2 ** -11) == "2^-11" and docs.bound(1e-5) == "1e-5" and docs.bound(0.5) == "5e-1"
