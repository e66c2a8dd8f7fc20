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
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.error import HTTPError, URLError
from urllib.request import HTTPRedirectHandler, build_opener

__all__ = ["BootstrapServer", "advertised_host", "is_alive", "lookup_route"]

logger = logging.getLogger("sgl.disaggregation")

WILDCARD_HOSTS = ("", "0.0.0.0", "::")
#: the largest /route answer a decode server reads (an sgl answer is about 150 bytes)
MAX_ROUTE_BYTES = 16 * 1024
#: the only endpoints a route may name: a TCP host and port (not ipc:// or inproc://)
_TCP_ENDPOINT = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]{1,253}):[0-9]{1,5}")


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


class _NoRedirects(HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None  # a redirect is an error: the answer must come from the host asked


_opener = build_opener(_NoRedirects)


def lookup_route(host: str, port: int, timeout: float) -> dict[str, Any]:
    """The route a prefill server's bootstrap server gives; ConnectionError saying what failed.

    ``host`` comes from a client (checked against ``--disaggregation-prefill-host`` first), so
    the lookup follows no redirect, reads at most :data:`MAX_ROUTE_BYTES`, never quotes the
    answer back, and takes only a ``tcp://`` endpoint."""
    url = f"http://{_url_host(host)}:{port}/route"
    not_sgl = ConnectionError(f"{host}:{port} is not an sgl bootstrap server (its /route "
                              "answer is not one); check bootstrap_host/bootstrap_port")
    try:
        with _opener.open(url, timeout=timeout) as response:
            if response.status != 200:
                raise not_sgl
            data = response.read(MAX_ROUTE_BYTES + 1)
    except HTTPError:
        raise not_sgl from None
    except (URLError, OSError) as exc:
        raise ConnectionError(f"cannot reach the prefill server's bootstrap server at "
                              f"{host}:{port} ({getattr(exc, 'reason', exc)}); check "
                              "bootstrap_host/bootstrap_port and that the prefill server runs "
                              "with --disaggregation-mode prefill") from None
    try:
        route = json.loads(data) if len(data) <= MAX_ROUTE_BYTES else None
    except ValueError:
        route = None
    endpoint = route.get("endpoint") if isinstance(route, dict) else None
    if not isinstance(endpoint, str) or not _TCP_ENDPOINT.fullmatch(endpoint):
        raise not_sgl
    return route


def is_alive(host: str, port: int, timeout: float = 1.0) -> bool:
    """Whether the bootstrap server at ``host:port`` answers ``/health``."""
    try:
        with _opener.open(f"http://{_url_host(host)}:{port}/health", timeout=timeout) as response:
            return bool(response.status == 200)
    except (URLError, OSError):
        return False


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
