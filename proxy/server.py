"""Running the app under uvicorn (httptools + uvloop), with a graceful drain on SIGTERM.

On SIGTERM or SIGINT: /ready turns 503 at once, the listening socket closes, running requests
(streams included) get SPECROUTE_DRAIN_TIMEOUT_S to finish, then what is left is cancelled
(each cancelled request closes its upstream request) and the process exits.
"""

from __future__ import annotations

import asyncio
import copy
import gc
import logging
import socket
from collections.abc import Callable
from types import FrameType
from typing import Any, cast

import uvicorn
from uvicorn.config import LOGGING_CONFIG

from fleet import native
from proxy import __version__
from proxy.app import SpecrouteApp
from proxy.auth import warn_if_open
from proxy.connection import Limits, guarded_protocol
from proxy.settings import Settings, SettingsError
from proxy.telemetry import SpecrouteTelemetry
from proxy.telemetry.logs import log_formatter

log = logging.getLogger("specroute")


def build_app(settings: Settings) -> SpecrouteApp:
    """The app with telemetry from the settings (traces, metrics, request log)."""
    telemetry = SpecrouteTelemetry(settings, __version__)
    app = SpecrouteApp(settings, telemetry)
    telemetry.watch_snapshot(app.router.snapshot)
    holding = app.router.holding
    if holding is not None:
        holding.on_release = telemetry.hold_released
        telemetry.watch_held(lambda: len(holding.held))
    return app


# The cyclic collector's thresholds (Python's default is 700, 10, 10: a young collection about
# once per request here, each pass costing tens of microseconds, and older ones in proportion).
GC_THRESHOLDS = (7000, 20, 20)


def tune_gc() -> None:
    """Once started: the objects of start-up (modules, settings, the app) move out of the
    collector's sight (gc.freeze), and collections run ten times less often. A request's
    garbage is freed by reference counting; the collector only finds cycles. In the proxy
    benchmark this raised c64 throughput by about a fifth (docs/benchmarks.md)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, telling the app it is draining the moment a stop signal arrives."""

    def __init__(
        self, config: uvicorn.Config, app: SpecrouteApp, on_ready: Callable[[int], None] | None = None
    ) -> None:
        super().__init__(config)
        self.specroute = app
        self.on_ready = on_ready
        """Called with the port once the app has started and the socket is listening (the demo's
        banner; the port is the bound one, which SPECROUTE_PORT=0 leaves to the system)."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if self.started and sockets:
            # uvicorn says where it listens only for a socket it bound itself ("Uvicorn running
            # on http://host:port"): said here for the one `serve` bound, in its words.
            self._log_started_message(sockets)
        tune_gc()
        if self.started and self.on_ready is not None and sockets:
            self.on_ready(sockets[0].getsockname()[1])

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.specroute.draining:
            self.specroute.draining = True
            settings = self.specroute.settings
            if settings.drain_delay_s > 0:
                log.info(
                    "stop signal %s: still listening for %g s (ready: false), then draining for up to %.0f s",
                    sig,
                    settings.drain_delay_s,
                    settings.drain_timeout_s,
                )
            else:
                log.info("stop signal %s: draining for up to %.0f s", sig, settings.drain_timeout_s)
            holding = self.specroute.router.holding
            if holding is not None and getattr(self, "loop", None) is not None:
                # Held requests go now, to be served within the drain rather than cut at its end.
                self.loop.call_soon_threadsafe(holding.release_all, "release-drain")
            if settings.drain_delay_s > 0 and getattr(self, "loop", None) is not None:
                # Keep listening (answering /ready with 503, every answer closing its connection)
                # so load balancers see not-ready before connections are refused; a second signal
                # ends the delay (uvicorn's drain then, a third SIGINT its forced exit).
                self.loop.call_soon_threadsafe(
                    self.loop.call_later, settings.drain_delay_s, super().handle_exit, sig, frame
                )
                return
        super().handle_exit(sig, frame)


def uvicorn_config(app: SpecrouteApp, settings: Settings) -> uvicorn.Config:
    limits = Limits(settings.header_timeout_s, settings.body_timeout_s, settings.max_header_bytes)
    # uvicorn annotates both timeouts `int`, but only hands them to loop.call_later and
    # asyncio.timeout, which take fractional seconds: the settings' floats pass through unrounded.
    keep_alive_s = cast(int, settings.keep_alive_timeout_s)
    drain_s = cast(int, settings.drain_timeout_s)
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http=guarded_protocol(limits),  # httptools, with deadlines and a header size limit
        # No WebSocket: the API has none, and uvicorn's handler logged two lines with the
        # client's address for each upgrade a client asked (a log flood at will).
        ws="none",
        timeout_keep_alive=keep_alive_s,
        lifespan="on",
        log_level=settings.log_level,
        log_config=log_config(settings.log_level, settings.log_format),
        access_log=False,  # the telemetry's JSON request log replaces it
        server_header=False,
        # Clients that read it (Node's fetch, undici) close an idle connection before the proxy
        # does, instead of sending a request on one it is closing (`Keep-Alive`, RFC 9112 A.1.2).
        headers=[("keep-alive", f"timeout={int(settings.keep_alive_timeout_s)}")],
        proxy_headers=False,  # no X-Forwarded-* rewriting: the client address is the peer's
        timeout_graceful_shutdown=drain_s,
        backlog=4096,
    )


class DrainEnd(logging.Filter):
    """uvicorn says ERROR when its graceful shutdown times out and it cancels the running
    requests; that is the drain timeout doing its job (each client was told `shutting_down`),
    so it is a warning, in the proxy's words."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.ERROR and "timeout graceful shutdown exceeded" in str(record.msg):
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.msg = (
                "drain timeout (SPECROUTE_DRAIN_TIMEOUT_S) reached: %s running request(s) cut, told shutting_down"
            )
        return True


