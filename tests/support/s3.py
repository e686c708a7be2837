"""S3 for tests: a real endpoint on loopback (moto in server mode, spoken to over HTTP by s3fs), which
conftest's session fixture ``s3`` starts, and a slow store: a loopback HTTP proxy in front of it that
holds chosen requests for a while before it forwards them, as a slow network or an overloaded store
does, or until a test lets them go (a request in flight while something else happens on the store). The
store's own semantics (conditional writes, errors) are the endpoint's; only the timing changes."""

from __future__ import annotations

import http.client
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from tests.support.dist import free_port

SECRET = "zeroray-test-secret-never-written"  # tests look for it in everything a save writes


@contextmanager
def moto_bucket() -> Iterator[dict[str, Any]]:
    """A moto server on a free loopback port with a fresh bucket, the AWS credentials in the environment
    meanwhile. Yields {"bucket": the bucket's URL, "options": fsspec storage options for it}."""
    import s3fs
    from moto.server import ThreadedMotoServer

    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")}
    os.environ.update(AWS_ACCESS_KEY_ID="zeroray-test", AWS_SECRET_ACCESS_KEY=SECRET, AWS_DEFAULT_REGION="us-east-1")
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    options = {"endpoint_url": f"http://127.0.0.1:{port}", "key": "zeroray-test", "secret": SECRET}
    try:
        bucket = f"zeroray-test-{uuid.uuid4().hex[:12]}"
        s3fs.S3FileSystem(**options).mkdir(bucket)
        yield {"bucket": f"s3://{bucket}", "options": options}
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length"}


class SlowProxy:
    """Forwards every request to ``upstream``; one for which ``hold(method, path)`` is true is held first,
    the n-th such request for ``delays_s[n]`` seconds (the last one for any after), or, with ``gate``, until
    the gate is set (at most 60 s). ``held`` counts the held requests that have arrived (``arrived(n)`` waits
    for n)."""

    def __init__(self, upstream: str, hold: Callable[[str, str], bool], delays_s: Sequence[float] = (),
                 gate: threading.Event | None = None) -> None:
        if not delays_s and gate is None:
            raise ValueError("SlowProxy holds requests for delays_s or until a gate is set: give one")
        self.upstream = urlsplit(upstream)
        self.hold = hold
        self.delays_s = list(delays_s)
        self.gate = gate
        self.held = 0
        self._arrivals = threading.Condition()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def arrived(self, n: int, timeout_s: float) -> bool:
        """Wait until ``n`` held requests have arrived (they are being held now, or were)."""
        with self._arrivals:
            return self._arrivals.wait_for(lambda: self.held >= n, timeout_s)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:  # quiet
                pass

            def _forward(self) -> None:
                if "chunked" in self.headers.get("Transfer-Encoding", ""):
                    raise NotImplementedError("SlowProxy forwards bodies with a Content-Length only")
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if proxy.hold(self.command, urlsplit(self.path).path):
                    with proxy._arrivals:
                        delay = proxy.delays_s[min(proxy.held, len(proxy.delays_s) - 1)] if proxy.delays_s else 0
                        proxy.held += 1
                        proxy._arrivals.notify_all()
                    if proxy.gate is not None:
                        proxy.gate.wait(60)  # the test lets it go once what it wants in between has happened
                    else:
                        time.sleep(delay)  # the slow store itself, not a test's synchronisation
                conn = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=60)
                try:
                    conn.request(self.command, self.path, body=body, headers=dict(self.headers.items()))
                    resp = conn.getresponse()
                    data = resp.read()
                    self.send_response(resp.status, resp.reason)
                    for k, v in resp.getheaders():
                        if k.lower() not in _HOP_BY_HOP:
                            self.send_header(k, v)
                    length = resp.getheader("Content-Length") if self.command == "HEAD" else str(len(data))
                    self.send_header("Content-Length", length or "0")
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                finally:
                    conn.close()

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward

        return Handler

    @contextmanager
    def running(self) -> Iterator[SlowProxy]:
        thread = threading.Thread(target=self._server.serve_forever, name="slow-s3-proxy", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._server.shutdown()
            self._server.server_close()
            thread.join()
