"""fleet/native.py: a compiled build stands in for the sources only while it is theirs."""

import importlib
import json
import shutil
import sysconfig
from pathlib import Path

import pytest

from fleet import native

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = "abc__mypyc" + str(sysconfig.get_config_var("EXT_SUFFIX"))


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, Path]:
    """A source tree (copies of fleet/ and policies/) and a whole build manifest of exactly it
    (binaries stand-ins of the sizes it records)."""
    root, build = tmp_path / "src", tmp_path / "build"
    for package in native.PACKAGES:
        (root / package).mkdir(parents=True)
        for path in (ROOT / package).glob("*.py"):
            shutil.copy(path, root / package / path.name)
    binaries = {LIBRARY: 3, **{native.binary(source): 1 for source in native.COMPILED}}
    for name, size in binaries.items():
        (build / name).parent.mkdir(parents=True, exist_ok=True)
        (build / name).write_bytes(b"x" * size)
    manifest = {
        "soabi": sysconfig.get_config_var("SOABI"),
        "library": LIBRARY,
        "compiled": list(native.COMPILED),
        "binaries": binaries,
        "sources": native.sources(root),
    }
    (build / native.MANIFEST).write_text(json.dumps(manifest))
    return root, build


def _rewrite(build: Path, **changes) -> None:
    manifest = json.loads((build / native.MANIFEST).read_text())
    (build / native.MANIFEST).write_text(json.dumps({**manifest, **changes}))


def test_a_build_of_the_sources_is_used(tree):
    root, build = tree
    assert native.check(build, root).compiled


@pytest.mark.parametrize("source", ["fleet/model.py", "policies/goodput_params.py", "fleet/native.py"])
def test_an_edited_source_is_never_shadowed(tree, source):
    """Any source mypyc read, compiled or only imported by what is, sends the process back to
    the sources when it changes."""
    root, build = tree
    edited = root / source
    edited.write_text(edited.read_text() + "\n# edited\n")
    verdict = native.check(build, root)
    assert not verdict.compiled and f"{source} changed" in verdict.reason


def test_an_added_or_removed_source_runs_the_sources(tree):
    root, build = tree
    (root / "policies" / "newpolicy.py").write_text("")
    assert "policies/newpolicy.py is new" in native.check(build, root).reason
    (root / "policies" / "newpolicy.py").unlink()
    (root / "fleet" / "cadence.py").unlink()
    assert "fleet/cadence.py is gone" in native.check(build, root).reason


def test_a_partial_or_foreign_build_runs_the_sources(tree):
    root, build = tree
    (build / native.binary("fleet/types.py")).unlink()
    assert "is missing" in native.check(build, root).reason
    (build / native.binary("fleet/types.py")).write_bytes(b"xx")  # not the size built
    assert "not the one built" in native.check(build, root).reason
    (build / native.binary("fleet/types.py")).write_bytes(b"x")
    assert native.check(build, root).compiled
    _rewrite(build, soabi="cpython-39-x86_64-linux-gnu")
    assert "this interpreter" in native.check(build, root).reason
    _rewrite(build, soabi=sysconfig.get_config_var("SOABI"), compiled=["fleet/model.py"])
    assert "another list of modules" in native.check(build, root).reason
    _rewrite(build, compiled=list(native.COMPILED), binaries={LIBRARY: 3})
    assert "lacks a compiled module" in native.check(build, root).reason
    (build / native.MANIFEST).unlink()
    assert "no build" in native.check(build, root).reason


def test_this_process_runs_what_the_verdict_says():
    """Every compiled module comes from the build exactly when the verdict allows it (run once
    from source and once compiled by `make test`)."""
    compiled = native.status().compiled
    for module in native.modules():
        importlib.import_module(module)
        assert native.running_compiled(module) == compiled, module
