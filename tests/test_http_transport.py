"""HTTP/1.1 transport end to end: real servers, real sockets, real clients."""

import json
import os
import signal
import socket
import subprocess
import threading
import time

import pytest

from conftest import read_response, recv_all
from loom.http import Deferred, Response, Stream


def error_of(body):
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


# -- routes only the thread server has: they expose transport behaviour ------

def echo(server, request):
    return Response(200, request.body, "application/octet-stream")


class Producer:
    """GET /stream: n chunks of `size` bytes, produced only while there is credit."""

    def __init__(self):
        self.produced = 0
        self.max_buffered = 0
        self.closed = None
        self.closed_at = None
        self.done = threading.Event()

    def __call__(self, server, request):
        params = request.params({"n", "size"})
        n, size = int(params["n"]), int(params["size"])
        stream = Stream(content_type="application/octet-stream")
        conn = next(c for c in server.connections if c.request is request)

        def pump():
            while stream.ready and self.produced < n:
                stream.send(bytes([self.produced % 251]) * size)
                self.produced += 1
                self.max_buffered = max(self.max_buffered, len(conn.out))
            if self.produced == n:
                stream.finish()
                self.done.set()

        def closed(reason):
            self.closed, self.closed_at = reason, time.monotonic()
            self.done.set()

        stream.on_ready = pump
        stream.on_close = closed
        server.loop.call_soon(pump)
        return stream


class Slow:
    """GET /slow: a Deferred resolved after a delay; records cancellation."""

    def __init__(self, delay=0.5):
        self.delay = delay
        self.cancelled = threading.Event()

    def __call__(self, server, request):
        deferred = Deferred()
        deferred.on_cancel = self.cancelled.set
        server.loop.call_later(self.delay, deferred.resolve, Response.json({"slow": True}))
        return deferred


@pytest.fixture
def echo_server(thread_server):
    return thread_server([("POST", "/echo", echo)], request_body_bytes=1 << 20)


# -- discovery over both transports ------------------------------------------

@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_discovery_endpoints(shared_server, transport):
    for path in ("/healthz", "/readyz"):
        status, headers, body = shared_server.request("GET", path, transport=transport)
        assert (status, json.loads(body)) == (200, {"status": "ready"})
        assert headers["content-type"] == "application/json"
    status, _, body = shared_server.request("GET", "/v1/models", transport=transport)
    assert status == 200 and json.loads(body) == {"object": "list", "data": []}
    status, _, body = shared_server.request("GET", "/v1/status", transport=transport)
    doc = json.loads(body)
    assert status == 200
    assert doc["server"]["listeners"] == [f"tcp:127.0.0.1:{shared_server.port}", f"unix:{shared_server.unix_path}"]
    assert doc["connections"]["open"] >= 1 and doc["registrations"] == []


def test_head_mirrors_get_without_body(shared_server):
    sock = shared_server.raw()
    sock.sendall(b"HEAD /healthz HTTP/1.1\r\nHost: x\r\n\r\nGET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    status, headers, body = read_response(sock, head_only=True)
    assert status == 200 and body == b"" and headers["content-length"] == "18"
    assert read_response(sock)[2] == b'{"status":"ready"}'  # the HEAD response carried no body bytes
    sock.close()


def test_unknown_route_wrong_method_and_unexpected_body(shared_server):
    status, _, body = shared_server.request("GET", "/v1/nothing")
    assert status == 404 and error_of(body)["code"] == "route_not_found"
    status, headers, body = shared_server.request("DELETE", "/v1/models")
    assert status == 405 and headers["allow"] == "GET, HEAD"
    assert error_of(body) == {"message": "DELETE is not allowed on /v1/models", "type": "invalid_request_error",
                              "param": None, "code": "method_not_allowed"}
    status, _, body = shared_server.request("GET", "/healthz", body=b"{}")
    assert status == 400 and error_of(body)["code"] == "unexpected_body"


# -- keep-alive and pipelining -----------------------------------------------

@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_keep_alive_reuses_one_connection(shared_server, transport):
    conn = shared_server.connection(transport)
    for _ in range(5):
        conn.request("GET", "/healthz")
        resp = conn.getresponse()
        assert resp.status == 200 and resp.read() == b'{"status":"ready"}'
    sock = conn.sock
    conn.request("GET", "/readyz")
    conn.getresponse().read()
    assert conn.sock is sock  # http.client would have reconnected had the server closed
    conn.close()


def test_pipelined_requests_answer_in_order(shared_server):
    sock = shared_server.raw()
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
                 b"POST /healthz HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"
                 b"GET /v1/models HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"
                 b"GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    statuses = [read_response(sock)[0] for _ in range(4)]
    assert statuses == [200, 405, 200, 200]
    assert recv_all(sock) == b""  # Connection: close honoured after the last
    sock.close()


def test_http10_closes_unless_keep_alive(shared_server):
    sock = shared_server.raw()
    sock.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
    data = recv_all(sock)
    assert data.startswith(b"HTTP/1.1 200") and b"Connection: close" in data
    sock.close()


# -- framing rules on the wire --------------------------------------------------

WIRE_REJECTS = [
    (b"POST /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
     400, "ambiguous_framing"),
    (b"POST /healthz HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nxyz\r\n", 400, "malformed_chunk"),
    (b"POST /healthz HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n", 501, "unsupported_transfer_encoding"),
    (b"POST /healthz HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 4\r\n\r\n",
     417, "expectation_failed"),
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * 20000 + b"\r\n\r\n", 431, "header_too_large"),
    (b"GET /healthz HTTP/1.1\r\n\r\n", 400, "invalid_host"),
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", 400, "invalid_content_length"),
]


