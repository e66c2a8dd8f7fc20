"""The prefill server's bootstrap server, and how a decode server asks it for directions.

SGLang's router in PD mode sends each request to a prefill and a decode server with
``bootstrap_host``, ``bootstrap_port`` (``--disaggregation-bootstrap-port`` of the prefill
server) and a random ``bootstrap_room``. The decode server asks the bootstrap server at that
address where the prefill scheduler takes requests for KV (``GET /route``, SGLang's route), then
talks to that scheduler directly. ``GET /health`` tells a decode server waiting for KV whether
the prefill server is still there.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.error import URLError
from urllib.request import urlopen

__all__ = ["BootstrapServer", "advertised_host", "is_alive", "lookup_route"]

logger = logging.getLogger("sgl.disaggregation")

WILDCARD_HOSTS = ("", "0.0.0.0", "::")


def advertised_host(host: str) -> str:
    """The address peers reach this machine at: ``host`` itself, or for a wildcard bind the
    address of the interface that routes outwards."""
    if host not in WILDCARD_HOSTS:
        return host
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))  # no packet is sent
            return str(probe.getsockname()[0])
        except OSError:
            return "127.0.0.1"


class BootstrapServer:
    """HTTP on ``host:port`` in a daemon thread: ``GET /route`` answers ``route`` (where the
    prefill scheduler takes requests for KV), ``GET /health`` answers 200."""

    def __init__(self, host: str, port: int, route: dict[str, Any]) -> None:
        body = json.dumps(route).encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                path = self.path.split("?", 1)[0]
                if path == "/route":
                    self._reply(200, body)
                elif path == "/health":
                    self._reply(200, b"{}")
                else:
                    self._reply(404, b'{"error": "unknown path; try /route or /health"}')

            def _reply(self, status: int, data: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                logger.debug("bootstrap: " + format, *args)

        try:
            self.httpd = ThreadingHTTPServer((host, port), Handler)
        except OSError as exc:
            raise ValueError(f"--disaggregation-bootstrap-port {port}: cannot listen on "
                             f"{host}:{port} ({exc.strerror or exc}); pick a free port") from None
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="sgl-bootstrap",
                                       daemon=True)
        self.thread.start()
        logger.info("bootstrap server on %s:%d", host, port)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def lookup_route(host: str, port: int, timeout: float) -> dict[str, Any]:
    """The route a prefill server's bootstrap server gives; ConnectionError saying what failed."""
    url = f"http://{_url_host(host)}:{port}/route"
    try:
        with urlopen(url, timeout=timeout) as response:  # noqa: S310 (http only)
            route = json.loads(response.read())
    except (URLError, OSError, ValueError) as exc:
        raise ConnectionError(f"cannot reach the prefill server's bootstrap server at "
                              f"{host}:{port} ({getattr(exc, 'reason', exc)}); check "
                              "bootstrap_host/bootstrap_port and that the prefill server runs "
                              "with --disaggregation-mode prefill") from None
    if not isinstance(route, dict) or "endpoint" not in route:
        raise ConnectionError(f"{host}:{port} is not an sgl bootstrap server (its /route "
                              f"answered {str(route)[:100]!r})")
    return route


def is_alive(host: str, port: int, timeout: float = 1.0) -> bool:
    """Whether the bootstrap server at ``host:port`` answers ``/health``."""
    try:
        with urlopen(f"http://{_url_host(host)}:{port}/health", timeout=timeout) as response:  # noqa: S310
            return bool(response.status == 200)
    except (URLError, OSError):
        return False


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
