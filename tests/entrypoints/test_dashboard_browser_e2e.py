"""The dashboard in a real browser: Debian's headless Chromium, driven by selenium.

The page must load with no network beyond the server, fill its panels while
requests run, and end up showing the same numbers as ``/metrics``. A
screenshot is kept (``TOKENLOOM_DASHBOARD_SCREENSHOT`` names a copy to keep,
as docs/images/dashboard.png was made).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

from .server_utils import RemoteServer, metric_values, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

MODEL = "SmolLM2-135M-Instruct"
NUM_BLOCKS = 128
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    args = ["--max-model-len", "512", "--num-blocks", str(NUM_BLOCKS), "--max-num-seqs", "4"]
    server = RemoteServer(args, log)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    for path in (CHROMIUM, CHROMEDRIVER):
        assert Path(path).exists(), f"{path} is missing: apt-get install chromium chromium-driver"
    profile = tempfile.mkdtemp(prefix="tokenloom-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--window-size=1400,1600",
        f"--user-data-dir={profile}",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def value(driver: webdriver.Chrome, element_id: str) -> float | None:
    """The raw number behind a summary card (None before the first update)."""
    raw = driver.find_element(By.ID, element_id).get_attribute("data-value")
    return float(raw) if raw else None


def panel_value(driver: webdriver.Chrome, selector: str) -> float | None:
    raw = driver.find_element(By.CSS_SELECTOR, selector).get_attribute("data-value")
    return float(raw) if raw else None


def total(metrics: dict[str, float], name: str) -> float:
    return sum(v for k, v in metrics.items() if k.startswith(name + "{"))


def send_requests(server: RemoteServer, count: int, results: list[Any]) -> list[threading.Thread]:
    def one(i: int) -> None:
        body = {
            "model": MODEL,
            "prompt": f"Request {i}: write a long story about a lighthouse keeper and the sea.",
            "max_tokens": 64,
            "ignore_eos": True,
            "temperature": 0,
        }
        results.append(httpx.post(server.url + "/v1/completions", json=body, timeout=300))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    return threads


def test_the_dashboard_fills_live_and_agrees_with_metrics(
    server: RemoteServer, browser: webdriver.Chrome, tmp_path: Path
) -> None:
    browser.get(server.url + "/dashboard?interval=0.25")
    wait_until(
        lambda: browser.find_element(By.ID, "status").get_attribute("data-state") == "live",
        30,
        "the event stream to connect",
    )
    assert browser.find_element(By.ID, "model").text == MODEL
    wait_until(lambda: browser.find_elements(By.CSS_SELECTOR, "section.engine"), 10, "a panel")

    results: list[Any] = []
    threads = send_requests(server, 6, results)
    # While they run: the page shows requests running, as /metrics does.
    wait_until(lambda: (value(browser, "running") or 0) > 0, 120, "running requests on the page")
    gauge = metric_values(server.url)["tokenloom:num_requests_running{}"]
    assert gauge > 0
    wait_until(
        lambda: (panel_value(browser, '[data-count="used"]') or 0) > 0,
        30,
        "used blocks in the KV block map",
    )
    for t in threads:
        t.join(timeout=300)
    assert len(results) == 6 and all(r.status_code == 200 for r in results)

    def settled() -> bool:
        return value(browser, "finished") == 6 and value(browser, "running") == 0

    wait_until(settled, 60, "the page to show every request finished")
    metrics = metric_values(server.url)
    assert value(browser, "finished") == total(metrics, "tokenloom:request_success_total")
    assert value(browser, "generation-tokens") == metrics["tokenloom:generation_tokens_total{}"]
    assert value(browser, "generation-tokens") == 6 * 64
    assert value(browser, "prompt-tokens") == metrics["tokenloom:prompt_tokens_total{}"]
    assert value(browser, "preemptions") == metrics["tokenloom:num_preemptions_total{}"]
    assert value(browser, "waiting") == metrics["tokenloom:num_requests_waiting{}"] == 0
    hits = metrics["tokenloom:prefix_cache_hits_total{}"]
    queries = metrics["tokenloom:prefix_cache_queries_total{}"]
    assert value(browser, "hit-rate") == pytest.approx(hits / queries)
    # TTFT p50 on the page is positive and below the sum of all TTFTs on /metrics.
    ttft_p50 = value(browser, "ttft")
    assert (
        ttft_p50 is not None
        and 0 < ttft_p50 < metrics["tokenloom:time_to_first_token_seconds_sum{}"]
    )

    # Every block of the cache is on the map; each step's batch was drawn.
    counts = [
        panel_value(browser, f'[data-count="{k}"]') for k in ("free", "cached", "used", "shared")
    ]
    assert sum(c or 0 for c in counts) == NUM_BLOCKS - 1
    assert len(browser.find_elements(By.CSS_SELECTOR, ".uplot")) == 4
    steps = panel_value(browser, '[data-field="steps"]')
    assert steps is not None and steps >= 64
    # The rows are redrawn with every update: read them in one go.
    finishes = browser.execute_script(
        "return [...document.querySelectorAll('table.requests tbody tr')]"
        ".map((row) => row.lastChild.textContent)"
    )
    assert finishes[:6] == ["length"] * 6
    errors = [
        e
        for e in browser.get_log("browser")
        if e["level"] == "SEVERE" and "favicon" not in e["message"]
    ]
    assert not errors

    time.sleep(1.0)  # one more sample on the time series before the picture
    shot = tmp_path / "dashboard.png"
    assert browser.save_screenshot(str(shot))
    keep = os.environ.get("TOKENLOOM_DASHBOARD_SCREENSHOT")
    if keep:
        shutil.copyfile(shot, keep)
