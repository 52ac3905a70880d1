"""/metrics, /logz, /logz/stream and /v1/requests on a real server, and the openai SDK's view of it."""

import json
import socket
import subprocess
import time

try:
    import httpx2 as httpx  # the transport newer openai SDKs are built on
except ImportError:
    import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import reader


def families(server):
    status, headers, body = server.request("GET", "/metrics")
    assert status == 200 and headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    return {f.name: f for f in text_string_to_metric_families(body.decode())}


def sample(fams, family, name, **labels):
    return next((s.value for s in fams[family].samples
                 if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())), None)


def test_metrics_count_requests_bytes_and_connections(live_server):
    server = live_server("--request_body_bytes", "64")
    for _ in range(3):
        server.request("GET", "/healthz")
    server.request("GET", "/nowhere")
    server.request("POST", "/healthz", body=b"x" * 65)
    fams = families(server)
    assert sample(fams, "loom_http_requests", "loom_http_requests_total",
                  method="GET", route="/healthz", status="200") == 3
    assert sample(fams, "loom_http_requests", "loom_http_requests_total", route="(unmatched)", status="404") == 1
    assert sample(fams, "loom_http_requests", "loom_http_requests_total", route="(framing)", status="413") == 1
    assert sample(fams, "loom_http_body_limit_rejections", "loom_http_body_limit_rejections_total") == 1
    assert sample(fams, "loom_http_received_bytes", "loom_http_received_bytes_total") > 100
    assert sample(fams, "loom_http_sent_bytes", "loom_http_sent_bytes_total") > 100
    assert sample(fams, "loom_http_connections_open", "loom_http_connections_open") == 1  # the scrape itself
    assert fams["loom_http_requests"].documentation


def log_lines(body):
    return [json.loads(line) for line in body.decode().splitlines()]


def test_logz_pages_with_a_cursor_and_reports_drops(live_server):
    server = live_server("--log_capacity", "16")
    for _ in range(30):
        server.request("GET", "/healthz")
    status, headers, body = server.request("GET", "/logz?cursor=0&limit=5")
    assert status == 200 and headers["content-type"] == "application/x-ndjson"
    entries = log_lines(body)
    assert len(entries) == 5 and int(headers["x-loom-dropped"]) > 0  # the ring held only 16
    ids = [e["id"] for e in entries]
    assert ids == list(range(ids[0], ids[0] + 5))
    assert int(headers["x-loom-next-cursor"]) == ids[-1] + 1
    status, headers, body = server.request("GET", f"/logz?cursor={ids[-1] + 1}&limit=3")
    assert [e["id"] for e in log_lines(body)] == [ids[-1] + 1, ids[-1] + 2, ids[-1] + 3]
    assert headers["x-loom-dropped"] == "0"
    request_entries = [e for e in log_lines(server.request("GET", "/logz?limit=1000")[2]) if e["event"] == "request"]
    assert request_entries and {"method", "path", "status", "ms"} <= set(request_entries[-1])
    for bad in ("limit=0", "limit=1001", "cursor=-1", "cursor=x", "limit=1&limit=2", "other=1"):
        status, _, body = server.request("GET", f"/logz?{bad}")
        assert status == 400 and json.loads(body)["error"]["type"] == "invalid_request_error"


def sse_events(sock, count, timeout=10, until=None):
    """Parse `count` SSE events (or up to the first matching `until`) from a
    chunked response already past its head."""
    sock.settimeout(timeout)
    f = reader(sock)
    events, current, text = [], {}, b""
    while len(events) < count and not (until and any(map(until, events))):
        size = int(f.readline().split(b";")[0], 16)
        text += f.read(size)
        f.readline()
        while b"\n\n" in text:
            block, text = text.split(b"\n\n", 1)
            current = {}
            for line in block.decode().split("\n"):
                if line.startswith(":"):
                    continue
                key, _, value = line.partition(": ")
                current[key] = value
            if current:
                events.append(current)
    return events


def open_stream(server, headers=b"", rcvbuf=None):
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connect, to bound the window
    sock.settimeout(10)
    sock.connect((server.host, server.port))
    sock.sendall(b"GET /logz/stream HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n")
    f = reader(sock)
    status = f.readline()
    assert status.startswith(b"HTTP/1.1 200")
    head = {}
    while (line := f.readline()) != b"\r\n":
        k, _, v = line.decode().partition(":")
        head[k.lower()] = v.strip()
    assert head["content-type"] == "text/event-stream" and head["transfer-encoding"] == "chunked"
    return sock


