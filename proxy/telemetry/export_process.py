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
import math
import os
import pickle
import select
import signal
import site
import subprocess
import sys
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from proxy.telemetry.logs import log_formatter
from proxy.telemetry.spans import RequestTrace
from proxy.telemetry.tracing import LocalExport, make_exporter, make_resource

log = logging.getLogger("specroute.telemetry")

MAX_BUFFER_BYTES = 16 << 20
"""Pickled batches waiting for room in the pipe (the child is behind), at most (about 6,000
requests); beyond it batches are dropped, as the batch processor drops spans beyond its queue."""
RESTART_S = 10.0
"""After the child ended unexpectedly, the next batch this long after its start starts another;
the wait doubles (to MAX_RESTART_S) while children end within LIVED_S of their start."""
MAX_RESTART_S = 320.0
LIVED_S = 60.0
SHUTDOWN_S = 10.0
"""The child's own limit for its last export at end of file."""
_ROOT = str(Path(__file__).resolve().parents[2])


class ProcessExport:
    """The proxy's side: pickles batches into the child's stdin without ever blocking the event
    loop (what the pipe does not take waits in a bounded queue of chunks, written when there is
    room)."""

    def __init__(self, protocol: str, version: str, log_format: str = "text") -> None:
        # -P: not the working directory's `proxy` package, the one this process runs (below).
        self.command = [sys.executable, "-P", "-m", "proxy.telemetry.export_process", protocol, version, log_format]
        self._child: subprocess.Popen[bytes] | None = None
        self._fd = -1
        self._started_at = -math.inf
        self._restart_s = RESTART_S
        self._chunks: deque[list[Any]] = deque()
        """[pickled bytes not yet written, requests in them] per batch."""
        self._buffered = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        """The loop watching the pipe for room, while chunks wait."""
        self._dropped = 0
        self._lost = False
        self._closed = False

    @property
    def child(self) -> subprocess.Popen[bytes] | None:
        """The export process, once started."""
        return self._child

    @property
    def waiting_bytes(self) -> int:
        """Pickled batches not yet in the pipe."""
        return self._buffered

    @property
    def watching(self) -> bool:
        """Whether the event loop waits for room in the pipe."""
        return self._loop is not None

    @property
    def dropped_requests(self) -> int:
        """Requests whose spans were dropped on this side of the pipe (the child behind, gone or
        not started, or a batch that could not be pickled); the child's own drops (its
        exporter's queue full, the collector unreachable) are in its log lines."""
        return self._dropped

    @property
    def lost(self) -> bool:
        """The child ended unexpectedly and was not replaced yet."""
        return self._lost

    def start(self) -> None:
        if self._child is not None or self._closed:
            return
        self._started_at = time.monotonic()
        env = dict(os.environ)
        if _ROOT not in site.getsitepackages():  # a source checkout: the child imports it too
            env["PYTHONPATH"] = os.pathsep.join(filter(None, (_ROOT, os.environ.get("PYTHONPATH"))))
        # Its own process group: a terminal's Ctrl-C reaches the proxy, which closes the pipe
        # when it is done, and not the child, which would die with the spans it holds.
        try:
            child = subprocess.Popen(self.command, stdin=subprocess.PIPE, env=env, process_group=0)
        except OSError:  # EAGAIN, ENOMEM: the proxy serves untraced; tried again after the wait
            log.exception("could not start the span export process; spans are dropped until it starts")
            self._lost = True
            return
        assert child.stdin is not None
        self._child, self._fd, self._lost = child, child.stdin.fileno(), False
        os.set_blocking(self._fd, False)
        self._write(watch=True)  # batches sent before the start

    def send(self, batch: Sequence[RequestTrace]) -> None:
        if self._closed:
            return
        child = self._child
        if child is not None and not self._lost and child.poll() is not None:
            # Ended by itself (an exporter that cannot be built from the OTEL_* settings, the
            # OOM killer...): seen here, with its status, even before a write fails.
            self._gone(f"exit status {child.returncode}")
        if self._lost and not self._restart():
            self._drop(len(batch))
            return
        try:
            data = pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # whatever a value's pickling raises: the batch's spans, not the request
            log.exception("could not hand the spans of %d requests to the export process; dropped", len(batch))
            self._dropped += len(batch)
            return
        if self._buffered + len(data) > MAX_BUFFER_BYTES:
            self._drop(len(batch))
            return
        self._chunks.append([memoryview(data), len(batch)])
        self._buffered += len(data)
        if self._child is not None and self._loop is None:  # else: written when the pipe has room
            self._write(watch=True)

    def _restart(self) -> bool:
        """Start a new child if the last one started long enough ago; True if one runs."""
        now = time.monotonic()
        if now - self._started_at < self._restart_s:
            return False
        lived = self._reap()
        self._restart_s = RESTART_S if lived >= LIVED_S else min(self._restart_s * 2, MAX_RESTART_S)
        log.warning("restarting the span export process")
        self.start()
        return self._child is not None

    def _write(self, watch: bool) -> None:
        """Write what the pipe takes now; `watch`: wait on the event loop for room for the rest."""
        chunks = self._chunks
        while chunks:
            try:
                written = os.write(self._fd, chunks[0][0])
            except BlockingIOError:
                break
            except OSError as exc:  # BrokenPipeError: the child is gone
                self._gone(exc)
                return
            self._buffered -= written
            if written == len(chunks[0][0]):
                chunks.popleft()
            else:
                chunks[0][0] = chunks[0][0][written:]
        if chunks and watch and self._loop is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop (a script): the next send() or shutdown() writes the rest
                return
            loop.add_writer(self._fd, self._write, True)
            self._loop = loop
        elif not chunks and self._loop is not None:
            self._unwatch()

    def _unwatch(self) -> None:
        if self._loop is not None:
            self._loop.remove_writer(self._fd)
            self._loop = None

    def _gone(self, why: OSError | str) -> None:
        self._unwatch()
        self._drop_buffered()
        if not self._lost:
            self._lost = True
            log.error("the span export process ended (%s); spans are dropped until it restarts", why)

    def _drop_buffered(self) -> None:
        """Forget the batches waiting for the pipe."""
        if self._chunks:
            self._drop(sum(requests for _, requests in self._chunks))
        self._chunks.clear()
        self._buffered = 0

    def _reap(self) -> float:
        """Forget the ended (or out of step) child, after making sure it ended; how long it lived."""
        child, self._child = self._child, None
        if child is None:
            return 0.0
        self._unwatch()
        assert child.stdin is not None
        with contextlib.suppress(OSError):
            child.stdin.close()
        if child.poll() is None:
            child.kill()
        child.wait()
        if child.returncode:
            log.warning("the span export process exited with status %s", child.returncode)
        return time.monotonic() - self._started_at

    def _drop(self, requests: int) -> None:
        before, self._dropped = self._dropped, self._dropped + requests
        if before == 0 or before // 10_000 != self._dropped // 10_000:
            log.warning(
                "the span export process is behind or gone: the spans of %d requests dropped so far", self._dropped
            )

    def flush(self, timeout_s: float) -> bool:
        """Hand what waits to the child now (which exports on its batch processor's schedule);
        False if some did not go, or the child is gone."""
        return self._drain(time.monotonic() + timeout_s) and not self._lost

    def _drain(self, deadline: float) -> bool:
        """Write the waiting chunks out, waiting for room in the pipe until `deadline` (off the
        event loop's watch: call it on the loop's thread, or after detach()); True when empty."""
        if self._child is None:
            if not self._chunks or self._closed:
                return not self._chunks
            self.start()
        self._unwatch()
        poller = select.poll()  # not select(): the pipe's fd may be past 1023 after a restart
        poller.register(self._fd, select.POLLOUT)
        while self._chunks and not self._lost:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            poller.poll(remaining * 1000)
            self._write(watch=False)
        return not self._chunks

    def detach(self) -> None:
        """Stop watching the pipe from the event loop (before shutdown() runs in another thread)."""
        self._unwatch()

    def shutdown(self, timeout_s: float) -> None:
        """Hand the child what waits, close its stdin and wait for its last export, for
        `timeout_s` at most; what comes after is dropped."""
        deadline = time.monotonic() + timeout_s
        if not self._drain(deadline):
            log.warning("the spans of some requests did not reach the export process within %.0f s", timeout_s)
            self._drop_buffered()
        self._closed = True
        child = self._child
        if child is None:
            return
        assert child.stdin is not None
        with contextlib.suppress(OSError):  # nothing is buffered there (writes go to the fd)
            child.stdin.close()
        self._fd = -1
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
    protocol, version, *rest = argv if argv is not None else sys.argv[1:]
    # Its lines as the proxy's own (SPECROUTE_LOG_FORMAT), marked as this process's.
    handler = logging.StreamHandler()
    handler.setFormatter(log_formatter(rest[0] if rest else "text", source="span-export-process"))
    logging.basicConfig(level=logging.WARNING, handlers=[handler])
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
