"""Unit tests for loom.metrics (Prometheus text exposition 0.0.4)."""

import math
import re
import threading

import pytest

from loom.metrics import CONTENT_TYPE, Registry, format_value

parser = pytest.importorskip("prometheus_client.parser")


def parse(text):
    return {f.name: f for f in parser.text_string_to_metric_families(text)}


# A strict line grammar for the 0.0.4 text format, independent of the
# (lenient) reference parser.
_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_LVAL = r'"(?:[^"\\\n]|\\\\|\\"|\\n)*"'
_SAMPLE = re.compile(
    rf"{_NAME}(\{{[a-zA-Z_][a-zA-Z0-9_]*={_LVAL}(,[a-zA-Z_][a-zA-Z0-9_]*={_LVAL})*\}})? "
    r"(NaN|[+-]Inf|-?[0-9]+(\.[0-9]+)?(e[+-]?[0-9]+)?)")
_HELP = re.compile(rf"# HELP {_NAME} (?:[^\\\n]|\\\\|\\n)*")
_TYPE = re.compile(rf"# TYPE {_NAME} (counter|gauge|histogram|summary|untyped)")


def assert_well_formed(text):
    assert text.endswith("\n")
    for line in text.splitlines():
        assert _HELP.fullmatch(line) or _TYPE.fullmatch(line) or _SAMPLE.fullmatch(line), line


TRICKY = ['say "hi"', "back\\slash", "new\nline", "ünïcødé ✓ 猫", "", "\\n literal", 'end\\', "{a=\"b\"}"]


def test_content_type():
    assert CONTENT_TYPE == "text/plain; version=0.0.4; charset=utf-8"


def test_counter_roundtrip_with_tricky_label_values():
    reg = Registry()
    c = reg.counter("loom_http_requests", "HTTP requests.", ("method", "path"))
    for i, v in enumerate(TRICKY):
        c.inc(i + 1, method="GET", path=v)
    c.labels("POST", "/v1").inc()
    c.labels(method="POST", path="/v1").inc(amount=2)
    text = reg.expose()
    assert_well_formed(text)
    assert "# TYPE loom_http_requests_total counter\n" in text
    fams = parse(text)
    fam = fams["loom_http_requests"]  # the reference parser strips _total from the family
    assert fam.type == "counter"
    assert fam.documentation == "HTTP requests."
    got = {(s.labels["method"], s.labels["path"]): s.value for s in fam.samples}
    assert all(s.name == "loom_http_requests_total" for s in fam.samples)
    want = {("GET", v): i + 1 for i, v in enumerate(TRICKY)}
    want[("POST", "/v1")] = 3
    assert got == want


def test_counter_name_already_ending_in_total_and_values():
    reg = Registry()
    c = reg.counter("jobs_total", "Jobs.")
    assert c.name == "jobs_total"
    c.inc()
    c.inc(0.5)
    assert c.get() == 1.5
    assert "jobs_total 1.5\n" in reg.expose()
    with pytest.raises(ValueError):
        c.inc(-1)
    with pytest.raises(ValueError):
        c.inc(float("nan"))
    assert c.get() == 1.5


def test_help_escaping_and_unicode_roundtrip():
    reg = Registry()
    reg.gauge("g", 'help with \\ backslash\nand newline and "quotes" ✓')
    text = reg.expose()
    assert_well_formed(text)
    assert "# HELP g help with \\\\ backslash\\nand newline and \"quotes\" ✓\n" in text
    assert parse(text)["g"].documentation == 'help with \\ backslash\nand newline and "quotes" ✓'


def test_gauge_operations_and_types():
    reg = Registry()
    g = reg.gauge("loom_inflight", "In flight.")
    lg = reg.gauge("loom_queue_depth", "Depth.", labels=("model",))
    g.inc()
    g.inc(4)
    g.dec()
    g.dec(amount=2)
    lg.set(7, model="a")
    lg.labels("b").set(value=-2.25)
    lg.inc(model="a")
    text = reg.expose()
    assert_well_formed(text)
    fams = parse(text)
    assert fams["loom_inflight"].type == "gauge"
    assert fams["loom_inflight"].samples[0].value == 2
    assert {s.labels["model"]: s.value for s in fams["loom_queue_depth"].samples} == {"a": 8, "b": -2.25}
    g.set(value=0.125)
    assert g.get() == 0.125
    with pytest.raises(TypeError):
        g.set()
    assert lg.get(model="zzz") == 0  # unseen: 0, and no child is created
    assert 'model="zzz"' not in reg.expose()


