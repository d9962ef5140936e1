"""The routing policies: pure functions of (request features, fleet snapshot). `goodput` runs
compiled when `make native` built it from this very source (fleet/native.py)."""

from fleet.native import attach

attach(__name__, __path__)
