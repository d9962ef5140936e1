"""Ending abandoned attempts on SGLang servers at once (`POST /abort_request`).

The proxy abandons an attempt when its client leaves, when the first token does not come in time
(it fails over), when a stream falls silent past the chunk timeout, and when a drain ends.
Closing the connection is all vLLM needs: it aborts at once. SGLang notices a gone client only
when it next looks: 2 s after a started stream's last write, every 4 s before its first output
(docs/twin.md, "Disconnects"), and meanwhile the request keeps its slot or its place in the
queue, and its prefill and decode go on for no one. So every SGLang attempt of one choice
carries an engine request id (`rid`) the proxy knows, and an abandoned one is aborted by it.

SGLang's scheduler aborts every request whose rid *begins* with the one aborted, its own abort of
a gone client's request included. A rid the proxy makes is a fresh uuid's 32 hex digits, the
shape SGLang gives its own (and the response's id; `resp_` before it for a Responses request);
one a client chose is accepted only from MIN_RID_CHARS characters (proxy/relay.py refuses a
shorter one), so it begins no id the proxy or SGLang made unless it is that id. Two clients' own
long ids can still begin one another ("...-request-1", "...-request-10"): clients that choose
rids must make them unique, as SGLang asks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Callable

import aiohttp

from proxy.pools import Instance
from proxy.upstream import UPSTREAM_ERRORS, Upstream

log = logging.getLogger("specroute.aborts")

MIN_RID_CHARS = 32
"""The shortest engine request id a client may choose: as long as the ids SGLang and the proxy
make, so it begins no other request's id unless it is that id."""
ABORT_TIMEOUT_S = 5.0
"""An abort unanswered by then is given up: the server then frees the slot when it next looks."""
ABORT_ERRORS: tuple[type[BaseException], ...] = (*UPSTREAM_ERRORS, RuntimeError)
"""What ends an abort unsent: RuntimeError too, the upstream session being closed (stopping)."""
CLOSE_WAIT_S = 1.0
"""How long stopping waits for the aborts in flight."""
MAX_PENDING = 256
"""Aborts in flight at most; past it one is dropped (counted): a server that stopped answering
must not gather a task per abandoned request."""


def new_rid() -> str:
    return uuid.uuid4().hex


class Aborts:
    """Sends the aborts, each in a task of its own, bounded in number and time. `counted(pool,
    outcome)` is told each one's end: sent (the server took it), refused (it answered an error:
    its admin key, say), failed (no answer), dropped (too many in flight)."""

    def __init__(self, upstream: Upstream, counted: Callable[[str, str], None]) -> None:
        self.upstream = upstream
        self.counted = counted
        self.pending: set[asyncio.Task[None]] = set()
        self._refusal_logged: set[str] = set()

    def abort(self, instance: Instance, rid: str, authorization: str | None) -> None:
        """Abort `rid` on `instance`, sent with the attempt's own credentials, without waiting."""
        if len(self.pending) >= MAX_PENDING:
            self.counted(instance.pool, "dropped")
            return
        task = asyncio.get_running_loop().create_task(self._send(instance, rid, authorization))
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    async def _send(self, instance: Instance, rid: str, authorization: str | None) -> None:
        headers = {"content-type": "application/json"}
        if authorization is not None:
            headers["authorization"] = authorization
        timeout = aiohttp.ClientTimeout(total=ABORT_TIMEOUT_S)
        body = json.dumps({"rid": rid}).encode()
        try:
            async with self.upstream.session.post(
                instance.url + "/abort_request", data=body, headers=headers, timeout=timeout, allow_redirects=False
            ) as response:
                status = response.status
        except ABORT_ERRORS as exc:
            log.debug("abort of an abandoned request on %s failed: %s", instance.name, type(exc).__name__)
            self.counted(instance.pool, "failed")
            return
        if status < 300:
            self.counted(instance.pool, "sent")
            return
        self.counted(instance.pool, "refused")
        if instance.url not in self._refusal_logged:
            self._refusal_logged.add(instance.url)
            log.warning(
                "%s refused POST /abort_request (HTTP %d): abandoned requests hold their slots there until "
                "SGLang next checks their clients (2-4 s); with --admin-api-key set, SGLang takes the abort "
                "only with that key",
                instance.name,
                status,
            )

    async def close(self) -> None:
        """Let the aborts in flight (those of the requests a drain cut, say) finish for at most
        CLOSE_WAIT_S, then cancel the rest (the upstream session closes after)."""
        if self.pending:
            await asyncio.wait(list(self.pending), timeout=CLOSE_WAIT_S)
        for task in list(self.pending):
            task.cancel()
        if self.pending:
            await asyncio.gather(*self.pending, return_exceptions=True)
