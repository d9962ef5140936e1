"""The span export in a child process: the proxy's event loop pickles each batch of finished
requests into a pipe; the child writes their OTLP spans and exports them (tracing.LocalExport:
spans.SpanWriter, the SDK's batch processor and OTLP exporters) on a CPU of its own.

Why a process: writing and exporting in the proxy cost its event loop 30-60 us per request (the
encoder and its memo are cold between requests, and the exporter thread contends for the GIL),
10-15 % of its throughput, where pickling a batch costs about 4 us a request
(docs/observability.md). SPECROUTE_TRACE_EXPORT=inline keeps it all in the proxy.

The child lives as long as its stdin: it ignores SIGINT and SIGTERM (a terminal's Ctrl-C and a
supervisor's signal reach the whole process group, while the proxy still drains) and ends at end
of file, after exporting what it holds: at the proxy's shutdown, which waits for it, or when the
proxy died. Run by hand: python -m proxy.telemetry.export_process PROTOCOL VERSION.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from proxy.telemetry.spans import RequestTrace
from proxy.telemetry.tracing import LocalExport, make_exporter, make_resource

log = logging.getLogger("specroute.telemetry")

MAX_BUFFER_BYTES = 64 << 20
"""Pickled batches waiting for room in the pipe (the child is behind), at most; beyond it batches
are dropped, as the batch processor drops spans beyond its queue."""
RESTART_S = 10.0
"""After the child ended unexpectedly, the next batch this long after its start starts another."""
SHUTDOWN_S = 10.0
"""The child's own limit for its last export at end of file."""
_ROOT = str(Path(__file__).resolve().parents[2])


class ProcessExport:
    """The proxy's side: pickles batches into the child's stdin without ever blocking the event
    loop (what the pipe does not take waits in a bounded buffer, written when there is room)."""

    def __init__(self, protocol: str, version: str) -> None:
        self.command = [sys.executable, "-m", "proxy.telemetry.export_process", protocol, version]
        self._child: subprocess.Popen[bytes] | None = None
        self._fd = -1
        self._started_at = 0.0
        self._buffer = bytearray()
        self._loop: asyncio.AbstractEventLoop | None = None
        """The loop watching the pipe for room, while the buffer is not empty."""
        self._dropped = 0
        self._lost = False

    @property
    def child(self) -> subprocess.Popen[bytes] | None:
        """The export process, once started."""
        return self._child

    def start(self) -> None:
        if self._child is not None:
            return
        path = os.pathsep.join(filter(None, (_ROOT, os.environ.get("PYTHONPATH"))))
        self._child = subprocess.Popen(self.command, stdin=subprocess.PIPE, env={**os.environ, "PYTHONPATH": path})
        assert self._child.stdin is not None
        self._fd = self._child.stdin.fileno()
        os.set_blocking(self._fd, False)
        self._started_at = time.monotonic()
        self._lost = False
        self._write(watch=True)  # batches sent before the start

    def send(self, batch: Sequence[RequestTrace]) -> None:
        if self._lost:
            if time.monotonic() - self._started_at < RESTART_S:
                self._drop(len(batch))
                return
            log.warning("restarting the span export process")
            self._reap()
            self.start()
        try:
            data = pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, TypeError, AttributeError, RecursionError):
            log.exception("could not hand the spans of %d requests to the export process; dropped", len(batch))
            return
        if len(self._buffer) + len(data) > MAX_BUFFER_BYTES:
            self._drop(len(batch))
            return
        self._buffer += data
        if self._child is not None and self._loop is None:  # else: written when the pipe has room
            self._write(watch=True)

    def _write(self, watch: bool) -> None:
        """Write what the pipe takes now; `watch`: wait on the event loop for room for the rest."""
        buffer = self._buffer
        while buffer:
            try:
                written = os.write(self._fd, buffer)
            except BlockingIOError:
                break
            except OSError as exc:  # BrokenPipeError: the child is gone
                self._gone(exc)
                return
            del buffer[:written]
        if buffer and watch and self._loop is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop (a script): the next send() or shutdown() writes the rest
                return
            loop.add_writer(self._fd, self._write, True)
            self._loop = loop
        elif not buffer and self._loop is not None:
            self._unwatch()

    def _unwatch(self) -> None:
        if self._loop is not None:
            self._loop.remove_writer(self._fd)
            self._loop = None

    def _gone(self, exc: OSError) -> None:
        self._unwatch()
        self._buffer.clear()
        if not self._lost:
            self._lost = True
            code = self._child.poll() if self._child is not None else None
            log.error("the span export process ended (exit status %s: %s); spans are dropped until it restarts",
                      code, exc)

    def _reap(self) -> None:
        """Forget the ended (or out of step) child, after making sure it ended."""
        child, self._child = self._child, None
        if child is None:
            return
        self._unwatch()
        assert child.stdin is not None
        with contextlib.suppress(OSError):
            child.stdin.close()
        if child.poll() is None:
            child.kill()
        child.wait()

    def _drop(self, requests: int) -> None:
        before, self._dropped = self._dropped, self._dropped + requests
        if before == 0 or before // 10_000 != self._dropped // 10_000:
            log.warning("the span export process is behind or gone: the spans of %d requests dropped so far",
                        self._dropped)

    def flush(self, timeout_s: float) -> bool:
        """Hand what waits to the child now (which exports on its batch processor's schedule)."""
        deadline = time.monotonic() + timeout_s
        return self._drain(deadline)

    def _drain(self, deadline: float) -> bool:
        """Write the buffer out, waiting for room in the pipe until `deadline`; True when empty."""
        if self._child is None:
            if not self._buffer:
                return True
            self.start()
        self._unwatch()
        while self._buffer and not self._lost:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            select.select([], [self._fd], [], remaining)
            self._write(watch=False)
        return not self._buffer

    def shutdown(self, timeout_s: float) -> None:
        """Hand the child what waits, close its stdin and wait for its last export (the server is
        stopping: this blocks, for `timeout_s` at most)."""
        deadline = time.monotonic() + timeout_s
        if not self._drain(deadline):
            log.warning("the spans of some requests did not reach the export process within %.0f s", timeout_s)
        child = self._child
        if child is None:
            return
        assert child.stdin is not None
        with contextlib.suppress(OSError):  # nothing is buffered there (writes go to the fd)
            child.stdin.close()
        try:
            child.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            log.warning("the span export process did not finish its export within %.0f s; stopped", timeout_s)
            child.kill()
            child.wait()


def main(argv: Sequence[str] | None = None) -> int:
    """The child: read pickled batches from stdin until it closes, export their spans."""
    # Only the end of stdin stops it (see the module's docstring).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="specroute export process: %(levelname)s %(name)s: %(message)s")
    protocol, version = argv if argv is not None else sys.argv[1:]
    export = LocalExport(make_exporter(protocol, make_resource(version), InstrumentationScope("specroute", version)))
    stdin = sys.stdin.buffer
    try:
        while True:
            try:
                batch = pickle.load(stdin)
            except EOFError:
                break
            export.send(batch)
    except (pickle.UnpicklingError, ValueError, TypeError, AttributeError, ImportError):
        # The proxy only writes whole pickles; anything else means the stream is out of step.
        log.exception("unreadable data from the proxy; exporting what arrived and stopping")
        return 1
    finally:
        export.shutdown(SHUTDOWN_S)
    return 0


if __name__ == "__main__":
    sys.exit(main())
