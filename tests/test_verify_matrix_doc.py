"""benchmarks/verify_matrix.py regenerates docs/verification.md: the hand-written survey sections
between the generated tables and "Where a target is missed" are kept (a regeneration dropped
them), and nothing else of the old file is."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _module():
    spec = importlib.util.spec_from_file_location("verify_matrix", ROOT / "benchmarks" / "verify_matrix.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_surveys_are_kept_and_the_generated_parts_are_not(tmp_path):
    m = _module()
    old = tmp_path / "verification.md"
    old.write_text("# Verification\n\n## Peak memory\n| old table |\n\n"
                   f"{m.KEPT_FROM}: a survey\nkept line\n\n## Real runs: another survey\nalso kept\n\n"
                   + "\n".join(m.WHY) + "\nold why text\n")
    kept = m.kept_sections(old)
    assert kept[0] == f"{m.KEPT_FROM}: a survey" and "also kept" in kept and kept[-1] == ""
    assert not any("old table" in line or "old why" in line or line == m.WHY[0] for line in kept)
    assert m.kept_sections(tmp_path / "missing.md") == []
    old.write_text("# Verification\n| a table |\n" + "\n".join(m.WHY))  # no survey: nothing kept
    assert m.kept_sections(old) == []


def test_the_committed_document_has_its_surveys_where_the_generator_looks():
    m = _module()
    kept = m.kept_sections(ROOT / "docs" / "verification.md")
    assert kept and kept[0].startswith(m.KEPT_FROM)