def test_log_stream_resumes_from_last_event_id(shared_server):
    sock = open_stream(shared_server)
    first = sse_events(sock, 3)
    assert all(e["event"] == "log" and int(e["id"]) == json.loads(e["data"])["id"] for e in first)
    sock.close()
    resume_from = int(first[1]["id"])
    sock = open_stream(shared_server, b"Last-Event-ID: %d\r\n" % resume_from)
    assert int(sse_events(sock, 1)[0]["id"]) == resume_from + 1
    sock.close()
    status, _, body = shared_server.request("GET", "/logz/stream", headers={"Last-Event-ID": "abc"})
    assert status == 400 and json.loads(body)["error"]["code"] == "invalid_cursor"


def test_slow_log_client_loses_only_its_own_entries(live_server):
    # Entries are made big (long request paths) so the slow reader's backlog
    # outgrows kernel socket buffers and the ring laps it.
    server = live_server("--log_capacity", "64", "--output_buffer_bytes", "4096", "--header_bytes", "200000")
    slow = open_stream(server, rcvbuf=4096)
    fast = open_stream(server)
    fast_seen = []
    for i in range(300):
        server.request("GET", "/missing/" + "p" * 100_000)
        if i % 50 == 49:
            fast_seen += sse_events(fast, 40)
    fast_ids = [int(e["id"]) for e in fast_seen if "id" in e]
    assert fast_ids == list(range(fast_ids[0], fast_ids[0] + len(fast_ids)))  # no gap for the fast reader
    time.sleep(0.5)
    events = sse_events(slow, 400, until=lambda e: e.get("event") == "dropped")
    gap = next(e for e in events if e.get("event") == "dropped")
    assert json.loads(gap["data"])["dropped"] > 0
    slow.close()
    fast.close()


def test_requests_inspection_lists_live_work(shared_server):
    sock = open_stream(shared_server)
    status, _, body = shared_server.request("GET", "/v1/requests?limit=100")
    page = json.loads(body)
    assert status == 200 and page["object"] == "list"
    states = {r["path"]: r["state"] for r in page["data"]}
    assert states["/logz/stream"] == "streaming" and states["/v1/requests"] == "running"
    assert all(r["age_ms"] >= 0 and r["transport"].startswith("tcp:") for r in page["data"])
    first = json.loads(shared_server.request("GET", "/v1/requests?limit=1")[2])
    assert len(first["data"]) == 1 and first["next_offset"] == 1
    for bad in ("limit=101", "limit=0", "offset=-3"):
        assert shared_server.request("GET", f"/v1/requests?{bad}")[0] == 400
    sock.close()
    time.sleep(0.3)
    paths = [r["path"] for r in json.loads(shared_server.request("GET", "/v1/requests")[2])["data"]]
    assert paths == ["/v1/requests"]  # the closed stream left the table


# -- real clients --------------------------------------------------------------

def test_openai_sdk_over_tcp_and_unix(shared_server):
    client = openai.OpenAI(base_url=shared_server.url + "/v1", api_key="unused", max_retries=0)
    assert list(client.models.list()) == []
    with pytest.raises(openai.NotFoundError) as info:
        client.embeddings.create(model="absent", input="x")
    assert info.value.status_code == 404 and info.value.body["code"] == "model_not_found"
    unix = openai.OpenAI(base_url="http://loom/v1", api_key="unused", max_retries=0,
                         http_client=httpx.Client(transport=httpx.HTTPTransport(uds=shared_server.unix_path)))
    assert list(unix.models.list()) == []


def test_curl_discovery_and_errors(shared_server):
    out = subprocess.run(["curl", "-sS", "--fail-with-body", f"{shared_server.url}/readyz"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and json.loads(out.stdout) == {"status": "ready"}
    out = subprocess.run(["curl", "-sS", "--unix-socket", shared_server.unix_path, "http://localhost/v1/models"],
                         capture_output=True, text=True, timeout=30)
    assert json.loads(out.stdout) == {"object": "list", "data": []}
    out = subprocess.run(["curl", "-sS", "--fail-with-body", "-X", "PUT", f"{shared_server.url}/metrics"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 22 and json.loads(out.stdout)["error"]["code"] == "method_not_allowed"
    out = subprocess.run(["curl", "-sS", "-H", "Expect: 100-continue", "-d", "{}", "-o", "/dev/null",
                          "-w", "%{http_code}", f"{shared_server.url}/healthz"], capture_output=True, text=True, timeout=30)
    assert out.stdout == "417"
