"""Metrics summary and report generation (JSON, Markdown, PNG plots)."""

from __future__ import annotations

import json

import pytest

from bench.metrics import (
    ERROR,
    OK,
    TIMEOUT,
    CacheCounters,
    RequestResult,
    histogram_cdf,
    inflight_series,
    inflight_stats,
    itl_histogram,
    percentile,
    summarize,
)
from bench.report import comparisons, markdown, new_report, write_report
from bench.scrape import delta, parse_counters


def test_percentile_interpolates():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1, 2, 3, 4], 50) == pytest.approx(2.5)
    assert percentile(list(range(101)), 99) == pytest.approx(99)


def test_inflight_stats_and_series():
    iv = [(0.0, 2.0), (1.0, 3.0), (1.5, 2.5)]
    peak, mean = inflight_stats(iv, 0.0, 4.0)
    assert peak == 3
    assert mean == pytest.approx((2 + 2 + 1) / 4)
    # back-to-back intervals never overlap
    assert inflight_stats([(0, 1), (1, 2)], 0, 2)[0] == 1
    ser = inflight_series(iv, 4.0, bins=4)
    assert ser == pytest.approx([1.0, 2.5, 1.5, 0.0])


def test_itl_histogram_is_bounded_and_its_cdf_matches_the_samples():
    # 100k gaps: 99% at 10 ms, 1% at 200 ms (prefill stalls), plus out-of-range values
    gaps = [0.010] * 99_000 + [0.200] * 1_000 + [1e-6, 5e3]
    h = itl_histogram(gaps)
    assert len(h["counts"]) <= 280 and sum(h["counts"]) == len(gaps)
    xs, ys = histogram_cdf(h)
    assert ys[-1] == pytest.approx(1.0)
    # the first bin's upper edge covers the tiny gap; 10 ms sits below the next edge at 6% bins
    at = dict(zip(xs, ys, strict=True))
    below_20ms = max(y for x, y in at.items() if x < 0.020)
    assert below_20ms == pytest.approx(99_001 / len(gaps))
    edge_200 = min(x for x in xs if x > 0.2)
    assert 0.2 < edge_200 <= 0.2 * 10 ** (1 / 40) + 1e-12
    assert histogram_cdf({"counts": []}) == ([], [])


def _results():
    rs = []
    for i in range(10):
        w = "a" if i < 7 else "b"
        rs.append(
            RequestResult(
                f"r{i}",
                OK,
                worker=w,
                send_s=i * 0.1,
                ttft_s=0.01 * (i + 1),
                e2e_s=0.5,
                itl_s=[0.002, 0.004],
                prompt_tokens=100,
                completion_tokens=3,
                cached_tokens=50,
            )
        )
    rs.append(RequestResult("bad", ERROR, send_s=0.2, e2e_s=0.1, error="HTTP 500"))
    rs.append(RequestResult("slow", TIMEOUT, send_s=0.3, e2e_s=5.0))
    return rs


def test_summarize_counts_shares_and_hit_rates():
    cache = CacheCounters(queries=1000, hits=400, per_worker={"a": (700, 300), "b": (300, 100)})
    s = summarize(_results(), ["a", "b", "c"], cache, duration_s=2.0, bins=10)
    assert (s["requests"], s["completed"], s["errors"], s["timeouts"]) == (12, 10, 1, 1)
    assert s["ttft_s"]["p50"] == pytest.approx(0.055)
    assert s["itl_s"]["max"] == pytest.approx(0.004)
    assert sum(s["itl_hist"]["counts"]) == 20  # 2 gaps x 10 completed requests
    assert s["request_throughput"] == pytest.approx(5.0)
    assert s["output_token_throughput"] == pytest.approx(15.0)
    assert s["hit_rate"] == pytest.approx(0.4)
    assert s["hit_rate_reported"] == pytest.approx(0.5)
    pw = s["per_worker"]
    assert pw["a"]["requests"] == 7 and pw["b"]["requests"] == 3 and pw["c"]["requests"] == 0
    assert pw["a"]["fair_ratio"] == pytest.approx(7 / (10 / 3))
    assert pw["a"]["hit_rate"] == pytest.approx(300 / 700)
    assert s["workers_used"] == 2 and s["fair_ratio_min"] == 0.0
    assert pw["a"]["max_inflight"] == 5  # 0.5 s each, one every 0.1 s
    assert len(s["inflight_series"]["workers"]["a"]) == 10