def test_label_named_like_the_amount_argument():
    reg = Registry()
    c = reg.counter("x", "x", ("amount",))
    c.inc(3, amount="big")
    assert c.get(amount="big") == 3
    assert 'x_total{amount="big"} 3\n' in reg.expose()


def test_labelled_family_without_samples_prints_only_header():
    reg = Registry()
    reg.counter("a", "A.", ("k",))
    reg.gauge("b", "B.", ("k",))
    reg.gauge("c", "C.")
    assert reg.expose() == (
        "# HELP a_total A.\n# TYPE a_total counter\n"
        "# HELP b B.\n# TYPE b gauge\n"
        "# HELP c C.\n# TYPE c gauge\nc 0\n")


def test_families_in_registration_order():
    reg = Registry()
    names = ["zeta", "alpha", "mid:dle", "_under"]
    for n in names:
        reg.gauge(n, n)
    order = [line.split()[2] for line in reg.expose().splitlines() if line.startswith("# TYPE")]
    assert order == names


@pytest.mark.parametrize("bad", ["", "1abc", "a-b", "a b", "a.b", "é", "a\n", None, 5])
def test_bad_metric_names_rejected(bad):
    reg = Registry()
    with pytest.raises(ValueError):
        reg.counter(bad, "h")
    with pytest.raises(ValueError):
        reg.gauge(bad, "h")
    with pytest.raises(ValueError):
        reg.gauge_fn(bad, "h", lambda: 1)


@pytest.mark.parametrize("bad", ["", "1a", "a:b", "__reserved", "a-b", "é", None])
def test_bad_label_names_rejected(bad):
    reg = Registry()
    with pytest.raises(ValueError):
        reg.gauge("g", "h", labels=(bad,))


def test_label_set_validation():
    reg = Registry()
    with pytest.raises(ValueError):
        reg.gauge("g1", "h", labels="owner")  # a bare string is not a list of names
    with pytest.raises(ValueError):
        reg.gauge("g2", "h", labels=("a", "a"))
    with pytest.raises(ValueError):
        reg.histogram("h1", "h", labels=("le",))
    c = reg.counter("c", "h", ("a", "b"))
    with pytest.raises(ValueError):
        c.inc(a="1")
    with pytest.raises(ValueError):
        c.inc(a="1", b="2", x="3")
    with pytest.raises(ValueError):
        c.labels("only-one")
    with pytest.raises(ValueError):
        c.labels("1", b="2")
    assert reg.get("c_total") is c and reg.get("nope") is None


def test_valid_names_accepted():
    reg = Registry()
    reg.gauge("a:b_c9", "h", labels=("_x", "Y9", "_"))
    reg.counter(":colon", "h")


def test_duplicate_and_colliding_names_raise():
    reg = Registry()
    reg.counter("requests", "h")
    with pytest.raises(ValueError):
        reg.counter("requests", "h")
    with pytest.raises(ValueError):
        reg.counter("requests_total", "h")
    with pytest.raises(ValueError):
        reg.gauge("requests_total", "h")
    reg.histogram("lat", "h")
    for n in ("lat", "lat_bucket", "lat_sum", "lat_count"):
        with pytest.raises(ValueError):
            reg.gauge(n, "h")
    # The failed registrations left nothing behind.
    assert [l for l in reg.expose().splitlines() if l.startswith("# TYPE")] == [
        "# TYPE requests_total counter", "# TYPE lat histogram"]


def test_gauge_fn_evaluated_at_scrape_time():
    reg = Registry()
    state = {"conns": 1, "owners": {"weights": 100, "kv": 2 ** 40}}
    calls = []

    def conns():
        calls.append(1)
        return state["conns"]

    reg.gauge_fn("loom_connections_open", "Open connections.", conns)
    reg.gauge_fn("loom_memory_bytes", "Bytes by owner.",
                 lambda: [((k,), v) for k, v in state["owners"].items()], labels=("owner",))
    assert calls == []  # nothing computed at registration
    fams = parse(reg.expose())
    assert fams["loom_connections_open"].samples[0].value == 1
    assert {s.labels["owner"]: s.value for s in fams["loom_memory_bytes"].samples} == {
        "weights": 100, "kv": 2 ** 40}
    state["conns"] = 5
    state["owners"] = {"kv": 3}
    fams = parse(reg.expose())
    assert len(calls) == 2
    assert fams["loom_connections_open"].samples[0].value == 5
    assert [(s.labels, s.value) for s in fams["loom_memory_bytes"].samples] == [({"owner": "kv"}, 3)]


