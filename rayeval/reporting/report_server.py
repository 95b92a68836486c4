"""``rayeval view STORE``: the report's app served on 127.0.0.1, each view computed when the
page asks for it (``reporting.report.Report.view``), so a store too big for one file is read
only as far as a view shows it: the board's figures once, a column's replicates when its
marks or a difference are asked for, one cell's records when its items are."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qsl, urlsplit

from rayeval.errors import RayevalError
from rayeval.reporting.report import Report
from rayeval.reporting.report_page import embedded_json, page


def serve(report: Report, port: int, title: str, ready=None) -> None:
    """Serve until interrupted; ``ready(url)`` is called once the socket listens."""
    server = make_server(report, port, title)
    if ready is not None:
        ready(f"http://127.0.0.1:{server.server_address[1]}/")
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()


def make_server(report: Report, port: int, title: str) -> ThreadingHTTPServer:
    """A server on 127.0.0.1:``port`` (0: a free one). Views that read replicates (marks,
    paired differences: seconds each on a big store) take one lock and those that read records
    (items, a cell) another, so a reader's items never wait behind a board's marks; within
    each kind, one at a time (their caches are not shared between threads)."""
    locks = {name: threading.Lock() for name in ("replicates", "records")}
    shell = page(None, title).encode("utf-8")
    # what every page asks for first, made before the address is printed (the board of a
    # 100,000-cell store: ~2 s that would otherwise delay its first paint)
    ready = {name: embedded_json(report.view(name, {})).encode("utf-8")
             for name in ("meta", "board")}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):                                   # noqa: N802 - the stdlib's name
            url = urlsplit(self.path)
            if url.path in ("/", "/index.html"):
                return self._send(200, "text/html; charset=utf-8", shell)
            if not url.path.startswith("/api/"):
                return self._json(404, {"error": f"no such page: {url.path}"})
            name, query = url.path[len("/api/"):], dict(parse_qsl(url.query))
            if name in ready and not query:
                return self._send(200, "application/json", ready[name])
            try:
                with locks["records" if name in ("items", "cell") else "replicates"]:
                    body = embedded_json(report.view(name, query))
            except RayevalError as e:
                return self._json(400, {"error": str(e)})
            return self._send(200, "application/json", body.encode("utf-8"))

        def _json(self, status: int, value) -> None:
            self._send(status, "application/json", json.dumps(value).encode("utf-8"))

        def _send(self, status: int, kind: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format, *args):               # quiet: one line per request
            pass

    return ThreadingHTTPServer(("127.0.0.1", port), Handler)
