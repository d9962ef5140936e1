"""The decision path compiled with mypyc, used when a build of the very sources beside it exists.

A routing decision runs the modules in `COMPILED` (the fleet model, the prefix index, the cost
model, the goodput policy) some hundreds of Python operations deep; compiled to C by mypyc from
the same typed source they make the same decisions in about half the time (docs/routing.md,
"Prefix index"). `make native` (deploy/native.py) builds them into build/native/ with a manifest
of the sources it compiled; `make test` runs the suite both ways.

`attach`, called by `fleet/__init__.py` and `policies/__init__.py`, puts build/native/<package>
ahead of the package's own directory on its `__path__`, so that its compiled modules are imported
instead of their sources, only when every source of fleet/ and policies/ (what mypyc read to
compile them) is byte for byte what it was at the build, none added or removed, the build is
whole and for this interpreter. Otherwise nothing changes and the sources run: compiling beside
the sources would let a binary shadow a source edited since; here an edit sends the next process
back to the sources, and the build is all or nothing (compiled modules share one runtime library
and each other's native classes). The verdict is taken once per process, at its first import of
`fleet`: a process started after an edit or a rebuild may run the other path than one started
before, so what crosses between processes is plain values (proxy/body.py). `status()` says which
path runs and why; the proxy logs it at start (a warning when from source), and the state
endpoint shows it.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

COMPILED = (
    "fleet/acceptance.py",
    "fleet/attainment.py",
    "fleet/blocks.py",
    "fleet/costmodel.py",
    "fleet/features.py",
    "fleet/instance.py",
    "fleet/model.py",
    "fleet/outcomes.py",
    "fleet/prefix.py",
    "fleet/profile.py",
    "fleet/readings.py",
    "fleet/sessions.py",
    "fleet/types.py",
    "policies/goodput.py",
)
"""Sources mypyc compiles, relative to the project root: what a decision runs, and what they
import at every call (compiled modules call each other natively)."""
PACKAGES = ("fleet", "policies")
"""The packages whose every source mypyc reads (type-checks) to compile `COMPILED`: the build
stands only for these sources, all of them, as they were."""

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build" / "native"
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class NativeStatus:
    compiled: bool
    reason: str


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def sources(root: Path = ROOT) -> dict[str, str]:
    """Every source of `PACKAGES` under `root` (relative path -> SHA-256)."""
    return {
        f"{package}/{path.name}": digest(path) for package in PACKAGES for path in sorted((root / package).glob("*.py"))
    }


def binary(source: str) -> str:
    """The extension module a compiled source becomes (relative to the build)."""
    return source.removesuffix(".py") + str(sysconfig.get_config_var("EXT_SUFFIX"))


def manifest(build: Path = BUILD) -> dict[str, object]:
    """What deploy/native.py records next to a build (read it, do not change it)."""
    data = json.loads((build / MANIFEST).read_text())
    if not isinstance(data, dict):
        raise ValueError("not a manifest")
    return data


def check(build: Path = BUILD, root: Path = ROOT) -> NativeStatus:
    """Whether the build in `build` may stand in for the sources under `root`, and why not: it
    must be for this interpreter's ABI, of `COMPILED`, from exactly the sources of `PACKAGES`
    now there (none changed, added or removed), and whole (every binary it made, at its size)."""
    try:
        data = manifest(build)
    except FileNotFoundError:
        return NativeStatus(False, "no build (make native compiles one)")
    except (OSError, ValueError) as e:
        return NativeStatus(False, f"unreadable build manifest: {e}")
    soabi = sysconfig.get_config_var("SOABI")
    if data.get("soabi") != soabi:
        return NativeStatus(False, f"built for {data.get('soabi')}, this interpreter is {soabi}")
    if data.get("compiled") != list(COMPILED):
        return NativeStatus(False, "built from another list of modules (make native again)")
    built = data.get("sources")
    if not isinstance(built, dict):
        return NativeStatus(False, "unreadable build manifest: no sources")
    try:
        current = sources(root)
    except OSError as e:
        return NativeStatus(False, f"cannot read the sources: {e}")
    for source in sorted(set(built) | set(current)):
        if source not in current:
            return NativeStatus(False, f"{source} is gone since the build (make native again)")
        if source not in built:
            return NativeStatus(False, f"{source} is new since the build (make native again)")
        if current[source] != built[source]:
            return NativeStatus(False, f"{source} changed since it was compiled (make native again)")
    binaries = data.get("binaries")
    library = data.get("library")
    if not isinstance(binaries, dict) or not isinstance(library, str) or library not in binaries:
        return NativeStatus(False, "unreadable build manifest: no binaries")
    if any(binary(source) not in binaries for source in COMPILED):
        return NativeStatus(False, "the build lacks a compiled module (make native again)")
    for name, size in binaries.items():
        try:
            if (build / name).stat().st_size != size:
                return NativeStatus(False, f"{name} is not the one built (make native again)")
        except OSError:
            return NativeStatus(False, f"{name} is missing (make native again)")
    return NativeStatus(True, f"compiled by mypyc {data.get('mypy', '?')} on {data.get('built', '?')}")


@functools.cache
def status() -> NativeStatus:
    """This process's verdict, taken once (before the first compiled module is imported), then
    loads the build's shared runtime library when it is used (a library that does not load,
    e.g. copied from another machine, means the sources run)."""
    verdict = check()
    if not verdict.compiled:
        return verdict
    library = str(manifest()["library"])
    name = library.split(".", 1)[0]
    try:
        spec = importlib.util.spec_from_file_location(name, BUILD / library)
        if spec is None or spec.loader is None:
            return NativeStatus(False, f"cannot load {library}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    except (ImportError, OSError) as e:
        sys.modules.pop(name, None)
        return NativeStatus(False, f"cannot load {library}: {e}")
    return verdict


def attach(package: str, path: list[str]) -> None:
    """Called by a package's `__init__` with its `__path__`: the build's directory for it first,
    when the build stands for the current sources and the package is this checkout's."""
    if path and Path(path[0]).resolve() == ROOT / package and status().compiled:
        path.insert(0, str(BUILD / package))


def running_compiled(module: str = "fleet.model") -> bool:
    """Whether `module` was imported from the build (what a test of the compiled run asserts)."""
    loaded = sys.modules.get(module)
    return loaded is not None and not str(getattr(loaded, "__file__", "")).endswith(".py")


def modules() -> list[str]:
    """The dotted names of the compiled modules."""
    return [source.removesuffix(".py").replace("/", ".") for source in COMPILED]
