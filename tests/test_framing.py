"""The request framing decoder: Cython parser and its pure-Python reference.

Every case runs against both. Property tests check that the way bytes are
split across reads never changes the outcome, and that garbage only ever
produces the parser's own FramingError, with both implementations agreeing.
"""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loom._native import framing, pyframing

IMPLS = [framing, pyframing]
ids = ["cython", "python"]


def parse_all(mod, data, splits=None, **limits):
    """Feed data (optionally in pieces) and collect requests until the parser
    waits or fails. Returns (requests, error_or_None, state)."""
    p = mod.RequestParser(**limits)
    pieces = [data] if splits is None else split(data, splits)
    out = []
    try:
        for piece in pieces:
            p.feed(piece)
            while True:
                r = p.next_request()
                if r is None:
                    break
                out.append(r)
    except mod.FramingError as e:
        return out, (e.status, e.code), p.state
    return out, None, p.state


def split(data, cuts):
    cuts = sorted({c % (len(data) + 1) for c in cuts})
    pieces, last = [], 0
    for c in cuts:
        pieces.append(data[last:c])
        last = c
    pieces.append(data[last:])
    return pieces


def req(head, body=b""):
    return head.replace(b"\n", b"\r\n") + b"\r\n" + body


GET = req(b"GET /healthz HTTP/1.1\nHost: x\n")
CHUNKED = req(b"POST /v1/x HTTP/1.1\nHost: x\nTransfer-Encoding: chunked\n",
              b"4\r\nWiki\r\n5;ext=1\r\npedia\r\nE\r\n in\r\n\r\nchunks.\r\n0\r\nX-Trailer: yes\r\n\r\n")
LENGTH = req(b"POST /v1/x HTTP/1.1\nHost: x\nContent-Length: 11\n", b"hello world")


@pytest.mark.parametrize("mod", IMPLS, ids=ids)
class TestValid:
    def test_get(self, mod):
        (r,), err, state = parse_all(mod, GET)
        assert err is None and state == "idle"
        assert r == ("GET", "/healthz", 11, [("host", "x")], b"", True)

    @pytest.mark.parametrize("host", [b"x", b"localhost:8080", b"[::1]:80", b"127.0.0.1", b"", b"a.b-c_d~1",
                                      b"xn--caf-dma.example:"])
    def test_hosts(self, mod, host):
        (r,), err, _ = parse_all(mod, req(b"GET / HTTP/1.1\nHost: " + host + b"\n"))
        assert err is None and r[3] == [("host", host.decode())]

    def test_whitespace_before_a_chunk_extension(self, mod):
        (r,), err, _ = parse_all(mod, req(b"POST / HTTP/1.1\nHost: x\nTransfer-Encoding: chunked\n",
                                          b"3 ;a=b\r\nabc\r\n0\r\n\r\n"))
        assert err is None and r[4] == b"abc"

    def test_chunked_decoded_with_extensions_and_trailers(self, mod):
        (r,), err, _ = parse_all(mod, CHUNKED)
        assert err is None
        assert r[4] == b"Wikipedia in\r\n\r\nchunks."

    def test_content_length(self, mod):
        (r,), err, _ = parse_all(mod, LENGTH)
        assert r[4] == b"hello world" and err is None

    def test_pipelined_in_order(self, mod):
        reqs, err, _ = parse_all(mod, GET + CHUNKED + LENGTH + GET)
        assert err is None
        assert [r[1] for r in reqs] == ["/healthz", "/v1/x", "/v1/x", "/healthz"]

    def test_one_request_per_read_on_a_kept_alive_connection(self, mod):
        # The common keep-alive shape: each read holds exactly one whole request.
        p = mod.RequestParser()
        for data in [GET, LENGTH, CHUNKED, GET, GET[:7], GET[7:]]:
            p.feed(data)
            r = p.next_request()
            if data != GET[:7]:
                assert r is not None and r[1] in ("/healthz", "/v1/x")
        assert p.state == "idle" and p.buffered == 0

    def test_keep_alive_rules(self, mod):
        close = req(b"GET / HTTP/1.1\nHost: x\nConnection: close\n")
        http10 = req(b"GET / HTTP/1.0\n")
        http10_ka = req(b"GET / HTTP/1.0\nConnection: Keep-Alive\n")
        assert [r[5] for r in parse_all(mod, close + http10 + http10_ka)[0]] == [False, False, True]

    def test_absolute_form_target(self, mod):
        (r,), err, _ = parse_all(mod, req(b"GET http://example/v1/models?x=1 HTTP/1.1\nHost: x\n"))
        assert r[1] == "/v1/models?x=1"

    def test_leading_empty_lines_tolerated(self, mod):
        (r,), err, _ = parse_all(mod, b"\r\n\r\n" + GET)
        assert err is None and r[1] == "/healthz"

    def test_body_exactly_at_limit(self, mod):
        body = b"a" * 100
        data = req(b"POST / HTTP/1.1\nHost: x\nTransfer-Encoding: chunked\n", b"64\r\n" + body + b"\r\n0\r\n\r\n")
        (r,), err, _ = parse_all(mod, data, body_bytes=100)
        assert r[4] == body and err is None

    def test_header_value_whitespace_and_obs_text(self, mod):
        (r,), _, _ = parse_all(mod, req(b"GET / HTTP/1.1\nHost: x\nX-A: \t caf\xe9 \t\n"))
        assert ("x-a", "caf\xe9") in r[3]


