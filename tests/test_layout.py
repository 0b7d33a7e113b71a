"""The house rules that keep the library apart from its front ends (docs/design.md)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "zplan"


def _imports(path: Path, root: Path = ROOT) -> list[tuple[str, int]]:
    """Every module an import statement in `path` (a file of the package at `root`) names,
    resolved to its absolute name."""
    pkg = ".".join(path.relative_to(root.parent).with_suffix("").parts[:-1])
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            out.append((base, node.lineno))
            out += [(f"{base}.{a.name}", node.lineno) for a in node.names]
    return out



def test_library_never_imports_the_cli():
    bad = [f"{p.relative_to(ROOT.parent)}:{line} imports {mod}"
           for p in ROOT.rglob("*.py")
           if "cli" not in p.relative_to(ROOT).parts and p != ROOT / "__main__.py"
           for mod, line in _imports(p) if mod == "zplan.cli" or mod.startswith("zplan.cli.")]
    assert not bad, bad


def test_no_module_imports_from_a_main():
    bad = [f"{p.relative_to(ROOT.parent)}:{line} imports {mod}"
           for p in ROOT.rglob("*.py") for mod, line in _imports(p) if mod.endswith(".__main__")]
    assert not bad, bad


def test_no_private_name_imported_across_packages():
    bad = []
    for p in ROOT.rglob("*.py"):
        here = ".".join(p.relative_to(ROOT.parent).with_suffix("").parts[:-1])
        for mod, line in _imports(p):
            head, _, name = mod.rpartition(".")
            if name.startswith("_") and not name.startswith("__") and head.startswith("zplan") \
                    and not head.startswith(here) and not _is_module(mod):
                bad.append(f"{p.relative_to(ROOT.parent)}:{line} imports {mod}")
    assert not bad, bad


def _is_module(dotted: str) -> bool:
    parts = dotted.split(".")[1:]
    base = ROOT.joinpath(*parts)
    return base.with_suffix(".py").is_file() or base.is_dir()


def test_the_checker_sees_a_planted_violation(tmp_path):
    """The walker resolves relative imports: a planted `from ..cli.options import x` is caught
    (planted in a copy of the package's shape under tmp_path: the real tree is read by the other
    tests, in another worker at the same time)."""
    root = tmp_path / "zplan"
    planted = root / "trainer" / "_planted_for_test.py"
    planted.parent.mkdir(parents=True)
    planted.write_text("from ..cli.options import scenario_options\nfrom .__main__ import main\n")
    mods = [m for m, _ in _imports(planted, root)]
    assert "zplan.cli.options" in mods and "zplan.trainer.__main__" in mods
