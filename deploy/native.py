"""Compile the decision path with mypyc into build/native/ (`make native`); fleet/native.py says
when the build is used (only while every source of fleet/ and policies/ is as it was compiled).

    .venv/bin/python deploy/native.py
    .venv/bin/python deploy/native.py --status [--require]

The sources of fleet/ and policies/ are hashed, copied as hashed into a staging directory (mypyc
type-checks what the modules in `fleet.native.COMPILED` import), the modules compiled there, and
the extension modules moved into build/native/ with a manifest: every source's SHA-256, the
modules compiled, each binary's size, the interpreter's ABI, mypy's version, the date. Needs a C
compiler, Python's headers, setuptools and mypy (the last two in the test extra); checks for them
first. About 25 s on two cores.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from importlib.metadata import version as installed
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fleet.native import (  # noqa: E402
    BUILD,
    COMPILED,
    MANIFEST,
    PACKAGES,
    binary,
    modules,
    running_compiled,
    sources,
    status,
)

MYPY_INI = """[mypy]
python_version = {version}
plugins = pydantic.mypy
ignore_missing_imports = True
"""
SETUP = """from setuptools import setup
from mypyc.build import mypycify

setup(name="specroute-native", ext_modules=mypycify({sources!r}, opt_level="3", strict_dunder_typing=False))
"""


def missing() -> list[str]:
    """What compiling needs and this machine lacks."""
    lacks = []
    compiler = shlex.split(str(sysconfig.get_config_var("CC") or "cc"))[:1]
    if not compiler or shutil.which(compiler[0]) is None:
        lacks.append(f"a C compiler ({' '.join(compiler) or 'cc'})")
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file():
        lacks.append("Python's headers (Python.h; e.g. the python3-dev package)")
    for module in ("setuptools", "mypyc"):
        if importlib.util.find_spec(module) is None:
            lacks.append(f"{module} (pip install -e '.[test]')")
    return lacks


def build() -> None:
    started = time.monotonic()
    lacks = missing()
    if lacks:
        raise SystemExit(f"cannot compile the decision path: no {'; no '.join(lacks)}")
    hashed = sources(ROOT)
    with tempfile.TemporaryDirectory(prefix="specroute-native-") as tmp:
        stage = Path(tmp)
        for package in PACKAGES:
            shutil.copytree(ROOT / package, stage / package, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        # The staged copies must be the bytes the manifest names (a file edited meanwhile is not).
        if sources(stage) != hashed:
            raise SystemExit("a source changed while it was copied: run again")
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        (stage / "mypy.ini").write_text(MYPY_INI.format(version=version))
        (stage / "setup.py").write_text(SETUP.format(sources=list(COMPILED)))
        # setup.py runs where no pyproject.toml is (the project's own is for pip, not for this).
        subprocess.run(
            [sys.executable, "setup.py", "-q", "build_ext", "--build-lib", "lib", "--build-temp", "temp"],
            cwd=stage,
            check=True,
        )
        lib = stage / "lib"
        built = sorted(str(p.relative_to(lib)) for p in lib.rglob("*.so"))
        libraries = [p for p in built if "/" not in p]
        if len(libraries) != 1:
            raise SystemExit(f"expected one shared runtime library, found {libraries}")
        lacking = [source for source in COMPILED if binary(source) not in built]
        if lacking:
            raise SystemExit(f"mypyc made no extension module of {', '.join(lacking)}")
        # Only build/native is replaced, and the manifest written last: a build cut short has
        # none, and runs nothing.
        if BUILD.exists():
            shutil.rmtree(BUILD)
        BUILD.mkdir(parents=True)
        for name in built:
            (BUILD / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(lib / name, BUILD / name)
    record = {
        "soabi": sysconfig.get_config_var("SOABI"),
        "mypy": installed("mypy"),
        "built": time.strftime("%Y-%m-%d %H:%M"),
        "library": libraries[0],
        "compiled": list(COMPILED),
        "binaries": {name: (BUILD / name).stat().st_size for name in built},
        "sources": hashed,
    }
    (BUILD / MANIFEST).write_text(json.dumps(record, indent=1) + "\n")
    print(f"built {len(built) - 1} modules into {BUILD} in {time.monotonic() - started:.0f} s")


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
    parser.add_argument("--status", action="store_true", help="say which path runs, build nothing")
    parser.add_argument("--require", action="store_true", help="with --status: fail unless compiled")
    args = parser.parse_args()
    if args.status:
        report(args.require)
    else:
        build()


if __name__ == "__main__":
    main()