REJECTS = [
    ("both_cl_te", req(b"POST / HTTP/1.1\nHost: x\nContent-Length: 3\nTransfer-Encoding: chunked\n", b"0\r\n\r\n"),
     400, "ambiguous_framing"),
    ("two_cl", req(b"POST / HTTP/1.1\nHost: x\nContent-Length: 3\nContent-Length: 3\n", b"abc"), 400, "ambiguous_framing"),
    ("cl_sign", req(b"POST / HTTP/1.1\nHost: x\nContent-Length: +3\n", b"abc"), 400, "invalid_content_length"),
    ("cl_list", req(b"POST / HTTP/1.1\nHost: x\nContent-Length: 3, 3\n", b"abc"), 400, "invalid_content_length"),
    ("te_gzip", req(b"POST / HTTP/1.1\nHost: x\nTransfer-Encoding: gzip, chunked\n"), 501, "unsupported_transfer_encoding"),
    ("te_twice", req(b"POST / HTTP/1.1\nHost: x\nTransfer-Encoding: chunked\nTransfer-Encoding: chunked\n"),
     400, "malformed_transfer_encoding"),
    ("te_http10", req(b"POST / HTTP/1.0\nTransfer-Encoding: chunked\n"), 400, "ambiguous_framing"),
    ("bad_chunk_size", req(b"POST / HTTP/1.1\nHost: x\nTransfer-Encoding: chunked\n", b"zz\r\n"), 400, "malformed_chunk"),
    ("chunk_size_space_inside", req(b"POST / HTTP/1.1\nHost: x\nTransfer-Encoding: chunked\n", b"1 0\r\n"),
     400, "malformed_chunk"),
    ("huge_chunk_size", req(b"POST / HTTP/1.1\nHost: x\nTransfer-Encoding: chunked\n", b"1" * 20 + b"\r\n"),
     400, "malformed_chunk"),
    ("chunk_missing_crlf", req(b"POST / HTTP/1.1\nHost: x\nTransfer-Encoding: chunked\n", b"3\r\nabcXY"),
     400, "malformed_chunk"),
    ("expect", req(b"POST / HTTP/1.1\nHost: x\nExpect: 100-continue\nContent-Length: 1\n"), 417, "expectation_failed"),
    ("no_host", req(b"GET / HTTP/1.1\n"), 400, "invalid_host"),
    ("two_hosts", req(b"GET / HTTP/1.1\nHost: a\nHost: b\n"), 400, "invalid_host"),
    ("host_with_space", req(b"GET / HTTP/1.1\nHost: a b\n"), 400, "invalid_host"),      # issue 15.7
    ("host_list", req(b"GET / HTTP/1.1\nHost: a, b\n"), 400, "invalid_host"),
    ("host_bad_port", req(b"GET / HTTP/1.1\nHost: a:8x\n"), 400, "invalid_host"),
    ("chunk_size_trailing_space", req(b"POST / HTTP/1.1\nHost: x\nTransfer-Encoding: chunked\n", b"3 \r\nabc\r\n0\r\n\r\n"),
     400, "malformed_chunk"),
    ("bare_lf", b"GET / HTTP/1.1\nHost: x\r\n\r\n", 400, "bare_line_ending"),
    ("obs_fold", req(b"GET / HTTP/1.1\nHost: x\nX-A: a\n b\n"), 400, "obsolete_line_folding"),
    ("space_before_colon", req(b"GET / HTTP/1.1\nHost : x\n"), 400, "malformed_header"),
    ("nul_in_value", req(b"GET / HTTP/1.1\nHost: x\nX-A: a\x00b\n"), 400, "malformed_header"),
    ("http2", req(b"GET / HTTP/2.0\nHost: x\n"), 505, "http_version_not_supported"),
    ("garbled_version", req(b"GET / HTTQ/1.1\nHost: x\n"), 400, "malformed_request_line"),
    ("target_not_path", req(b"GET healthz HTTP/1.1\nHost: x\n"), 400, "malformed_request_line"),
    ("two_spaces", req(b"GET  / HTTP/1.1\nHost: x\n"), 400, "malformed_request_line"),
    ("non_ascii_target", req(b"GET /\xc3\xa9 HTTP/1.1\nHost: x\n"), 400, "malformed_request_line"),
    ("too_many_blank_lines", b"\r\n" * 9 + GET, 400, "malformed_request_line"),
    ("too_many_headers", req(b"GET / HTTP/1.1\nHost: x\n" + b"X-A: 1\n" * 200), 431, "too_many_headers"),
]


