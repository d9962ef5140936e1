"""The span export process's pipe, on its own (the spans it exports are read back from Jaeger in
test_obs_traces.py): batches never block the event loop, a dead reader is noticed on the loop,
and nothing goes anywhere after shutdown."""

from __future__ import annotations

import asyncio
import os
import sys

import uvloop

from proxy.telemetry.export_process import ProcessExport

BATCH = [b"x" * 4096] * 64  # any picklable batch: the pipe's mechanics are under test
NOT_READING = [sys.executable, "-c", "import time; time.sleep(120)"]


def test_a_full_pipe_waits_on_the_loop_and_a_dead_reader_is_noticed_there() -> None:
    export = ProcessExport("http/protobuf", "test")
    export.command = NOT_READING  # a child that never reads: the pipe fills

    async def fill_then_kill() -> None:
        export.start()
        for _ in range(100):  # 64 KiB of pipe, then the rest waits (25 batches of 256 KiB)
            export.send(BATCH)
            if export.watching:
                break
        assert export.watching and export.waiting_bytes > 0
        assert export.child is not None
        export.child.kill()
        for _ in range(1000):  # the loop's writer callback meets the broken pipe
            if export.lost:
                break
            await asyncio.sleep(0.01)
        assert export.lost and not export.watching and export.waiting_bytes == 0
        dropped = export.dropped_requests
        assert dropped > 0 and dropped % len(BATCH) == 0  # the batches that waited for the pipe
        export.send(BATCH)  # within RESTART_S of the start: dropped, no new child
        assert export.lost and export.dropped_requests == dropped + len(BATCH)

    uvloop.run(fill_then_kill())
    export.shutdown(5)
    child = export.child
    assert child is not None and child.returncode is not None


def test_after_shutdown_nothing_is_sent_or_started() -> None:
    """Requests cancelled at the end of the drain end after telemetry stopped: their batch must
    not go to a closed (maybe reused) fd, nor start a new child."""
    export = ProcessExport("http/protobuf", "test")
    export.start()
    child = export.child
    assert child is not None
    assert os.getpgid(child.pid) == child.pid  # its own group: a terminal's Ctrl-C is the proxy's
    export.shutdown(10)
    assert child.returncode == 0
    export.send(BATCH)
    export.start()
    assert export.child is child and export.waiting_bytes == 0


def test_a_child_that_cannot_export_is_reported_with_its_status(caplog) -> None:  # type: ignore[no-untyped-def]
    """An exporter the child cannot build (here an unknown protocol; in life an OTEL_* setting
    the SDK refuses) ends it at once: the next batch reports it, with its exit status."""
    export = ProcessExport("no-such-protocol", "test")
    export.start()
    child = export.child
    assert child is not None
    assert child.wait(60) != 0
    export.send(BATCH)
    assert export.lost
    assert any(f"exit status {child.returncode}" in r.getMessage() for r in caplog.records)
    export.shutdown(5)


def test_a_child_that_cannot_start_leaves_the_proxy_serving_untraced() -> None:
    """Popen failing (EAGAIN under a pids limit, ENOMEM) at start or restart: logged, batches
    dropped, no exception on the request path; the next start after the wait may succeed."""
    export = ProcessExport("http/protobuf", "test")
    export.command = ["/nonexistent/python"]
    export.start()
    assert export.child is None and export.lost
    export.send(BATCH)  # within the wait: dropped
    assert export.child is None and export.waiting_bytes == 0
    export.shutdown(1)