def test_prometheus_counter_parsing_and_delta():
    page = (
        "# HELP vllm:prefix_cache_queries Prefix cache queries (tokens)\n"
        "# TYPE vllm:prefix_cache_queries counter\n"
        'vllm:prefix_cache_queries_total{model_name="m"} 120.0\n'
        "# HELP vllm:prefix_cache_hits Prefix cache hits (tokens)\n"
        "# TYPE vllm:prefix_cache_hits counter\n"
        'vllm:prefix_cache_hits_total{model_name="m"} 30.0\n'
        "# TYPE other counter\nother_total 5\n"
    )
    got = parse_counters(page)
    assert got == {"vllm:prefix_cache_queries": 120.0, "vllm:prefix_cache_hits": 30.0}
    before = {"w0": {"vllm:prefix_cache_queries": 20.0, "vllm:prefix_cache_hits": 10.0}}
    cc = delta(before, {"w0": got, "w1": got})  # w1 has no "before": skipped
    assert (cc.queries, cc.hits) == (100.0, 20.0) and cc.hit_rate == pytest.approx(0.2)


def _report():
    rep = new_report("unit", "bench", {"workers": 2}, {"name": "x", "requests": 12})
    rep["workload"]["infinite_cache_hit_rate"] = 0.8
    cache = CacheCounters(queries=1000, hits=400)
    rep["runs"].append({"label": "round_robin", "summary": summarize(_results(), ["a", "b"])})
    rep["runs"].append(
        {"label": "kv_aware", "summary": summarize(_results()[:8], ["a", "b"], cache)}
    )
    rep["runs"][0]["summary"]["hit_rate"] = 0.2
    return rep


def test_comparisons_and_markdown():
    rep = _report()
    comp = comparisons(rep)
    kv, rr = rep["runs"][1]["summary"], rep["runs"][0]["summary"]
    assert comp["kv_aware"]["ttft_p50_vs_round_robin"] == pytest.approx(
        kv["ttft_s"]["p50"] / rr["ttft_s"]["p50"]
    )
    assert comp["kv_aware"]["hit_rate_vs_bound"] == pytest.approx(0.4 / 0.8)
    assert comp["kv_aware"]["hit_rate_minus_round_robin"] == pytest.approx(0.2)
    md = markdown(rep)
    assert "| `kv_aware` | 8 |" in md and "| `round_robin` | 10 | 1 | 1 |" in md
    assert "40.0%" in md  # kv_aware's ground-truth hit rate


def test_write_report_files(tmp_path):
    files = write_report(_report(), tmp_path / "out")
    names = sorted(f.name for f in files)
    assert names == [
        "hit_rate.png",
        "latency_cdf.png",
        "results.json",
        "results.md",
        "ttft_cdf.png",
        "worker_load.png",
    ]
    for f in files:
        assert f.stat().st_size > 0
        if f.suffix == ".png":
            assert f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [r["label"] for r in data["runs"]] == ["round_robin", "kv_aware"]
    assert "comparisons" in data


def test_compare_reports_agreement():
    from bench.compare import compare
    from bench.compare import markdown as cmp_md

    def rep(name, rows):
        return {
            "name": name,
            "runs": [
                {"label": lbl, "summary": {"hit_rate": h, "ttft_s": {"p50": p50, "p99": p99}}}
                for lbl, h, p50, p99 in rows
            ],
        }

    a = rep("bench", [("rr", 0.50, 0.10, 0.9), ("kv", 0.80, 0.05, 0.3), ("px", 0.805, 0.2, 2.0)])
    b = rep("sim", [("rr", 0.52, 0.11, 1.0), ("kv", 0.78, 0.06, 0.2), ("px", 0.83, 0.07, 1.5)])
    c = compare(a, b)
    assert c["max_hit_rate_diff"] == pytest.approx(0.025)
    # hit rate: rr<kv and rr<px agree; kv/px is within the 1-point tie band in a -> not counted
    assert c["rankings"]["hit_rate"] == {"agree": 2, "disagree": 0, "disagreeing_pairs": []}
    # p50: px is slowest in a but faster than rr in b -> one disagreement
    assert c["rankings"]["ttft_p50"]["disagreeing_pairs"] == [("px", "rr")]
    assert "Largest hit-rate difference: 2.5 points." in cmp_md(c)


def _policy_report():
    """The eight built-in policies: the eighth colour of matplotlib's cycle is grey."""
    rep = _report()
    base = rep["runs"][1]["summary"]
    rep["runs"] = [
        {"label": p, "summary": base}
        for p in (
            "round_robin",
            "random",
            "least_request",
            "power_of_two",
            "prefix",
            "kv_load",
            "gpu_aware",
            "kv_aware",
        )
    ]
    return rep


def test_plot_colours_none_grey_and_distinct():
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.colors import to_rgb

    from bench.report import run_colors, ttft_cdf_figure

    rep = _policy_report()
    colors = run_colors([r["label"] for r in rep["runs"]])
    assert len(set(colors.values())) == len(colors)
    fig = ttft_cdf_figure(rep)
    for line in fig.axes[0].get_lines():
        r, g, b = to_rgb(line.get_color())
        assert max(r, g, b) - min(r, g, b) > 0.15, (line.get_label(), line.get_color())  # grey


