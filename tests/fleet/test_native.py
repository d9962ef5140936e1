"""fleet/native.py: a compiled build stands in for the sources only while it is theirs."""

import importlib
import json
import sysconfig
from pathlib import Path

import pytest

from fleet import native

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, Path]:
    """A source tree (copies of the compiled modules) and a build manifest of exactly them."""
    root, build = tmp_path / "src", tmp_path / "build"
    for source in native.COMPILED:
        (root / source).parent.mkdir(parents=True, exist_ok=True)
        (root / source).write_bytes((ROOT / source).read_bytes())
    build.mkdir()
    (build / "abc__mypyc.so").write_bytes(b"")
    manifest = {
        "soabi": sysconfig.get_config_var("SOABI"),
        "library": "abc__mypyc.so",
        "sources": {source: native.digest(root / source) for source in native.COMPILED},
    }
    (build / native.MANIFEST).write_text(json.dumps(manifest))
    return root, build


def test_a_build_of_the_sources_is_used(tree):
    root, build = tree
    assert native.check(build, root).compiled


def test_an_edited_source_is_never_shadowed(tree):
    root, build = tree
    edited = root / "fleet" / "model.py"
    edited.write_text(edited.read_text() + "\n# edited\n")
    verdict = native.check(build, root)
    assert not verdict.compiled and "fleet/model.py changed" in verdict.reason


def test_no_build_another_interpreter_or_a_partial_build_runs_the_sources(tree):
    root, build = tree
    manifest = json.loads((build / native.MANIFEST).read_text())
    (build / native.MANIFEST).write_text(json.dumps({**manifest, "soabi": "cpython-39-x86_64-linux-gnu"}))
    assert "this interpreter" in native.check(build, root).reason
    (build / native.MANIFEST).write_text(json.dumps({**manifest, "sources": {"fleet/model.py": "0"}}))
    assert "another list of modules" in native.check(build, root).reason
    (build / native.MANIFEST).write_text(json.dumps(manifest))
    (build / "abc__mypyc.so").unlink()
    assert "runtime library is missing" in native.check(build, root).reason
    (build / native.MANIFEST).unlink()
    assert not native.check(build, root).compiled


def test_this_process_runs_what_the_verdict_says():
    """Every compiled module comes from the build exactly when the verdict allows it (run once
    from source and once compiled by `make test`)."""
    compiled = native.status().compiled
    for module in native.modules():
        importlib.import_module(module)
        assert native.running_compiled(module) == compiled, module
