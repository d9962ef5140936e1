"""What the router knows about its fleet: the bottom layer under the policies, the proxy and the
evaluation. It imports nothing above it (not the policies, the proxy, the twin or bench).

Its decision-path modules run compiled when `make native` built them from these very sources
(fleet/native.py)."""

from fleet.native import attach

attach(__name__, __path__)
