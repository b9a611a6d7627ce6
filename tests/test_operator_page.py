"""The operator page end to end: `kvgate up`, then a real headless Chromium (Debian's
`chromium`, driven by Playwright) opens /ui/ with the admin token: the page shows the
workers, updates after a completion goes through the router, lists an open alert that can be
acknowledged from the page, and a screenshot is taken."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import urllib.request
from pathlib import Path

import pytest

from services.common.bus import Bus, NatsAuth
from services.common.schemas import Alert
from services.common.streams import raise_alert, require_alert_streams
from services.common.subjects import Subjects
from tests.up_stack import UpStack

pytestmark = pytest.mark.slow

CHROMIUM = "/usr/bin/chromium"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def _complete(router_port: int, auth: dict[str, str], prompt: str, session: str = "") -> str:
    body = json.dumps({"model": "sim-llama-8b", "prompt": prompt, "max_tokens": 4}).encode()
    headers = {"Content-Type": "application/json", **auth}
    if session:
        headers["x-session-id"] = session
    req = urllib.request.Request(
        f"http://127.0.0.1:{router_port}/v1/completions", data=body, headers=headers
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(req, timeout=30) as resp:
        assert resp.status == 200
        return resp.headers["x-kvgate-worker"]


def _complete_when_known(router_port: int, auth: dict[str, str]) -> None:
    """A completion with a key just issued: refused (401) until the router has the api's
    directory (within a second)."""
    import time
    import urllib.error

    deadline = time.monotonic() + 10
    while True:
        try:
            _complete(router_port, auth, "tenant traffic")
            return
        except urllib.error.HTTPError as exc:
            if exc.code != 401 or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _admin(api: str, token: str, method: str, path: str, body: dict | None = None) -> dict:
    req = urllib.request.Request(
        api + path,
        method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(req, timeout=30) as resp:
        return json.loads(resp.read())


async def _raise(nats_url: str, prefix: str, state: Path) -> None:
    # as the telemetry agent would: with the telemetry user `kvgate up` generated
    passwords = json.loads((state / "nats" / "passwords.json").read_text())
    auth = NatsAuth(user="telemetry", password=passwords["telemetry"])
    bus = Bus(nats_url, "test-operator-page", Subjects(prefix), auth=auth, role="telemetry")
    await bus.connect(max_wait_s=10)
    try:
        await require_alert_streams(bus)
        await raise_alert(
            bus,
            Alert(
                fingerprint="kv_starved:page-test",
                kind="kv_starved",
                severity="warning",
                source="telemetry",
                worker_id="page-test-worker",
                summary="page-test: 8 active, 1 scheduled",
            ),
        )
        # one that fired and resolved before anyone looked: the page's recent history
        gone = Alert(
            fingerprint="kv_starved:page-history",
            kind="kv_starved",
            severity="warning",
            source="telemetry",
            worker_id="page-history-worker",
            summary="page-history: was starved",
        )
        await raise_alert(bus, gone)
        gone.state = "resolved"
        await raise_alert(bus, gone)
    finally:
        await bus.close()


def test_operator_page_in_headless_chromium(tmp_path: Path) -> None:
    from playwright.sync_api import expect, sync_playwright

    assert shutil.which(CHROMIUM) or os.path.exists(CHROMIUM), (
        "Debian's chromium is missing: apt-get install chromium (make test installs it)"
    )
    up = UpStack(tmp_path / "state")
    try:
        out = up.banner()
        token = next(ln for ln in out.splitlines() if "admin token" in ln).split(":", 1)[1]
        token = token.split()[0]
        stack = json.loads((tmp_path / "state" / "stack.json").read_text())
        asyncio.run(_raise(stack["nats_url"], stack["subject_prefix"], tmp_path / "state"))
        api = f"http://127.0.0.1:{up.ports['api']}"
        stack_worker = _complete(
            up.ports["router"], up.auth(), "warm up"
        )  # the one simulated worker
        # a canary that stays running (its criteria ask for more samples than the test sends)
        _admin(
            api, token, "POST", "/api/v1/policies", {"name": "ctl", "spec": {"name": "round_robin"}}
        )
        _admin(api, token, "POST", "/api/v1/policies/ctl/activate")
        _admin(
            api,
            token,
            "POST",
            "/api/v1/policies",
            {"name": "cand", "spec": {"name": "least_request"}},
        )
        canary = _admin(
            api,
            token,
            "POST",
            "/api/v1/canaries",
            {"policy": "cand", "steps": [0.5, 1.0], "step_duration_s": 3600,
             "criteria": {"min_samples": 100000}},
        )  # fmt: skip
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1100})
                errors: list[str] = []
                page.on("pageerror", lambda e: errors.append(str(e)))
                # every request the page makes (the favicon included) is answered
                page.on(
                    "response",
                    lambda r: r.status >= 400 and errors.append(f"{r.status} {r.url}"),
                )
                page.goto(f"{api}/ui/#token={token}")
                # the token left the address bar; the workers are listed
                workers = page.locator("#workers tbody tr")
                expect(workers).to_have_count(1, timeout=20_000)
                expect(workers.first.locator("td").nth(1)).to_have_text("healthy")
                expect(workers.first.locator("td").first).to_have_text(stack_worker)
                assert "token=" not in page.url
                # a completion through the router shows up as a routing decision
                worker = _complete(up.ports["router"], up.auth(), "hello operator page")
                row = page.locator("#decisions tbody tr").first
                expect(row).to_contain_text(worker, timeout=15_000)
                expect(row).to_contain_text("ok")
                expect(
                    page.locator(f'#workers tr[data-worker="{worker}"] td.routed')
                ).not_to_have_text("0")
                # reuse attribution: available / captured / delivered / prompt, and the split
                # over the kept requests (one worker: whatever is available is captured)
                expect(row.locator("td.reuse")).to_have_text(
                    re.compile(r"^(\d+) / \1 / \d+ / \d+$")
                )
                expect(page.locator("#reuse")).to_contain_text(
                    re.compile(r"\d+% available, \d+% captured, \d+% delivered")
                )
                # a non-streamed request's TTFT is its total (marked), not "–"
                expect(row.locator("td").nth(7)).to_have_text(re.compile(r"^\d+\*$"))
                expect(row.locator("td").nth(8)).to_have_text(re.compile(r"^\d+$"))
                # each row shows its own request id (the unique end, the full id on hover)
                for i in range(3):
                    _complete(up.ports["router"], up.auth(), f"ids {i}")
                rids = page.locator("#decisions tbody td.rid")
                expect(rids.nth(4)).to_be_attached(timeout=15_000)  # warm-up, hello, 3 more
                n = rids.count()
                shown, full = (
                    rids.all_inner_texts(),
                    [rids.nth(i).get_attribute("title") for i in range(n)],
                )
                assert len(set(shown)) == n, shown
                for text, rid in zip(shown, full, strict=True):
                    head, _, tail = text.partition("…")
                    assert rid.startswith(head) and rid.endswith(tail), (text, rid)
                # the header's rate is live: requests in the last seconds, not the last burst
                rate = page.locator("#decisions-rate")
                expect(rate).to_contain_text(re.compile(r"\(0\.[1-9]|\([1-9]"))
                # the canary: both arms' curves and the header's policy line
                for i in range(12):  # sessions spread over both arms
                    _complete(up.ports["router"], up.auth(), f"canary traffic {i}", session=f"s{i}")
                box = page.locator(f'[data-canary="{canary["id"]}"]')
                expect(box).to_contain_text("ctl@1", timeout=15_000)
                expect(box).to_contain_text("cand@1")
                expect(box.locator("svg")).to_have_count(3)
                # each arm's points (TTFT p95, hit rate, error rate of the current window)
                expect(box.locator('svg circle[fill="#d62728"]').first).to_be_visible(
                    timeout=20_000
                )  # candidate
                expect(box.locator('svg circle[fill="#2563eb"]').first).to_be_visible()
                # labelled axes: the x axis says what it is and has round ticks
                chart = box.locator("svg").first
                expect(chart.locator("text.xlabel")).to_have_text("time since the canary started")
                assert chart.locator("text.xtick").count() >= 2
                for tick in chart.locator("text.xtick").all_text_contents():
                    assert re.fullmatch(r"\d+(\.\d)? (s|min|h)", tick), tick
                yticks = [float(t) for t in chart.locator("text.ytick").all_text_contents()]
                steps = {round(b - a, 9) for a, b in zip(yticks, yticks[1:], strict=False)}
                assert len(steps) == 1 and str(steps.pop()).lstrip("0.")[0] in "125", yticks
                expect(page.locator("#policy")).to_contain_text("policy ctl@1, canary cand@1")
                # a tenant and its usage: a request with its key, counted on the page
                _admin(api, token, "POST", "/api/v1/tenants", {"tenant_id": "page-team"})
                key = _admin(api, token, "POST", "/api/v1/tenants/page-team/keys", {})["key"]
                _complete_when_known(up.ports["router"], {"Authorization": f"Bearer {key}"})
                team = page.locator('#tenants tr[data-tenant="page-team"] td')
                expect(team.nth(4)).to_have_text("1", timeout=20_000)  # requests
                expect(team.nth(6)).to_have_text(re.compile(r"^\d+\.\d%$"))  # served from cache
                # the open alert is listed and can be acknowledged from the page
                alert = page.locator("#alerts tbody tr", has_text="page-test")
                expect(alert).to_have_count(1, timeout=15_000)
                alert.get_by_role("button", name="ack").click()
                expect(alert.locator("td").nth(4)).to_have_text("acknowledged", timeout=10_000)
                # recent history: the alert that fired and resolved before the page opened
                past = page.locator("#alerts-history tbody tr", has_text="page-history")
                expect(past).to_have_count(1)
                expect(past.locator("td").nth(5)).to_have_text("source:telemetry")
                expect(page.locator("#alerts tbody tr", has_text="page-history")).to_have_count(0)
                shot = tmp_path / "operator-page.png"
                page.screenshot(path=str(shot), full_page=True)
                assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
                keep = os.environ.get("KVGATE_TEST_SCREENSHOT")
                if keep:
                    shutil.copy(shot, keep)
                # once the load stops, the rate falls to zero (window of 10 s)
                expect(rate).to_contain_text("(0.0 req/s", timeout=30_000)
                assert errors == [], errors
            finally:
                browser.close()
        # the browser's own favicon request is answered with the page's icon
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
            f"{api}/favicon.ico", timeout=10
        ) as icon:
            assert icon.status == 200 and icon.headers["Content-Type"] == "image/svg+xml"
            assert icon.read().startswith(b"<svg")
        # the page is a shell: without a token the data endpoints refuse
        with pytest.raises(urllib.error.HTTPError) as denied:
            urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
                f"{api}/api/v1/decisions", timeout=10
            )
        assert denied.value.code == 401
    finally:
        up.stop()
