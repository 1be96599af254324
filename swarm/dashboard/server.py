"""The dashboard's HTTP server: the page's static assets and ``/api/state``, from the standard library.

Runs ``http.server.ThreadingHTTPServer`` in a daemon thread of the dashboard process; the poller (in the
asyncio loop of the main thread) hands it each new state through a :class:`StateBox`, already encoded, so
a request only copies bytes under a lock.
"""

from __future__ import annotations

import json
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Tuple

from hivemind.utils import get_logger

__all__ = ["StateBox", "DashboardServer", "STATIC_DIR"]

logger = get_logger(__name__)
STATIC_DIR = Path(__file__).resolve().parent / "static"
_CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
}


class StateBox:
    """The latest ``/api/state`` as JSON bytes (and as the dict it came from, for the metrics), shared between
    the poller and the HTTP threads. A state put here is never changed afterwards: the next one replaces it."""

    def __init__(self, initial: Mapping[str, Any]):
        self._lock = threading.Lock()
        self._body = b""
        self._state: Mapping[str, Any] = {}
        self.put(initial)

    def put(self, state: Mapping[str, Any]) -> None:
        body = json.dumps(state, allow_nan=False, separators=(",", ":")).encode()
        with self._lock:
            self._body, self._state = body, state

    def get(self) -> bytes:
        with self._lock:
            return self._body

    def latest(self) -> Mapping[str, Any]:
        """The latest state itself (read it, do not change it)."""
        with self._lock:
            return self._state


def _load_assets(static_dir: Path) -> Dict[str, Tuple[bytes, str]]:
    """Every asset, read once at start: URL path -> (body, content type). Nothing outside the directory
    can be asked for, since only these paths exist."""
    assets = {}
    for path in sorted(static_dir.iterdir()):
        if path.is_file() and path.suffix in _CONTENT_TYPES:
            assets[f"/static/{path.name}"] = (path.read_bytes(), _CONTENT_TYPES[path.suffix])
    if "/static/index.html" not in assets:
        raise FileNotFoundError(f"the dashboard's page is missing: no index.html in {static_dir}")
    assets["/"] = assets["/static/index.html"]
    return assets


def _handler(box: StateBox, assets: Mapping[str, Tuple[bytes, str]]) -> type:
    class Handler(BaseHTTPRequestHandler):
        server_version = "swarm-dashboard"
        timeout = 30  # seconds a client may take to send its request: a stalled one does not keep a thread forever

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            path = self.path.split("?", 1)[0]
            if path == "/api/state":
                self._send(HTTPStatus.OK, box.get(), "application/json", cache=False)
            elif path in assets:
                body, content_type = assets[path]
                self._send(HTTPStatus.OK, body, content_type, cache=True)
            else:
                self._send(HTTPStatus.NOT_FOUND, b'{"error": "not found"}', "application/json", cache=False)

        def _send(self, status: HTTPStatus, body: bytes, content_type: str, cache: bool) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "max-age=60" if cache else "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            logger.debug(f"{self.address_string()} {format % args}")  # one line per poll would flood the log

    return Handler


class DashboardServer:
    """Serves the page at ``http://host:port/`` in a daemon thread; ``port=0`` takes any free port
    (``url`` tells which). Raises ``OSError`` at construction when the address cannot be listened on."""

    def __init__(self, box: StateBox, host: str, port: int, static_dir: Path = STATIC_DIR):
        self._httpd = ThreadingHTTPServer((host, port), _handler(box, _load_assets(static_dir)))
        self._httpd.daemon_threads = True
        self._thread: Optional[threading.Thread] = None

    @property
    def url(self) -> str:
        address, port = self._httpd.server_address[:2]
        host = address.decode() if isinstance(address, (bytes, bytearray)) else address  # str for an IP socket
        return f"http://{host if ':' not in host else f'[{host}]'}:{port}/"

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.2}, name="dashboard-http", daemon=True
        )
        self._thread.start()

    def shutdown(self) -> None:
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join(timeout=5)
        self._httpd.server_close()