class ClientsOwnErrors(logging.Filter):
    """uvicorn warns of each request its parser refuses ("Invalid HTTP request received."): the
    client's doing, answered 400, and a line per request a client could write at will. Kept at
    DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.WARNING and record.msg == "Invalid HTTP request received.":
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


THIRD_PARTY_LOGGERS = ("opentelemetry", "httpx", "httpcore", "asyncio")


def log_config(level: str, fmt: str = "text") -> dict[str, Any]:
    """uvicorn's logging configuration, with the proxy's own "specroute" loggers written the
    same way at the same level (without a handler of their own only warnings reached stderr,
    through Python's last-resort handler), each line with its time and logger (uvicorn's own
    format has neither: beside the request log's timed JSON lines, an ejection or a drain could
    not be placed in time), as text or as JSON (`fmt`, SPECROUTE_LOG_FORMAT)."""
    config = copy.deepcopy(LOGGING_CONFIG)
    config["formatters"]["default"] = {"()": log_formatter, "fmt": fmt}
    # Propagating too: the root logger has no handler of its own here (no line is written twice),
    # and whoever adds one (a test's log capture, an embedding application) still gets them.
    config["loggers"]["specroute"] = {"handlers": ["default"], "level": level.upper(), "propagate": True}
    # The libraries' warnings (the OpenTelemetry SDK's, the HTTP client's, the event loop's)
    # went out bare through Python's last-resort handler: written the same way here.
    for library in THIRD_PARTY_LOGGERS:
        config["loggers"][library] = {"handlers": ["default"], "level": "WARNING", "propagate": True}
    config.setdefault("filters", {})["drain_end"] = {"()": DrainEnd}
    config["filters"]["clients_own_errors"] = {"()": ClientsOwnErrors}
    config["loggers"]["uvicorn.error"]["filters"] = ["drain_end", "clients_own_errors"]
    return config


def listening_socket(host: str, port: int) -> socket.socket:
    """The proxy's listening socket, bound before anything else starts: an address it cannot
    have (a port in use, a host that is not this machine's) stops start-up with one line naming
    the settings. Left to uvicorn, the bind came after the app's startup, its error after
    "Application startup complete". Bound as uvicorn's own `bind_socket` binds: IPv6 for a host
    with a colon, else IPv4; SO_REUSEADDR; inheritable."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family=family, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        reason = exc.strerror or str(exc)
        raise SettingsError(
            f"SPECROUTE_HOST / SPECROUTE_PORT (or --port): cannot listen on {host}:{port}: {reason}"
        ) from None
    sock.set_inheritable(True)
    return sock


def serve(settings: Settings, on_ready: Callable[[int], None] | None = None) -> None:
    """Run until stopped (blocks). Settings must already be valid (proxy.settings.load_settings)."""
    settings.require_upstreams()
    listener = listening_socket(settings.host, settings.port)
    app = build_app(settings)
    config = uvicorn_config(app, settings)  # configures logging
    warn_if_open(settings, app.access)
    if settings.profile:
        log.info("the router's step costs start from profile %s, then are learned", settings.profile)
    else:
        log.info(
            "the router's step costs start from the generic prior (no SPECROUTE_PROFILE), then are learned;"
            " `specroute profile` measures a seed for this fleet"
        )
    path = native.status()
    if path.compiled:
        log.info("the routing decision runs compiled (%s)", path.reason)
    else:
        log.warning("the routing decision runs from source, about 2.5x slower than compiled (%s)", path.reason)
    DrainingServer(config, app, on_ready).run(sockets=[listener])
