"""A real S3 API on loopback for the tests: moto's server, optionally behind a proxy that
answers some requests with 503 SlowDown (a transient error every client must retry)."""

from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MotoServer:
    """``enforce_auth``: check credentials as AWS does (moto's IAM knows none, so every request
    is denied)."""

    def __init__(self, enforce_auth: bool = False):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ)
        if enforce_auth:
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = "0"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            env=env)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError("moto's server exited; is moto[server] installed?")
                time.sleep(0.2)
        self.stop()
        raise RuntimeError("moto's server did not open its port within 60 s")

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


class FlakyProxy:
    """Forwards to ``upstream``; every ``every``-th request gets 503 SlowDown instead (never
    with ``every=0``), and a GET of an object's bytes waits ``delay_s`` first: a slow
    store, for the prefetch benchmark."""

    def __init__(self, upstream_port: int, every: int = 3, delay_s: float = 0.0):
        self.failed = 0
        self.forwarded = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                        if size == 0:
                            self.rfile.readline()
                            return b"".join(chunks)
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _any(self):
                body = self._body()
                with proxy.lock:
                    proxy.count += 1
                    fail = every > 0 and proxy.count % every == 0
                if delay_s and self.command == "GET" and "list-type" not in self.path \
                        and "prefix=" not in self.path:
                    time.sleep(delay_s)         # an object's bytes, not a listing
                if fail:
                    proxy.failed += 1
                    payload = (b"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>SlowDown"
                               b"</Code><Message>Please reduce your request rate.</Message>"
                               b"</Error>")
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in ("transfer-encoding", "content-length")}
                headers["Content-Length"] = str(len(body))
                conn = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=30)
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                proxy.forwarded += 1
                self.send_response(resp.status)
                length = str(len(data))
                for k, v in resp.getheaders():
                    if k.lower() == "content-length" and self.command == "HEAD":
                        length = v              # a HEAD tells the object's size, with no body
                    elif k.lower() not in ("transfer-encoding", "content-length", "connection",
                                           "server", "date"):
                        self.send_header(k, v)
                self.send_header("Content-Length", length)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self.lock = threading.Lock()
        self.count = 0
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()
