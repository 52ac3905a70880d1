"""HTTP transport benchmark: prints figures, asserts nothing.

1. Parser throughput (MB/s): the Cython framing and multipart parsers against
   their pure-Python references (loom/_native/py*.py), on the same bytes.
2. Server throughput (requests/s, latency percentiles): Loom against a
   baseline in the same run, the standard library's ThreadingHTTPServer with
   the same two routes, for GET /healthz and a 1 MiB chunked POST, at 1 and
   32 concurrent keep-alive clients. Both servers run in their own process;
   the load generator is one selectors-driven process.

    python bench/http.py [--seconds 3] [--skip-servers]
"""

import os
import sys

# This file is named http.py: drop its folder from the path so `http` is the stdlib's.
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:] = [ROOT] + [p for p in sys.path if os.path.abspath(p or ".") != HERE]

import argparse  # noqa: E402
import http.server  # noqa: E402
import json  # noqa: E402
import selectors  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

from loom._native import framing, multipart, pyframing, pymultipart  # noqa: E402

MiB = 1 << 20


# -- 1. parsers ------------------------------------------------------------------

def chunked(body, size):
    out = bytearray()
    for i in range(0, len(body), size):
        piece = body[i:i + size]
        out += b"%x\r\n%b\r\n" % (len(piece), piece)
    return bytes(out + b"0\r\n\r\n")


