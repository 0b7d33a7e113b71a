"""benchmarks/reserved_matrix.py's command line: options for every cell (no trace runs here)."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location("reserved_matrix", ROOT / "benchmarks" / "reserved_matrix.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_an_option_value_is_json_where_it_parses_and_text_otherwise():
    opt = _module()._option
    assert opt("logits_fp32=true") == ("logits_fp32", True)
    assert opt("grad_accum=4") == ("grad_accum", 4)
    assert opt("embed_head_unit=root-kept") == ("embed_head_unit", "root-kept")


@pytest.mark.parametrize("bad", ["logits_fp32", "=true"])
def test_an_option_without_key_and_value_is_one_line(bad):
    with pytest.raises(SystemExit, match="expected KEY=VALUE"):
        _module()._option(bad)
