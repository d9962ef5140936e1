"""The SGLang twin: a calibrated simulator of speculative (EAGLE-3) and plain SGLang servers.

One engine model (engine.py, timed by a profile from profile.py) runs under two drivers: an
HTTP server that speaks SGLang's API (server.py, loop.py, cli.py: `specroute sim ...` or
`python -m sim ...`) and a virtual clock for fast in-process simulation (virtual.py).
testing.py starts twin servers as subprocesses for tests. See docs/twin.md.
"""
