"""Prometheus text exposition (format 0.0.4) for ``GET /metrics``.

A :class:`Registry` holds metric families in registration order::

    reg = Registry()
    requests = reg.counter("loom_http_requests", "HTTP requests.", ("method", "code"))
    requests.inc(method="GET", code="200")           # exposed as loom_http_requests_total
    get_ok = requests.labels("GET", "200")            # cache the child on hot paths
    get_ok.inc()
    inflight = reg.gauge("loom_requests_inflight", "Requests being served.")
    inflight.inc(); inflight.dec()
    reg.gauge_fn("loom_memory_bytes", "Device memory by owner.",
                 lambda: pool.bytes_by_owner().items(), labels=("owner",))
    body = reg.expose().encode("utf-8")               # serve with CONTENT_TYPE

Why it is shaped like this:

* Updates are O(1) and take one short per-family lock: worker threads may
  count too, and ``expose()`` (on the loop thread) must see a consistent set of
  children without "dict changed size during iteration".
* Ownership figures (open connections, bytes per owner) are *computed at scrape
  time* through ``gauge_fn`` instead of being mirrored into gauges on every
  change, so they can never drift from the owner's own accounting.
* A scrape never raises because of one bad callback: a failing ``gauge_fn``
  family exposes HELP/TYPE only and bumps ``Registry.scrape_errors``.

Counters are exposed under a ``_total`` name (appended when the given name
lacks it), and that name is used for both ``# TYPE`` and the samples, as the
0.0.4 convention does. Names and label names are validated at creation;
every invalid argument raises ``ValueError``.
"""

from __future__ import annotations

import bisect
import math
import re
import threading
from typing import Callable, Iterable

