"""Compile the decision path with mypyc into build/native/ (`make native`); fleet/native.py says
when the build is used (only while every compiled source is unchanged).

    .venv/bin/python deploy/native.py [--out build/native]
    .venv/bin/python deploy/native.py --status [--require]

The sources in `fleet.native.COMPILED` are hashed, copied as hashed into a staging directory
with the rest of their packages (mypyc type-checks what they import), compiled there, and the
extension modules moved into the build with a manifest: each source's SHA-256, the interpreter's
ABI, mypy's version, the date. Needs a C compiler and mypy (the test extra). Takes about a
minute on two cores.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fleet.native import BUILD, COMPILED, MANIFEST, digest, modules, running_compiled, status  # noqa: E402

PACKAGES = ("fleet", "policies")
MYPY_INI = """[mypy]
python_version = {version}
plugins = pydantic.mypy
ignore_missing_imports = True
"""
SETUP = """from setuptools import setup
from mypyc.build import mypycify

setup(name="specroute-native", ext_modules=mypycify({sources!r}, opt_level="3", strict_dunder_typing=False))
"""


def build(out: Path) -> None:
    started = time.monotonic()
    sources = {source: digest(ROOT / source) for source in COMPILED}
    with tempfile.TemporaryDirectory(prefix="specroute-native-") as tmp:
        stage = Path(tmp)
        for package in PACKAGES:
            shutil.copytree(ROOT / package, stage / package, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        # The staged copies must be the bytes the manifest names (a file edited meanwhile is not).
        changed = [s for s in COMPILED if digest(stage / s) != sources[s]]
        if changed:
            raise SystemExit(f"changed while copying: {', '.join(changed)}; run again")
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        (stage / "mypy.ini").write_text(MYPY_INI.format(version=version))
        (stage / "setup.py").write_text(SETUP.format(sources=list(COMPILED)))
        # setup.py runs where no pyproject.toml is (the project's own is for pip, not for this).
        subprocess.run(
            [sys.executable, "setup.py", "-q", "build_ext", "--build-lib", "lib", "--build-temp", "temp"],
            cwd=stage,
            check=True,
        )
        built = sorted(p.relative_to(stage / "lib") for p in (stage / "lib").rglob("*.so"))
        libraries = [p for p in built if len(p.parts) == 1]
        if len(libraries) != 1:
            raise SystemExit(f"expected one shared runtime library, found {libraries}")
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        for path in built:
            (out / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(stage / "lib" / path, out / path)
    from importlib.metadata import version as installed

    record = {
        "soabi": sysconfig.get_config_var("SOABI"),
        "mypy": installed("mypy"),
        "built": time.strftime("%Y-%m-%d %H:%M"),
        "library": str(libraries[0]),
        "sources": sources,
    }
    (out / MANIFEST).write_text(json.dumps(record, indent=1) + "\n")
    print(f"built {len(built) - 1} modules into {out} in {time.monotonic() - started:.0f} s")


def report(require: bool) -> None:
    """Which path this interpreter runs here and why; with `require`, fail unless every compiled
    module is imported from the build (what `make test` checks before its compiled run)."""
    verdict = status()
    for module in modules():
        importlib.import_module(module)
    compiled = [m for m in modules() if running_compiled(m)]
    print(f"decision path: {'compiled' if verdict.compiled else 'pure Python'} ({verdict.reason}); ", end="")
    print(f"{len(compiled)} of {len(modules())} modules from the build")
    if require and len(compiled) != len(modules()):
        raise SystemExit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=BUILD)
    parser.add_argument("--status", action="store_true", help="say which path runs, build nothing")
    parser.add_argument("--require", action="store_true", help="with --status: fail unless compiled")
    args = parser.parse_args()
    if args.status:
        report(args.require)
    else:
        build(args.out)


if __name__ == "__main__":
    main()