def test_ttft_cdf_log_axis_has_readable_ticks():
    import matplotlib

    matplotlib.use("Agg")
    from bench.report import ttft_cdf_figure

    fig = ttft_cdf_figure(_report())
    fig.canvas.draw()
    ax = fig.axes[0]
    lo, hi = ax.get_xlim()
    shown = [
        t.get_text()
        for t, v in zip(ax.get_xticklabels(), ax.get_xticks(), strict=True)
        if t.get_text() and lo <= v <= hi
    ]
    assert len(shown) >= 3, shown  # was a single label on a 10..100 ms range
    assert all("$" not in t and "e" not in t for t in shown), shown  # plain ms numbers


def test_load_panels_share_a_y_scale_and_hit_bars_are_labelled():
    import matplotlib

    matplotlib.use("Agg")
    from bench.report import hit_rate_figure, worker_load_figure

    rep = _report()
    rep["runs"][1]["summary"] = dict(rep["runs"][1]["summary"])
    rep["runs"][1]["summary"]["inflight_series"] = {"bin_s": 0.1, "workers": {"a": [40, 80]}}
    fig = worker_load_figure(rep)
    a, b = fig.axes[0], fig.axes[1]
    assert a.get_ylim() == b.get_ylim()
    bars = hit_rate_figure(rep)
    texts = [t.get_text() for t in bars.axes[0].texts]
    assert "20.0%" in texts and "40.0%" in texts


def _same_runs(labels: tuple[str, ...], itl_ms: tuple[float, ...] = (10.0, 11.0, 12.5)):
    """Runs with identical numbers (as the simulator often gives), narrow ITLs, high hit rates."""
    rep = _report()
    base = dict(rep["runs"][1]["summary"])
    base["itl_hist"] = itl_histogram([x / 1000 for x in itl_ms for _ in range(50)])
    rep["runs"] = [{"label": lbl, "summary": base} for lbl in labels]
    return rep


def test_kv_aware_and_slo_aware_are_told_apart_at_a_glance():
    from matplotlib.colors import to_rgb

    from bench.report import run_colors

    c = run_colors(["kv_aware", "slo_aware"])
    a, b = to_rgb(c["kv_aware"]), to_rgb(c["slo_aware"])
    assert sum((x - y) ** 2 for x, y in zip(a, b, strict=True)) ** 0.5 > 0.5, c  # was red/dark red


def test_identical_curves_stay_visible_and_legends_sit_beside_the_plots():
    import matplotlib

    matplotlib.use("Agg")
    from bench.report import latency_cdf_figure, ttft_cdf_figure

    rep = _same_runs(("round_robin", "kv_aware", "slo_aware"))
    for make in (ttft_cdf_figure, latency_cdf_figure):
        fig = make(rep)
        fig.canvas.draw()
        for ax in fig.axes:
            lines = [ln for ln in ax.get_lines() if ln.get_label() in {"kv_aware", "slo_aware"}]
            styles = {(ln.get_linestyle(), round(ln.get_linewidth(), 2)) for ln in lines}
            assert len(styles) == len(lines) == 2, styles  # the same data, two visible lines
            assert ax.get_legend() is None  # no legend box inside a plot
        (legend,) = fig.legends
        box = legend.get_window_extent()
        for ax in fig.axes:
            assert not box.overlaps(ax.get_window_extent()), make.__name__


def test_a_narrow_itl_range_still_gets_three_round_ticks():
    import matplotlib

    matplotlib.use("Agg")
    from bench.report import _log_ticks, latency_cdf_figure

    assert len(_log_ticks(10.0, 13.0)) >= 3
    fig = latency_cdf_figure(_same_runs(("kv_aware",), itl_ms=(10.0, 10.5, 11.0)))
    fig.canvas.draw()
    itl = fig.axes[1]
    lo, hi = itl.get_xlim()
    shown = [
        t.get_text()
        for t, v in zip(itl.get_xticklabels(), itl.get_xticks(), strict=True)
        if t.get_text() and lo <= v <= hi
    ]
    assert len(shown) >= 3, shown  # was one tick


def test_hit_rate_axis_shows_a_small_gap_between_high_rates():
    import matplotlib

    matplotlib.use("Agg")
    from bench.report import hit_rate_figure, hit_rate_ylim

    rep = _same_runs(("kv_aware", "slo_aware"))
    rep["runs"][0]["summary"] = {**rep["runs"][0]["summary"], "hit_rate": 0.954}
    rep["runs"][1]["summary"] = {**rep["runs"][1]["summary"], "hit_rate": 0.968}
    rep["workload"]["infinite_cache_hit_rate"] = 0.975
    ax = hit_rate_figure(rep).axes[0]
    bottom, top = ax.get_ylim()
    assert (96.8 - 95.4) / (top - bottom) > 0.1  # was 1.4 points of a 0..105 axis
    assert "axis from" in ax.get_ylabel() and ax.get_legend() is None
    assert any("infinite-cache bound 97.5%" in t.get_text() for t in ax.texts)
    assert hit_rate_ylim([20.0, 40.0, 80.0])[0] == 0  # spread out: from 0 as before
