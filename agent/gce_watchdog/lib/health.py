"""A liveness endpoint for platforms that probe over HTTP (Cloud Run services, Kubernetes).

The HTTP twin of systemd's watchdog (``lib/sdnotify.py``: ``WATCHDOG=1`` on progress, killed
after ``WatchdogSec=`` without): the loop calls :meth:`Liveness.beat` on progress, and
``GET /healthz`` (or ``/``) answers **200** while the last progress is younger than ``stall_s``,
**503** once it is older, so the platform's liveness probe restarts a stuck process (Cloud Run:
"Any response between 200 and 400 is a success", docs "Configure container health checks",
https://cloud.google.com/run/docs/configuring/healthchecks). The body is one JSON object:
``{"status": "ok"|"stalled", "last_progress_s": AGE, "stall_s": LIMIT}``.

``GET /metrics``, where the server was given a ``metrics`` callable, answers 200 with what it
returns: Prometheus text format (the poller's delivery states, docs/poller.md, "Delivery").

The server is a stdlib ``ThreadingHTTPServer`` in a daemon thread: it answers no other path
(404) and no other method (501, http.server's default), reads no request body, and each request
is handled in a thread of its own with a short socket timeout, so a slow client holds nothing.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HEALTH_PATHS = ("/healthz", "/")
METRICS_PATH = "/metrics"
METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # Prometheus' text format
REQUEST_TIMEOUT_S = 5.0


def health_answer(age_s: float, stall_s: float) -> tuple[int, dict[str, object]]:
    """The status code and body for a last progress ``age_s`` ago (pure)."""
    ok = age_s <= stall_s
    body: dict[str, object] = {
        "status": "ok" if ok else "stalled",
        "last_progress_s": round(max(0.0, age_s), 3),
        "stall_s": stall_s,
    }
    return (200 if ok else 503), body


class Liveness:
    """When the loop last made progress; ``beat`` is cheap (one clock read, one store)."""

    def __init__(self, stall_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.stall_s = stall_s
        self.clock = clock
        self._last = clock()

    def beat(self) -> None:
        self._last = self.clock()

    def answer(self) -> tuple[int, dict[str, object]]:
        return health_answer(self.clock() - self._last, self.stall_s)


class HealthServer:
    """``GET /healthz`` on ``(address, port)`` from a daemon thread; a context manager.
    ``port`` 0 picks a free one (``self.port`` says which)."""

    def __init__(
        self,
        liveness: Liveness,
        address: str,
        port: int,
        metrics: Callable[[], str] | None = None,
    ) -> None:
        live = liveness

        class Handler(BaseHTTPRequestHandler):
            timeout = REQUEST_TIMEOUT_S

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == METRICS_PATH and metrics is not None:
                    try:
                        text = metrics()
                    except Exception as e:  # (the ledger's errors): the scrape fails, not us
                        self.send_error(503, f"{type(e).__name__}")
                        return
                    self._answer(200, text.encode(), METRICS_TYPE)
                    return
                if path not in HEALTH_PATHS:
                    self.send_error(404)
                    return
                code, body = live.answer()
                self._answer(code, (json.dumps(body, sort_keys=True) + "\n").encode())

            def _answer(self, code: int, data: bytes, ctype: str = "application/json") -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: object) -> None:
                return  # a probe every few seconds is not news

        self._server = ThreadingHTTPServer((address, port), Handler)
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="health", daemon=True
        )

    def start(self) -> HealthServer:
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()  # (blocks until serve_forever returns: only once started)
            self._thread.join(timeout=10)
        self._server.server_close()

    def __enter__(self) -> HealthServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
