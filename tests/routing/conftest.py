"""tests/routing reuses the proxy tests' harness (the proxy under uvicorn on a free port)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "proxy"))