__all__ = ["CONTENT_TYPE", "Registry", "Counter", "Gauge", "GaugeFn", "Histogram",
           "DEFAULT_BUCKETS", "format_value"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

DEFAULT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


def format_value(v) -> str:
    """Render a sample value: exact integers, shortest round-trip floats, and
    the special spellings ``+Inf``, ``-Inf``, ``NaN``."""
    if isinstance(v, int):  # includes bool; exact, never exponent notation
        return str(int(v))
    v = float(v)
    if v != v:
        return "NaN"
    if v == math.inf:
        return "+Inf"
    if v == -math.inf:
        return "-Inf"
    # Integral floats print as integers ("3", "100000000000000000000", not
    # "3.0" or "1e+20"); every integral float is exact, so this loses nothing.
    # Past 1e21 the digit string gets silly and repr's exponent form is kept.
    if v.is_integer() and abs(v) < 1e21:
        return str(int(v))
    return repr(v)


def _escape_help(s: str) -> str:
    return s.replace("\\", "\\\\").replace("\n", "\\n")


def _escape_label_value(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _check_name(name) -> str:
    if not isinstance(name, str) or not _METRIC_NAME.fullmatch(name):
        raise ValueError(f"invalid metric name: {name!r}")
    return name


def _check_labels(labels, reserved=()) -> tuple:
    if isinstance(labels, str):  # labels="owner" would silently become 5 one-letter labels
        raise ValueError("labels must be a sequence of names, not a string")
    labels = tuple(labels)
    for ln in labels:
        if (not isinstance(ln, str) or not _LABEL_NAME.fullmatch(ln)
                or ln.startswith("__") or ln in reserved):
            raise ValueError(f"invalid label name: {ln!r}")
    if len(set(labels)) != len(labels):
        raise ValueError(f"duplicate label names: {labels!r}")
    return labels


class _Family:
    """Common part of a family: name, help, label names, children by label values."""

    type = "untyped"

    def __init__(self, name: str, help: str, labels: tuple):
        if not isinstance(help, str):
            raise ValueError("help must be a string")
        self.name = name
        self.help = help
        self.labelnames = labels
        self._lock = threading.Lock()
        self._children: dict = {}
        if not labels:  # an unlabelled family always has its one sample
            self._children[()] = self._new_child()

    def _new_child(self):
        raise NotImplementedError

    def _key(self, values: tuple, kw: dict) -> tuple:
        if kw:
            if values:
                raise ValueError("pass label values either positionally or by name")
            if len(kw) != len(self.labelnames) or not all(n in kw for n in self.labelnames):
                raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {tuple(kw)}")
            values = tuple(kw[n] for n in self.labelnames)
        elif len(values) != len(self.labelnames):
            raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {len(values)} values")
        return tuple(v if type(v) is str else str(v) for v in values)

    def labels(self, *values, **kw):
        """The child for these label values (created on first use, then cached)."""
        key = self._key(values, kw)
        child = self._children.get(key)
        if child is None:
            with self._lock:
                child = self._children.get(key)
                if child is None:
                    child = self._children[key] = self._new_child()
        return child

    def _child(self, kw: dict):
        # Fast path for the unlabelled family: no key building at all.
        if not kw and not self.labelnames:
            return self._children[()]
        return self.labels(**kw)

    def _pop_arg(self, arg: str, value, kw: dict):
        # inc(amount=5) and set(value=3) read naturally, but the parameter is
        # positional-only so a family may still declare a label of that name
        # (then the number must be passed positionally).
        if arg in kw and arg not in self.labelnames:
            return kw.pop(arg)
        return value

    def get(self, *values, **kw):
        """Current value for these label values; 0 (and no new child) if unseen."""
        child = self._children.get(self._key(values, kw))
        return child.get() if child is not None else 0

    def _snapshot(self) -> list:
        with self._lock:
            return list(self._children.items())

    def _samples(self) -> Iterable[tuple]:
        """Yield (sample_name, ((label, value), ...), number)."""
        for key, child in self._snapshot():
            yield self.name, tuple(zip(self.labelnames, key)), child.get()

    def _reserved_names(self) -> set:
        return {self.name}


class _CounterChild:
    __slots__ = ("_family", "_value")

    def __init__(self, family):
        self._family = family
        self._value = 0

    def inc(self, amount=1) -> None:
        # Counters only go up; NaN would poison every later rate().
        if not amount >= 0:
            raise ValueError(f"counter increment must be >= 0, got {amount!r}")
        with self._family._lock:
            self._value += amount

    def get(self):
        return self._value


class Counter(_Family):
    type = "counter"

    def __init__(self, name, help, labels):
        self.base = name[:-6] if name.endswith("_total") else name
        super().__init__(self.base + "_total", help, labels)

    def _new_child(self):
        return _CounterChild(self)

    def inc(self, amount=1, /, **labels) -> None:
        amount = self._pop_arg("amount", amount, labels)
        self._child(labels).inc(amount)

    def _reserved_names(self):
        return {self.base, self.name}


class _GaugeChild:
    __slots__ = ("_family", "_value")

    def __init__(self, family):
        self._family = family
        self._value = 0

    def set(self, value) -> None:
        self._value = value  # a single store needs no lock

    def inc(self, amount=1) -> None:
        with self._family._lock:
            self._value += amount

    def dec(self, amount=1) -> None:
        with self._family._lock:
            self._value -= amount

    def get(self):
        return self._value


class Gauge(_Family):
    type = "gauge"

    def _new_child(self):
        return _GaugeChild(self)

    def set(self, value=None, /, **labels) -> None:
        value = self._pop_arg("value", value, labels)
        if value is None:
            raise TypeError("set() needs a value")
        self._child(labels).set(value)

    def inc(self, amount=1, /, **labels) -> None:
        amount = self._pop_arg("amount", amount, labels)
        self._child(labels).inc(amount)

    def dec(self, amount=1, /, **labels) -> None:
        amount = self._pop_arg("amount", amount, labels)
        self._child(labels).dec(amount)


class GaugeFn(_Family):
    """A gauge whose samples come from ``fn()`` at scrape time.

    Without labels ``fn`` returns a number. With labels it returns an iterable
    of ``(label_values_tuple, number)`` (a mapping's ``.items()`` works).
    Rows of the wrong shape are skipped rather than failing the scrape.
    """

    type = "gauge"

    def __init__(self, name, help, fn, labels):
        if not callable(fn):
            raise ValueError("gauge_fn needs a callable")
        self._fn = fn
        super().__init__(name, help, labels)
        self._children.clear()

    def _new_child(self):
        return None

    def labels(self, *values, **kw):
        raise TypeError(f"{self.name} is computed at scrape time and has no children")

    def get(self, *values, **kw):
        raise TypeError(f"{self.name} is computed at scrape time; call expose()")

    def _samples(self):
        result = self._fn()
        n = len(self.labelnames)
        if not n and not hasattr(result, "__iter__"):
            return [(self.name, (), result)]
        rows = []
        for row in result:
            try:
                key, value = row
                # A bare value is accepted for a one-label family: ("gpu0", 5).
                key = tuple(key) if isinstance(key, (tuple, list)) else (key,)
                if len(key) != n:
                    continue
                float(value)  # reject non-numbers now, not halfway through output
            except (TypeError, ValueError):
                continue
            rows.append((self.name, tuple(zip(self.labelnames, map(str, key))), value))
        return rows


class _HistogramChild:
    __slots__ = ("_family", "_counts", "_sum", "_count")

    def __init__(self, family):
        self._family = family
        self._counts = [0] * (len(family.bounds) + 1)  # last slot is +Inf
        self._sum = 0.0
        self._count = 0

    def observe(self, value) -> None:
        value = float(value)
        # NaN compares false with every bound; it belongs only to +Inf.
        i = bisect.bisect_left(self._family.bounds, value) if value == value else len(self._counts) - 1
        with self._family._lock:
            self._counts[i] += 1
            self._sum += value
            self._count += 1

    def get(self):
        with self._family._lock:
            return list(self._counts), self._sum, self._count


class Histogram(_Family):
    """Fixed-bucket histogram: ``_bucket{le=..}`` (cumulative, ending at
    ``+Inf`` == ``_count``), ``_sum`` and ``_count``."""

    type = "histogram"

    def __init__(self, name, help, buckets, labels):
        bounds = [float(b) for b in buckets]
        if bounds and bounds[-1] == math.inf:
            bounds.pop()  # +Inf is always implied
        if any(not math.isfinite(b) for b in bounds) or any(a >= b for a, b in zip(bounds, bounds[1:])):
            raise ValueError(f"histogram buckets must be finite and strictly increasing: {buckets!r}")
        self.bounds = tuple(bounds)
        self._les = tuple(format_value(b) for b in bounds) + ("+Inf",)
        super().__init__(name, help, labels)

    def _new_child(self):
        return _HistogramChild(self)

    def observe(self, value=None, /, **labels) -> None:
        value = self._pop_arg("value", value, labels)
        if value is None:
            raise TypeError("observe() needs a value")
        self._child(labels).observe(value)

    def get(self, *values, **kw):
        """(per-bucket counts incl. +Inf, sum, count) for these label values."""
        child = self._children.get(self._key(values, kw))
        return child.get() if child is not None else ([0] * len(self._les), 0.0, 0)

    def _samples(self):
        for key, child in self._snapshot():
            counts, total, count = child.get()
            base = tuple(zip(self.labelnames, key))
            cum = 0
            for le, c in zip(self._les, counts):
                cum += c
                yield self.name + "_bucket", base + (("le", le),), cum
            yield self.name + "_sum", base, total
            yield self.name + "_count", base, count

    def _reserved_names(self):
        return {self.name, self.name + "_bucket", self.name + "_sum", self.name + "_count"}


class Registry:
    """Metric families in registration order, exposed as Prometheus text."""

    def __init__(self):
        self._families: list = []
        self._names: set = set()
        self._lock = threading.Lock()
        self.scrape_errors = 0  # gauge_fn callbacks that raised during expose()

    def _register(self, family):
        reserved = family._reserved_names()
        with self._lock:
            clash = reserved & self._names
            if clash:
                raise ValueError(f"metric name already registered: {sorted(clash)[0]}")
            self._names |= reserved
            self._families.append(family)
        return family

    def counter(self, name: str, help: str, labels=()) -> Counter:
        return self._register(Counter(_check_name(name), help, _check_labels(labels)))

    def gauge(self, name: str, help: str, labels=()) -> Gauge:
        return self._register(Gauge(_check_name(name), help, _check_labels(labels)))

    def gauge_fn(self, name: str, help: str, fn: Callable, labels=()) -> GaugeFn:
        return self._register(GaugeFn(_check_name(name), help, fn, _check_labels(labels)))

    def histogram(self, name: str, help: str, buckets=DEFAULT_BUCKETS, labels=()) -> Histogram:
        return self._register(Histogram(_check_name(name), help, buckets,
                                        _check_labels(labels, reserved=("le",))))

    def get(self, name: str):
        """The family exposed under ``name`` (counters: the ``_total`` name), or None."""
        for f in self._families:
            if f.name == name:
                return f
        return None

    def expose(self) -> str:
        out = []
        for fam in list(self._families):
            out.append(f"# HELP {fam.name} {_escape_help(fam.help)}\n# TYPE {fam.name} {fam.type}\n")
            try:
                samples = list(fam._samples())
            except Exception:  # one broken owner callback must not break the scrape
                self.scrape_errors += 1
                continue
            for sname, labels, value in samples:
                try:
                    text = format_value(value)
                except (TypeError, ValueError, OverflowError):
                    continue
                if labels:
                    body = ",".join(f'{k}="{_escape_label_value(v)}"' for k, v in labels)
                    out.append(f"{sname}{{{body}}} {text}\n")
                else:
                    out.append(f"{sname} {text}\n")
        return "".join(out)