def framing_inputs():
    get = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nUser-Agent: bench\r\nAccept: */*\r\n\r\n"
    body = os.urandom(MiB)
    head = b"POST /bench/sink HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\n"
    return {
        "10k pipelined GETs": (get * 10_000, 65536),
        "1 MiB chunked, 4 KiB chunks": (head + chunked(body, 4096), 65536),
        "1 MiB chunked, 64 KiB chunks": (head + chunked(body, 65536), 65536),
        "1 MiB Content-Length": (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % MiB + body, 65536),
    }


def parse_stream(mod, data, read_size):
    p = mod.RequestParser(16384, 64 * MiB)
    n = 0
    for i in range(0, len(data), read_size):
        p.feed(data[i:i + read_size])
        while p.next_request() is not None:
            n += 1
    return n


def multipart_inputs():
    boundary = "benchboundary7MA4YWxkTrZu0gW"

    def body(parts):
        out = bytearray()
        for i, data in enumerate(parts):
            out += (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"pkg/f{i}.loombc\"\r\n"
                    f"Content-Type: application/octet-stream\r\n\r\n").encode() + data + b"\r\n"
        return bytes(out + f"--{boundary}--\r\n".encode())

    ctype = f"multipart/form-data; boundary={boundary}"
    return {
        "64 parts x 16 KiB": (body([os.urandom(16384) for _ in range(64)]), ctype),
        "2000 parts x 100 B": (body([os.urandom(100) for _ in range(2000)]), ctype),
        "1 part x 8 MiB": (body([os.urandom(8 * MiB)]), ctype),
    }


def rate(fn, nbytes, min_seconds=0.5):
    runs, started = 0, time.perf_counter()
    while True:
        fn()
        runs += 1
        elapsed = time.perf_counter() - started
        if elapsed >= min_seconds and runs >= 3:
            return nbytes * runs / elapsed / 1e6


def bench_parsers():
    print("## Parser throughput (MB/s, higher is better)\n")
    print(f"{'input':34} {'cython':>10} {'python':>10} {'ratio':>7}")
    for name, (data, read_size) in framing_inputs().items():
        assert parse_stream(framing, data, read_size) == parse_stream(pyframing, data, read_size)
        fast = rate(lambda: parse_stream(framing, data, read_size), len(data))
        slow = rate(lambda: parse_stream(pyframing, data, read_size), len(data))
        print(f"framing: {name:25} {fast:10.1f} {slow:10.1f} {fast / slow:6.1f}x")
    for name, (body, ctype) in multipart_inputs().items():
        assert len(multipart.parse(body, ctype, max_parts=5000)) == len(pymultipart.parse(body, ctype, max_parts=5000))
        fast = rate(lambda: multipart.parse(body, ctype, max_parts=5000), len(body))
        slow = rate(lambda: pymultipart.parse(body, ctype, max_parts=5000), len(body))
        print(f"multipart: {name:23} {fast:10.1f} {slow:10.1f} {fast / slow:6.1f}x")
    print()


# -- 2. servers ------------------------------------------------------------------

def serve_loom(port):
    from loom.http import Response
    from loom.server import Config, Server

    def sink(server, request):
        return Response.json({"bytes": len(request.body)})

    server = Server(Config(listen=[f"tcp:127.0.0.1:{port}"], request_body_bytes=4 * MiB),
                    extra_routes=[("POST", "/bench/sink", sink)])
    server.start()
    sys.exit(server.serve_forever())


class StdlibHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # tuned as fairly as the stdlib allows: no Nagle stalls,
    wbufsize = -1                   # and head and body leave in one write

    def log_message(self, *args):
        pass

    def reply(self, body):
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self.reply(b'{"status":"ready"}')

    def do_POST(self):
        # The stdlib does not decode chunked bodies; this is the minimal decoder it would need.
        total = 0
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b""):
                        pass
                    break
                total += len(self.rfile.read(size))
                self.rfile.readline()
        else:
            total = len(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        self.reply(json.dumps({"bytes": total}).encode())


def serve_stdlib(port):
    http.server.ThreadingHTTPServer.daemon_threads = True
    http.server.ThreadingHTTPServer(("127.0.0.1", port), StdlibHandler).serve_forever()


class Client:
    """One keep-alive connection sending the same request over and over."""

    def __init__(self, port, request):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.setblocking(False)
        self.request = request
        self.latencies = []
        self.start()

    def start(self):
        self.out = memoryview(self.request)
        self.inbuf = b""
        self.began = time.perf_counter()

    def on_write(self):
        sent = self.sock.send(self.out)
        self.out = self.out[sent:]

    def on_read(self):
        """True when a whole response has arrived."""
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionError("server closed the connection")
        self.inbuf += data
        end = self.inbuf.find(b"\r\n\r\n")
        if end < 0:
            return False
        head = self.inbuf[:end].lower()
        length = int(head.split(b"content-length:")[1].split(b"\r\n")[0])
        if len(self.inbuf) < end + 4 + length:
            return False
        if not self.inbuf.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"unexpected response: {self.inbuf[:80]!r}")
        self.latencies.append(time.perf_counter() - self.began)
        return True


def load(port, request, concurrency, seconds):
    sel = selectors.DefaultSelector()
    clients = [Client(port, request) for _ in range(concurrency)]
    for c in clients:
        sel.register(c.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, c)
    done, started = 0, time.perf_counter()
    deadline = started + seconds
    while time.perf_counter() < deadline:
        for key, mask in sel.select(1.0):
            c = key.data
            if mask & selectors.EVENT_WRITE and c.out:
                c.on_write()
                if not c.out:
                    sel.modify(c.sock, selectors.EVENT_READ, c)
            if mask & selectors.EVENT_READ and c.on_read():
                done += 1
                c.start()
                sel.modify(c.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, c)
    elapsed = time.perf_counter() - started
    for c in clients:
        c.sock.close()
    lat = sorted(x for c in clients for x in c.latencies)
    return done / elapsed, lat[len(lat) // 2] * 1000, lat[int(len(lat) * 0.99)] * 1000


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def start(kind):
    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--serve", kind, str(port)], stderr=subprocess.DEVNULL)
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port)).close()
            return proc, port
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"{kind} server did not start")


def bench_servers(seconds):
    get = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n"
    post = (b"POST /bench/sink HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\n"
            + chunked(os.urandom(MiB), 65536))
    print("## Server throughput (keep-alive clients; 2 cores shared by server and load generator)\n")
    print(f"{'scenario':30} {'server':8} {'req/s':>9} {'MB/s':>8} {'p50 ms':>8} {'p99 ms':>8}")
    for kind in ("loom", "stdlib"):
        proc, port = start(kind)
        try:
            for name, request, size in (("GET /healthz", get, 0), ("POST 1 MiB chunked", post, MiB)):
                for concurrency in (1, 32):
                    rps, p50, p99 = load(port, request, concurrency, seconds)
                    label = f"{name}, {concurrency} client{'s' if concurrency > 1 else ''}"
                    mbs = f"{rps * size / 1e6:8.1f}" if size else f"{'':8}"
                    print(f"{label:30} {kind:8} {rps:9.0f} {mbs} {p50:8.2f} {p99:8.2f}")
        finally:
            proc.terminate()
            proc.wait(10)
    print()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=3.0, help="duration of each load run")
    ap.add_argument("--skip-servers", action="store_true", help="only measure the parsers")
    ap.add_argument("--serve", nargs=2, metavar=("KIND", "PORT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        kind, port = args.serve
        (serve_loom if kind == "loom" else serve_stdlib)(int(port))
        return
    bench_parsers()
    if not args.skip_servers:
        bench_servers(args.seconds)


if __name__ == "__main__":
    main()
