"""A range-capable HTTP server over a folder, on 127.0.0.1, that counts what it sends: the server
`tests/test_remote_checkpoint.py` and `scripts/bench_remote.py` read remote checkpoints from.

    with serve(folder) as server:      # server.url("src") -> "http://127.0.0.1:PORT/src"
        ...                            # server.log: one Request per file request (path, Range, status, body bytes)

Python's own http.server ignores Range; this one answers `Range: bytes=A-B` with 206 and a
Content-Range, and also answers the three Hugging Face Hub routes HfFileSystem uses (repo info,
tree listing, /hub/NAME/resolve/REV/FILE) for repositories `hub/NAME` = the folder NAME, so hf://
can be read without the network. Knobs for failures: `ranges=False` (answer every GET with the
whole file, HTTP 200), `fail_next=N` (503 to the next N file requests), `truncate=True` (half of
each range body, then close), `hidden={names}` (404), `latency=seconds` (before each answer).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


@dataclasses.dataclass(frozen=True)
class Request:
    path: str          # relative to the served folder
    range: str | None  # the Range header
    status: int
    sent: int          # body bytes written


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body are two writes: no delayed-ACK stall between them

    def log_message(self, *args):  # quiet
        pass

    def do_GET(self):  # noqa: N802 (http.server's naming)
        server: RangeServer = self.server
        if server.latency:
            time.sleep(server.latency)
        path = unquote(urlparse(self.path).path)
        if match := re.fullmatch(r"/api/models/hub/([^/]+)/revision/([^/]+)", path):
            return self._json({"id": f"hub/{match[1]}", "sha": "0" * 40})
        if match := re.fullmatch(r"/api/models/hub/([^/]+)/tree/([^/]+)/?", path):
            folder = server.root / match[1]
            return self._json([{"type": "file", "path": f.name, "size": f.stat().st_size, "oid": "0" * 40}
                               for f in sorted(folder.iterdir()) if f.is_file() and f.name not in server.hidden])
        if match := re.fullmatch(r"/hub/([^/]+)/resolve/[^/]+/(.+)", path):
            path = f"/{match[1]}/{match[2]}"
        self._file(server, path.lstrip("/"))

    def _json(self, value) -> None:
        body = json.dumps(value).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _file(self, server: RangeServer, relative: str) -> None:
        requested = self.headers.get("Range")
        with server.lock:
            failing = server.fail_next > 0
            server.fail_next -= failing
        path = server.root / relative
        if failing or relative.split("/")[-1] in server.hidden or not path.is_file():
            status = 503 if failing else 404
            server.record(Request(relative, requested, status, 0))
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        match = re.fullmatch(r"bytes=(\d+)-(\d+)", requested or "")
        size = path.stat().st_size
        if match and server.ranges:
            start, end = int(match[1]), min(int(match[2]), size - 1)
            status = 206
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        else:
            start, end, status = 0, size - 1, 200
            self.send_response(200)
        self.send_header("Content-Length", str(end - start + 1))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        length = end - start + 1
        if server.truncate and status == 206:
            length //= 2
            self.close_connection = True
        entry = server.record(Request(relative, requested, status, length))  # before the client can see it all
        sent = 0
        try:
            with open(path, "rb") as handle:
                handle.seek(start)
                while sent < length:
                    chunk = handle.read(min(1 << 20, length - sent))
                    self.wfile.write(chunk)
                    sent += len(chunk)
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):  # the client refused the rest (a 200 it will not read)
            self.close_connection = True
            server.amend(entry, Request(relative, requested, status, sent))


class RangeServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, root: Path):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.root = Path(root)
        self.log: list[Request] = []
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """Back to a well-behaved server with an empty log."""
        self.clear_log()
        self.ranges, self.fail_next, self.truncate, self.latency = True, 0, False, 0.0
        self.hidden: set[str] = set()

    def clear_log(self) -> None:
        with self.lock:
            self.log.clear()
            self.generation = getattr(self, "generation", 0) + 1

    def record(self, request: Request) -> tuple[int, int]:
        """Log a request before its answer is sent, so that a client which has read the answer
        always finds it logged; returns where (the log's generation, the index)."""
        with self.lock:
            self.log.append(request)
            return self.generation, len(self.log) - 1

    def amend(self, where: tuple[int, int], request: Request) -> None:
        """Correct a logged request (bytes actually sent), unless the log was reset since."""
        with self.lock:
            if where[0] == self.generation:
                self.log[where[1]] = request

    def url(self, name: str = "") -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/{name}"

    @property
    def hub_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def sent(self) -> int:
        return sum(request.sent for request in self.log)

    def handle_error(self, request, client_address):  # a client that hung up early: expected here
        pass


@contextlib.contextmanager
def serve(root: Path):
    server = RangeServer(root)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