@pytest.mark.parametrize("mod", IMPLS, ids=ids)
@pytest.mark.parametrize("name,data,status,code", REJECTS, ids=[r[0] for r in REJECTS])
def test_rejects(mod, name, data, status, code):
    reqs, err, _ = parse_all(mod, data)
    assert reqs == [] and err == (status, code)


@pytest.mark.parametrize("mod", IMPLS, ids=ids)
class TestBounds:
    def test_head_too_large_before_terminator(self, mod):
        # 431 fires as soon as the buffered head passes the bound, without waiting for its end.
        data = b"GET / HTTP/1.1\r\nHost: x\r\nX-A: " + b"a" * 300
        assert parse_all(mod, data, header_bytes=256)[1] == (431, "header_too_large")

    def test_head_too_large_complete(self, mod):
        data = req(b"GET / HTTP/1.1\nHost: x\nX-A: " + b"a" * 300 + b"\n")
        assert parse_all(mod, data, header_bytes=256)[1] == (431, "header_too_large")

    def test_content_length_over_limit_rejects_at_head(self, mod):
        # Only the head is fed: the 413 must not wait for (or buffer) the body.
        head = req(b"POST / HTTP/1.1\nHost: x\nContent-Length: 101\n")
        assert parse_all(mod, head, body_bytes=100)[1] == (413, "body_too_large")

    def test_chunk_over_limit_rejects_at_chunk_size(self, mod):
        data = req(b"POST / HTTP/1.1\nHost: x\nTransfer-Encoding: chunked\n", b"40\r\n" + b"a" * 64 + b"\r\n41\r\n")
        assert parse_all(mod, data, body_bytes=128)[1] == (413, "body_too_large")

    def test_chunk_line_bound(self, mod):
        data = req(b"POST / HTTP/1.1\nHost: x\nTransfer-Encoding: chunked\n", b"1;" + b"e" * 2000)
        assert parse_all(mod, data, chunk_line_bytes=1024)[1] == (400, "chunk_line_too_long")

    def test_trailer_bound(self, mod):
        data = req(b"POST / HTTP/1.1\nHost: x\nTransfer-Encoding: chunked\n", b"0\r\nX-T: " + b"t" * 9000 + b"\r\n\r\n")
        assert parse_all(mod, data, trailer_bytes=8192)[1] == (431, "trailers_too_large")

    def test_truncated_body_waits_and_reports_state(self, mod):
        reqs, err, state = parse_all(mod, LENGTH[:-3])
        assert reqs == [] and err is None and state == "body"
        reqs, err, state = parse_all(mod, GET[:10])
        assert reqs == [] and err is None and state == "head"

    def test_failure_is_final(self, mod):
        p = mod.RequestParser()
        p.feed(REJECTS[0][1])
        with pytest.raises(mod.FramingError):
            p.next_request()
        with pytest.raises(mod.FramingError):
            p.feed(GET)


VALID_STREAMS = [GET, CHUNKED, LENGTH, GET + CHUNKED + LENGTH, b"\r\n" + LENGTH + CHUNKED]
FUZZ = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.sampled_from(VALID_STREAMS + [r[1] for r in REJECTS]), st.lists(st.integers(0, 10_000), max_size=12))
def test_random_splits_do_not_change_the_outcome(data, cuts):
    boundaries = [len(GET), len(GET) + len(CHUNKED)]  # reads that end exactly at a request's end
    for mod in IMPLS:
        assert parse_all(mod, data, boundaries) == parse_all(mod, data)
        assert parse_all(mod, data, cuts) == parse_all(mod, data)


@FUZZ
@given(st.binary(max_size=600), st.lists(st.integers(0, 10_000), max_size=6))
def test_garbage_only_raises_framing_errors_and_implementations_agree(data, cuts):
    outcomes = [parse_all(mod, data, cuts, header_bytes=300, body_bytes=200) for mod in IMPLS]
    assert outcomes[0] == outcomes[1]


@st.composite
def mutated(draw):
    data = bytearray(draw(st.sampled_from(VALID_STREAMS)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "insert", "delete", "truncate"]))
        i = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[i] = draw(st.sampled_from(b"\r\n :;0aZ\x00\x7f\xff9F"))
        elif op == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=4))
        elif op == "delete" and data:
            del data[i]
        elif op == "truncate":
            del data[i:]
    return bytes(data)


@FUZZ
@given(mutated(), st.lists(st.integers(0, 10_000), max_size=6))
def test_mutations_of_valid_requests(data, cuts):
    whole = parse_all(framing, data)
    assert parse_all(pyframing, data) == whole
    assert parse_all(framing, data, cuts) == whole
