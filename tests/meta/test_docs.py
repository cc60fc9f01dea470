"""The generated tables of markers.md and docs/*.md come from the code (``python tools/docs.py``); this fails when
they differ, and when a generated section sits in a file other than the one tools/docs.py's FILES names (a
maintainer's script of the checkout, not in the wheel)."""

import shutil

import pytest

from tools import docs

pytestmark = pytest.mark.meta


def test_every_generated_table_matches_the_code():
    rc, _, err = docs.update(check=True)
    assert rc == 0, (f"generated tables out of date with the code (the plugin's options, TOLERANCES, OP_TOLERANCES, "
                     f"the op suite's sections, CODECS/ERROR_BOUNDS, arch.MATRIX, the presets): {err}; regenerate with "
                     f"`{docs.REGENERATE}` and commit")


def test_docs_check_command_passes(capsys):
    assert docs.main(["--check"]) == 0, capsys.readouterr().err


def test_every_section_has_one_file():
    owners = [name for names in docs.FILES.values() for name in names]
    assert sorted(owners) == sorted(docs.SECTIONS), "each generated section belongs to exactly one file of FILES"
    for rel in docs.FILES:
        assert (docs.CHECKOUT / rel).is_file(), rel


def test_docs_check_names_stale_sections_and_rewrite_fixes_them(tmp_path, capsys):
    text = (docs.CHECKOUT / "docs/tolerances.md").read_text(encoding="utf-8")
    stale = text.replace("| float32 | 1e-5 |", "| float32 | 2e-5 |")
    assert stale != text
    path = tmp_path / "docs" / "tolerances.md"
    path.parent.mkdir()
    path.write_text(stale, encoding="utf-8")
    assert docs.main(["--check", "--path", str(path)]) == 1
    err = capsys.readouterr().err
    assert "tolerances" in err and "op_tolerances" not in err and docs.REGENERATE in err
    assert path.read_text(encoding="utf-8") == stale  # --check writes nothing
    assert docs.main(["--path", str(path)]) == 0
    assert path.read_text(encoding="utf-8") == text
    assert docs.main(["--check", "--path", str(path)]) == 0


def test_update_checks_every_file_and_names_the_stale_one(tmp_path):
    for rel in docs.FILES:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(docs.CHECKOUT / rel, tmp_path / rel)
    codecs = tmp_path / "docs" / "codecs.md"
    codecs.write_text(codecs.read_text(encoding="utf-8").replace("| `none` |", "| `nothing` |"), encoding="utf-8")
    rc, out, err = docs.update([tmp_path / rel for rel in docs.FILES], check=True)
    assert rc == 1 and len(err) == 1 and str(codecs) in err[0] and "kv_codecs" in err[0], err
    assert len(out) == len(docs.FILES) - 1


def test_docs_missing_markers_is_an_input_error(tmp_path, capsys):
    path = tmp_path / "markers.md"
    path.write_text("# no generated sections\n", encoding="utf-8")
    assert docs.main(["--check", "--path", str(path)]) == 2
    assert "no markers for section(s)" in capsys.readouterr().err


def test_a_section_in_the_wrong_file_is_an_input_error(tmp_path):
    path = tmp_path / "docs" / "codecs.md"
    path.parent.mkdir()
    path.write_text(f"{docs.BEGIN.format(name='kv_codecs')}\n{docs.END}\n{docs.BEGIN.format(name='tolerances')}\n"
                    f"{docs.END}\n", encoding="utf-8")
    with pytest.raises(ValueError, match="tolerances belong to docs/tolerances.md"):
        docs.update([path], check=True)


def test_generated_op_tables_follow_the_code(monkeypatch):
    from mla_conformance import checks

    assert "| `--mla-op SPEC` | op under test" in docs.options_table()
    sections = docs.op_sections_table()
    assert "| `op-numerics` | `test_op_numerics.py::test_out_lse_vs_oracle`" in sections
    assert "| `bfloat16` | 2^-8 | 52 x 2^-24 | 256 x 2^-24 |" in docs.op_tolerances_table()
    monkeypatch.delattr(checks, "OP_TOLERANCES")  # a checkout without the op table renders, saying so
    assert "no `OP_TOLERANCES` table" in docs.op_tolerances_table()


def test_presets_table_reads_the_configs():
    from mla_conformance.model.config import PRESETS

    table = docs.presets_table()
    assert all(f"| `{name}` |" in table for name in PRESETS)
    assert "| `deepseek-v2-lite` | 16 | 2048 | - | 512 + 64 | 128 / 128 | x40 past 4,096 | 27 | - |" in table


@pytest.mark.parametrize("value, text", [(1e-6, "1e-6"), (2.5e-2, "2.5e-2"), (0.2, "2e-1"), (0.0, "0"),
                                         (1.5e-1, "1.5e-1"), (3.0, "3")])
def test_bound_format_is_deterministic(value, text):
    assert docs.num(value) == text
    assert docs.bound(2 ** -11) == "2^-11" and docs.bound(1e-5) == "1e-5" and docs.bound(0.5) == "5e-1"
