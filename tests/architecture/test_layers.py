"""The layers import one way only: fleet/ (what the router knows) beneath policies/ and the twin,
the proxy above those, bench/ on top. Read from the source with ast, so a lazy import inside a
function counts as much as one at the top of a module."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("fleet", "policies", "sim", "proxy", "bench")
# What each package may import of the others.
ALLOWED = {
    "fleet": set(),
    "policies": {"fleet"},
    "sim": {"fleet"},
    "proxy": {"fleet", "policies"},
    "bench": {"fleet", "policies", "sim", "proxy"},
}
# The command line and the demo start twins beside the proxy; nothing on the request path does.
EXCEPTIONS = {"proxy/cli.py": {"sim"}, "proxy/demo.py": {"sim"}}


def imported_packages(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found & set(PACKAGES)


def test_each_package_imports_only_the_layers_beneath_it() -> None:
    wrong = []
    for package in PACKAGES:
        files = sorted((ROOT / package).rglob("*.py"))
        assert files, package
        for path in files:
            name = str(path.relative_to(ROOT))
            for other in imported_packages(path) - ALLOWED[package] - EXCEPTIONS.get(name, set()) - {package}:
                wrong.append(f"{name} imports {other}")
    assert not wrong, "\n".join(wrong)


def test_the_rule_sees_a_wrong_import(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from proxy.settings import Settings\n    import sim.engine\n")
    assert imported_packages(source) == {"proxy", "sim"}