def test_gauge_fn_shapes_and_failures_do_not_break_scrape():
    reg = Registry()
    reg.gauge_fn("multi", "h", lambda: {("a", 1): 1, ("b", 2): 2.5}.items(), labels=("x", "y"))
    reg.gauge_fn("bare_key", "h", lambda: [("gpu0", 7)], labels=("dev",))
    reg.gauge_fn("bad_rows", "h", lambda: [(("ok",), 1), (("too", "many"), 2), "junk", (("x",), "nan?")],
                 labels=("k",))

    def boom():
        raise RuntimeError("owner gone")

    reg.gauge_fn("broken", "h", boom)
    reg.gauge("after", "h").set(9)
    text = reg.expose()
    assert_well_formed(text)
    fams = parse(text)
    assert {tuple(s.labels.values()): s.value for s in fams["multi"].samples} == {("a", "1"): 1, ("b", "2"): 2.5}
    assert fams["bare_key"].samples[0].labels == {"dev": "gpu0"}
    assert [(s.labels, s.value) for s in fams["bad_rows"].samples] == [({"k": "ok"}, 1)]
    assert fams["broken"].samples == []
    assert fams["after"].samples[0].value == 9
    assert reg.scrape_errors == 1
    with pytest.raises(ValueError):
        reg.gauge_fn("notcallable", "h", 5)


@pytest.mark.parametrize("value,text", [
    (0, "0"), (3, "3"), (-7, "-7"), (True, "1"), (3.0, "3"), (-0.0, "0"), (2.5, "2.5"), (0.1, "0.1"),
    (1e20, "100000000000000000000"), (2 ** 70, str(2 ** 70)), (1e300, "1e+300"), (1.5e-7, "1.5e-07"),
    (math.inf, "+Inf"), (-math.inf, "-Inf"), (math.nan, "NaN"),
])
def test_format_value(value, text):
    assert format_value(value) == text


def test_special_values_roundtrip():
    reg = Registry()
    g = reg.gauge("v", "h", ("k",))
    for k, v in [("inf", math.inf), ("ninf", -math.inf), ("nan", math.nan), ("big", 1e20), ("tiny", 5e-324)]:
        g.set(v, k=k)
    text = reg.expose()
    assert_well_formed(text)
    got = {s.labels["k"]: s.value for s in parse(text)["v"].samples}
    assert got["inf"] == math.inf and got["ninf"] == -math.inf and math.isnan(got["nan"])
    assert got["big"] == 1e20 and got["tiny"] == 5e-324


def test_histogram_cumulative_buckets_sum_count():
    reg = Registry()
    h = reg.histogram("loom_latency_seconds", "Latency.", buckets=(0.1, 1, 10), labels=("route",))
    for v in (0.05, 0.1, 0.5, 5, 50, math.nan):
        h.observe(v, route="/x")
    h.observe(value=0.2, route="/y")
    text = reg.expose()
    assert_well_formed(text)
    fam = parse(text)["loom_latency_seconds"]
    assert fam.type == "histogram"
    x = [(s.name, s.labels.get("le"), s.value) for s in fam.samples if s.labels["route"] == "/x"]
    assert x[:4] == [("loom_latency_seconds_bucket", "0.1", 2), ("loom_latency_seconds_bucket", "1", 3),
                     ("loom_latency_seconds_bucket", "10", 4), ("loom_latency_seconds_bucket", "+Inf", 6)]
    assert x[4][0] == "loom_latency_seconds_sum" and math.isnan(x[4][2])
    assert x[5] == ("loom_latency_seconds_count", None, 6)
    y = {(s.name, s.labels.get("le")): s.value for s in fam.samples if s.labels["route"] == "/y"}
    assert y[("loom_latency_seconds_bucket", "0.1")] == 0 and y[("loom_latency_seconds_bucket", "1")] == 1
    assert y[("loom_latency_seconds_sum", None)] == 0.2
    with pytest.raises(ValueError):
        reg.histogram("bad1", "h", buckets=(1, 1))
    with pytest.raises(ValueError):
        reg.histogram("bad2", "h", buckets=(2, 1))
    with pytest.raises(ValueError):
        reg.histogram("bad3", "h", buckets=(math.nan,))
    assert reg.histogram("inf_ok", "h", buckets=(1, math.inf)).bounds == (1.0,)


def test_concurrent_increments_are_not_lost():
    reg = Registry()
    c = reg.counter("n", "h", ("t",))
    g = reg.gauge("m", "h")

    def work(i):
        for _ in range(5000):
            c.inc(t=str(i % 2))
            g.inc()
            if _ % 1000 == 0:
                reg.expose()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert c.get(t="0") + c.get(t="1") == 20000
    assert g.get() == 20000
