"""Loop metrics expose exactly what prometheus-client's own metrics expose for the same updates
(the library is the reference: same registry text but for the ``_created`` timestamps)."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from services.common.loop_metrics import LoopCounter, LoopGauge, LoopHistogram

BUCKETS = (0.005, 0.01, 0.025, 0.1, 1, 2.5, 60)


def _text(reg: CollectorRegistry) -> list[str]:
    return sorted(
        line
        for line in generate_latest(reg).decode().splitlines()
        if "_created" not in line  # creation timestamps differ by construction
    )


def _pair(kind: str, labels: tuple[str, ...]):
    ref_reg, loop_reg = CollectorRegistry(), CollectorRegistry()
    name = {"c": "t_requests_total", "g": "t_inflight", "h": "t_seconds"}[kind]
    if kind == "c":
        ref = Counter(name, "help text", labels, registry=ref_reg)
        ours = LoopCounter(name, "help text", labels, registry=loop_reg)
    elif kind == "g":
        ref = Gauge(name, "help text", labels, registry=ref_reg)
        ours = LoopGauge(name, "help text", labels, registry=loop_reg)
    else:
        ref = Histogram(name, "help text", labels, registry=ref_reg, buckets=BUCKETS)
        ours = LoopHistogram(name, "help text", labels, registry=loop_reg, buckets=BUCKETS)
    return ref_reg, ref, loop_reg, ours


@pytest.mark.parametrize("kind", ["c", "g", "h"])
@pytest.mark.parametrize("labels", [(), ("policy", "status")])
@pytest.mark.parametrize("seed", range(5))
def test_same_exposition_as_prometheus_client(kind: str, labels: tuple[str, ...], seed: int):
    rng = random.Random(seed)
    ref_reg, ref, loop_reg, ours = _pair(kind, labels)
    values = [*BUCKETS, 0.0, -1.0, 1e9, 0.0051]  # bounds themselves, below, above
    for _ in range(300):
        lv = (rng.choice(["a", "b"]), rng.choice(["ok", "error"])) if labels else ()
        r, o = (ref.labels(*lv), ours.labels(*lv)) if labels else (ref, ours)
        if kind == "c":
            n = rng.choice([1, 2.5, 7])
            r.inc(n)
            o.inc(n)
        elif kind == "g":
            op, n = rng.choice(["inc", "dec", "set"]), rng.choice([1, 3.25, -2])
            getattr(r, op)(n)
            getattr(o, op)(n)
        else:
            v = rng.choice(values) if rng.random() < 0.5 else rng.uniform(0, 100)
            r.observe(v)
            o.observe(v)
    assert _text(loop_reg) == _text(ref_reg)


def test_counter_refuses_to_go_down_and_exposes_created():
    reg = CollectorRegistry()
    c = LoopCounter("t_things_total", "things", registry=reg)
    c.inc(2)
    with pytest.raises(ValueError):
        c.inc(-1)
    assert c.value == 2
    assert reg.get_sample_value("t_things_total") == 2
    assert reg.get_sample_value("t_things_created") is not None


def test_gauge_function_read_at_scrape():
    reg = CollectorRegistry()
    g = LoopGauge("t_ratio", "ratio", ["kind"], registry=reg)
    box = {"v": 0.25}
    g.labels("x").set_function(lambda: box["v"])
    assert reg.get_sample_value("t_ratio", {"kind": "x"}) == 0.25
    box["v"] = 0.5
    assert reg.get_sample_value("t_ratio", {"kind": "x"}) == 0.5


def test_wrong_label_count_and_duplicate_name_are_errors():
    reg = CollectorRegistry()
    h = LoopHistogram("t_lat_seconds", "lat", ["policy"], registry=reg)
    with pytest.raises(ValueError):
        h.labels("a", "b")
    with pytest.raises(ValueError):  # the registry refuses a second metric of that name
        LoopHistogram("t_lat_seconds", "lat", registry=reg)
    with pytest.raises(ValueError):
        LoopHistogram("t_bad_seconds", "bad", registry=reg, buckets=(1.0, 0.5))