@pytest.mark.parametrize("data,status,code", WIRE_REJECTS, ids=[r[2] for r in WIRE_REJECTS])
@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_framing_rejections_close_with_error_envelope(shared_server, transport, data, status, code):
    sock = shared_server.raw(transport)
    sock.sendall(data)
    got_status, headers, body = read_response(sock)
    assert got_status == status and headers["connection"] == "close"
    assert error_of(body)["code"] == code
    assert recv_all(sock) == b""
    sock.close()
    assert shared_server.request("GET", "/healthz")[0] == 200


def test_oversize_content_length_rejected_before_the_body_is_sent(live_server):
    server = live_server("--request_body_bytes", "1000")
    sock = server.raw()
    sock.sendall(b"POST /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 1001\r\n\r\n")
    status, headers, body = read_response(sock)  # answered without a single body byte sent
    assert status == 413 and error_of(body)["code"] == "body_too_large"
    sock.close()
    metrics = server.request("GET", "/metrics")[2].decode()
    assert "loom_http_body_limit_rejections_total 1" in metrics


def test_oversize_chunked_upload_rejected_as_soon_as_exceeded(live_server):
    server = live_server("--request_body_bytes", "100000")
    sock = server.raw()
    sock.sendall(b"POST /healthz HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
    sent = 0
    chunk = b"%x\r\n%b\r\n" % (40000, b"z" * 40000)
    while sent < 3:  # the third chunk's size line crosses the bound
        sock.sendall(chunk)
        sent += 1
    status, _, body = read_response(sock)
    assert status == 413 and error_of(body)["code"] == "body_too_large"
    sock.close()


def test_truncated_body_then_disconnect_leaves_server_healthy(shared_server):
    sock = shared_server.raw()
    sock.sendall(b"POST /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nonly-part")
    sock.close()
    # A client that half-closes after a truncated body hears why before the close:
    # fewer bytes than Content-Length, a chunked body cut mid-chunk, a head cut short.
    for partial in (b"POST /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nonly-part",
                    b"POST /healthz HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n10\r\nabc",
                    b"POST /healthz HTTP/1.1\r\nHost: x\r\nContent-"):
        sock = shared_server.raw()
        sock.sendall(partial)
        sock.shutdown(socket.SHUT_WR)
        answer = recv_all(sock)
        sock.close()
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400 "), answer
        assert json.loads(body)["error"]["code"] == "incomplete_request"   # and nothing was routed
    assert shared_server.request("GET", "/healthz")[0] == 200
    status, _, body = shared_server.request("GET", "/v1/requests")
    assert [r["path"] for r in json.loads(body)["data"]] == ["/v1/requests"]


@pytest.mark.parametrize("size", [0, 1, 4095, 65536, 700_001])
def test_chunked_and_length_bodies_decode_exactly(echo_server, size):
    body = os.urandom(size)
    conn = echo_server.connection()
    conn.request("POST", "/echo", body=iter([body[i:i + 9999] for i in range(0, size, 9999)]), encode_chunked=True,
                 headers={"Transfer-Encoding": "chunked"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.read() == body
    conn.request("POST", "/echo", body=body)
    resp = conn.getresponse()
    assert resp.status == 200 and resp.read() == body
    conn.close()


def test_curl_chunked_upload_and_limits(echo_server, tmp_path):
    payload = tmp_path / "payload.bin"
    payload.write_bytes(os.urandom(300_000))
    out = subprocess.run(["curl", "-sS", "--fail-with-body", "-H", "Expect:", "-H", "Transfer-Encoding: chunked",
                          "--data-binary", f"@{payload}", f"{echo_server.url}/echo"], capture_output=True, timeout=30)
    assert out.returncode == 0 and out.stdout == payload.read_bytes()
    big = tmp_path / "big.bin"
    big.write_bytes(b"x" * (2 << 20))
    out = subprocess.run(["curl", "-sS", "--fail-with-body", "-H", "Expect:", "--data-binary", f"@{big}",
                          f"{echo_server.url}/echo"], capture_output=True, timeout=30)
    assert out.returncode == 22 and error_of(out.stdout)["code"] == "body_too_large"
    out = subprocess.run(["curl", "-sS", "--unix-socket", echo_server.unix_path, "--data-binary", "@" + str(payload),
                          "-H", "Expect:", "http://localhost/echo"], capture_output=True, timeout=30)
    assert out.stdout == payload.read_bytes()


# -- output credit, slow readers and disconnects ------------------------------

def test_slow_reader_stalls_only_its_own_producer(thread_server):
    producer = Producer()
    ts = thread_server([("GET", "/stream", producer)], output_buffer_bytes=64 << 10)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)  # before connect: a small window from the start
    sock.settimeout(10)
    sock.connect((ts.host, ts.port))
    sock.sendall(b"GET /stream?n=2000&size=4096 HTTP/1.1\r\nHost: x\r\n\r\n")
    time.sleep(1.0)  # the client reads nothing meanwhile
    stalled_at = producer.produced
    assert 0 < stalled_at < 2000, "the producer must pause when the reader does"
    assert producer.max_buffered <= (64 << 10) + 4096 + 16
    for _ in range(20):  # others are served while the stream is stalled
        assert ts.request("GET", "/healthz")[0] == 200
    assert producer.produced == stalled_at
    status, _, body = read_response(sock)  # now read it all
    assert status == 200 and len(body) == 2000 * 4096
    assert body[:4096] == b"\0" * 4096 and body[-4096:] == bytes([1999 % 251]) * 4096
    assert producer.done.is_set() and producer.closed is None
    sock.close()


@pytest.mark.parametrize("reader", ["reads", "leaves"])
def test_on_sent_runs_once_the_answer_has_left_or_the_client_has(thread_server, reader):
    """Response.on_sent (what admin's management-observation credit hangs on) waits for a
    slow reader to take the whole body, or for it to go away; never before."""
    body = bytes(range(256)) * (128 << 10)          # 32 MiB: more than the kernel's socket buffers
    sent = threading.Event()

    def big(server, request):
        response = Response(200, body, "application/octet-stream")
        response.on_sent = sent.set
        return response

    ts = thread_server([("GET", "/big", big)])
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
    sock.settimeout(10)
    sock.connect((ts.host, ts.port))
    sock.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
    time.sleep(0.5)
    assert not sent.is_set(), "the body is still in the server's buffer"
    if reader == "reads":
        status, _, data = read_response(sock)
        assert status == 200 and data == body
    else:
        sock.close()
    assert sent.wait(5)
    sock.close()
    assert ts.call(lambda: len(ts.server.connections)) == 0 or reader == "reads"


def test_disconnect_mid_stream_is_reported_promptly(thread_server):
    producer = Producer()
    ts = thread_server([("GET", "/stream", producer)], output_buffer_bytes=64 << 10)
    sock = ts.raw()
    sock.sendall(b"GET /stream?n=100000&size=4096 HTTP/1.1\r\nHost: x\r\n\r\n")
    sock.recv(10000)
    closed_at = time.monotonic()
    sock.close()
    assert producer.done.wait(5)
    assert producer.closed == "disconnect" and producer.closed_at - closed_at < 2
    assert ts.call(lambda: (len(ts.server.requests), len(ts.server.connections))) == (0, 0)


def test_disconnect_while_waiting_cancels_the_deferred(thread_server):
    slow = Slow(delay=2.0)
    ts = thread_server([("GET", "/slow", slow)])
    sock = ts.raw()
    sock.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
    time.sleep(0.2)
    sock.close()
    assert slow.cancelled.wait(3)
    assert ts.call(lambda: len(ts.server.requests)) == 0
    assert json.loads(ts.request("GET", "/slow")[2]) == {"slow": True}  # an attentive client gets its answer


def test_trickled_body_does_not_block_other_clients(echo_server):
    sock = echo_server.raw()
    body = b'{"hello": "byte by byte"}' * 4
    sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body))
    for i, byte in enumerate(body):
        sock.sendall(bytes([byte]))
        if i % 10 == 0:
            assert echo_server.request("GET", "/healthz")[0] == 200
        time.sleep(0.002)
    status, _, got = read_response(sock)
    assert status == 200 and got == body
    sock.close()


