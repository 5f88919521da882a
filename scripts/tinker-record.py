#!/usr/bin/env python3
"""Records a Tinker service's wire as JSONL: a reverse proxy (stdlib only) on 127.0.0.1:LISTEN in front of
UPSTREAM_HOST:UPSTREAM_PORT that appends one line per exchange to LOG, bodies whole: JSON as JSON, anything
else (protobuf) as base64. `holo-runtime/tests/fixtures/tinker/*.jsonl` were recorded with it:

    scripts/tinker-record.py 18801 127.0.0.1 18800 exchanges.jsonl &
    holo train ... --backend tinker --base-url http://127.0.0.1:18801

The API key header is recorded as `tml-…` (its prefix only)."""
import base64, http.client, json, sys, threading
from http.server import ThreadingHTTPServer, BaseHTTPRequestHandler

LISTEN, UP_HOST, UP_PORT, LOG = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
lock = threading.Lock()
KEPT = ("content-type", "content-encoding", "accept")


def body(raw, ctype):
    if not raw:
        return None
    if "json" in (ctype or ""):
        try:
            return {"json": json.loads(raw)}
        except ValueError:
            pass
    return {"base64": base64.b64encode(raw).decode()}


class Proxy(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def relay(self):
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length", "connection")}
        upstream = http.client.HTTPConnection(UP_HOST, UP_PORT, timeout=600)
        upstream.request(self.command, self.path, body=raw or None, headers=headers)
        reply = upstream.getresponse()
        answer = reply.read()
        seen = {k.lower(): v for k, v in headers.items() if k.lower() in KEPT}
        if "x-api-key" in {k.lower() for k in headers}:
            seen["x-api-key"] = "tml-…"
        with lock, open(LOG, "a") as log:
            log.write(json.dumps({
                "method": self.command, "path": self.path, "headers": seen,
                "request": body(raw, self.headers.get("Content-Type")),
                "status": reply.status, "content_type": reply.getheader("Content-Type"),
                "response": body(answer, reply.getheader("Content-Type")),
            }) + "\n")
        self.send_response(reply.status)
        for k, v in reply.getheaders():
            if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    do_GET = do_POST = do_PUT = do_DELETE = relay

    def log_message(self, *args):
        pass


ThreadingHTTPServer(("127.0.0.1", LISTEN), Proxy).serve_forever()