def test_two_hundred_idle_connections(shared_server):
    idle = [shared_server.raw(transport=("tcp", "unix")[i % 2]) for i in range(200)]
    try:
        for _ in range(10):
            assert shared_server.request("GET", "/healthz")[0] == 200
        status = json.loads(shared_server.request("GET", "/v1/status")[2])
        assert status["connections"]["open"] >= 201
        sock = idle[137]  # an idle one still works
        sock.sendall(b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(sock)[0] == 200
    finally:
        for sock in idle:
            sock.close()


def test_connection_limit_answers_503_and_closes(live_server):
    server = live_server("--connections", "4")
    held = [server.raw() for _ in range(4)]
    time.sleep(0.2)
    extra = server.raw()
    data = recv_all(extra)
    assert data.startswith(b"HTTP/1.1 503") and b'"connection_limit"' in data
    extra.close()
    held.pop().close()
    time.sleep(0.3)
    assert server.request("GET", "/healthz")[0] == 200
    for sock in held:
        sock.close()


def test_header_and_idle_timeouts(live_server):
    server = live_server("--header_timeout", "0.5", "--idle_timeout", "1")
    slowloris = server.raw()
    slowloris.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
    data = recv_all(slowloris, timeout=5)
    assert data.startswith(b"HTTP/1.1 408") and b"request_timeout" in data
    idle = server.raw()
    idle.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert read_response(idle)[0] == 200
    started = time.monotonic()
    assert recv_all(idle, timeout=5) == b""  # closed quietly once idle
    assert 0.5 < time.monotonic() - started < 4


# -- process lifecycle ---------------------------------------------------------

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_shuts_down_gracefully(live_server, sig):
    server = live_server()
    stream = server.raw()
    stream.sendall(b"GET /logz/stream HTTP/1.1\r\nHost: x\r\n\r\n")
    assert stream.recv(100).startswith(b"HTTP/1.1 200")
    idle = server.raw()
    assert os.path.exists(server.unix_path)
    started = time.monotonic()
    assert server.stop(sig) == 0
    assert time.monotonic() - started < 5  # an endless log stream does not hold shutdown
    assert not os.path.exists(server.unix_path)
    assert recv_all(idle) == b""
    stream.close()


def test_stale_socket_replaced_but_regular_file_kept(tmp_path):
    from conftest import ROOT
    path = str(tmp_path / "loom.sock")
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(path)
    stale.close()  # leaves the file with no listener, like a crashed server
    (tmp_path / "empty.json").write_text("[]")
    no_models = ["--models", str(tmp_path / "empty.json")]
    proc = subprocess.Popen([os.sys.executable, "-m", "loom", "--listen", f"unix:{path}", *no_models], cwd=ROOT,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                probe = socket.socket(socket.AF_UNIX)
                probe.connect(path)
                probe.sendall(b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
                assert read_response(probe)[0] == 200
                probe.close()
                break
            except (ConnectionRefusedError, FileNotFoundError):
                time.sleep(0.05)
        else:
            pytest.fail("server did not take over the stale socket")
        # A second server must not steal a live socket.
        second = subprocess.run([os.sys.executable, "-m", "loom", "--listen", f"unix:{path}", *no_models], cwd=ROOT,
                                capture_output=True, text=True, timeout=30)
        assert second.returncode == 2 and "another server is listening" in second.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    regular = tmp_path / "notasocket"
    regular.write_text("keep me")
    out = subprocess.run([os.sys.executable, "-m", "loom", "--listen", f"unix:{regular}", *no_models], cwd=ROOT,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "not a socket" in out.stderr and regular.read_text() == "keep me"


def test_help_documents_every_flag():
    from conftest import ROOT
    out = subprocess.run([os.sys.executable, "-m", "loom", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0
    for flag in ("--listen", "--request_body_bytes", "--connections", "--header_bytes", "--header_timeout",
                 "--idle_timeout", "--request_timeout", "--output_buffer_bytes", "--log_level"):
        assert flag in out.stdout


def test_handler_failure_is_a_500_envelope_and_the_connection_goes_on(thread_server):
    def broken(server, request):
        raise RuntimeError("bug")

    ts = thread_server([("GET", "/broken", broken)])
    conn = ts.connection()
    conn.request("GET", "/broken")
    resp = conn.getresponse()
    assert resp.status == 500 and error_of(resp.read()) == {
        "message": "internal error", "type": "server_error", "param": None, "code": "internal_error"}
    conn.request("GET", "/healthz")
    assert conn.getresponse().status == 200
    conn.close()



def test_a_large_json_body_is_parsed_off_the_loop_then_routed(thread_server):
    """Bodies of 1 MiB and more parse on the executor; the handler sees the same value and errors."""
    seen = []

    def parse(server, request):
        value = request.json()          # raises the 400 of a malformed body, parsed where it was
        seen.append((request.parsed is not None, threading.current_thread() is server_thread[0]))
        if value.get("later"):          # a handler answering later still answers
            deferred = Deferred()
            server.loop.call_later(0.05, deferred.resolve, Response.json({"n": len(value["pad"])}))
            return deferred
        return Response.json({"n": len(value["pad"])})

    ts = thread_server([("POST", "/parse", parse)], request_body_bytes=8 << 20)
    server_thread = [ts.thread]
    json_type = {"Content-Type": "application/json"}
    for size, later in [(10, False), (3 << 20, False), (3 << 20, True)]:
        body = json.dumps({"pad": "x" * size, "later": later}).encode()
        status, _, raw = ts.request("POST", "/parse", body=body, headers=json_type)
        assert status == 200 and json.loads(raw) == {"n": size}
    assert seen == [(False, True), (True, True), (True, True)]     # handlers always run on the loop
    for body in [b"{" * 10 + b" " * (2 << 20), b'{"pad": "' + b"x" * (2 << 20) + b'\xff"}',
                 b'{"a": 1, "a": 2}' + b" " * (2 << 20)]:
        small = ts.request("POST", "/parse", body=body.rstrip(b" "), headers=json_type)
        large = ts.request("POST", "/parse", body=body, headers=json_type)
        assert large[0] == small[0] == 400
        assert error_of(large[2])["code"] == error_of(small[2])["code"] in ("invalid_json", "duplicate_key")
    # Another content type is refused by the handler as before, unparsed.
    status, _, raw = ts.request("POST", "/parse", body=b"{}" + b" " * (2 << 20), headers={"Content-Type": "text/plain"})
    assert status == 415 and error_of(raw)["code"] == "unsupported_media_type"
    # A client that leaves while its body is parsed (or just after): nothing is held.
    sock = ts.raw()
    big = json.dumps({"pad": "y" * (6 << 20)}).encode()
    sock.sendall(b"POST /parse HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(big) + big)
    sock.close()
    deadline = time.monotonic() + 5
    while ts.call(lambda: len(ts.server.requests) + len(ts.server.connections)) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ts.call(lambda: (len(ts.server.requests), len(ts.server.connections))) == (0, 0)
    assert ts.request("GET", "/healthz")[0] == 200

def test_sse_event_encoding():
    from loom.http import sse_event
    assert sse_event({"a": 1}, event="chunk", id=7) == b'id: 7\nevent: chunk\ndata: {"a":1}\n\n'
    assert sse_event("two\nlines") == b"data: two\ndata: lines\n\n"


def test_readyz_is_503_while_not_ready(thread_server):
    ts = thread_server()
    ts.call(setattr, ts.server, "ready", False)  # as during start-up or shutdown
    status, _, body = ts.request("GET", "/readyz")
    assert status == 503 and error_of(body)["code"] == "not_ready"
    assert ts.request("GET", "/healthz")[0] == 200  # liveness is unaffected
    ts.call(setattr, ts.server, "ready", True)
    assert ts.request("GET", "/readyz")[0] == 200


def test_a_failing_loop_callback_is_contained(thread_server):
    ts = thread_server()
    ts.server.loop.call_soon_threadsafe(lambda: 1 / 0)
    time.sleep(0.1)
    assert ts.thread.is_alive() and ts.request("GET", "/healthz")[0] == 200
