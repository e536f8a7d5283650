"""The dashboard in a real headless Chromium (Debian's chromium + chromium-driver, via Selenium).

The dashboards run as the command line runs them (``trio-redis-finalize
dashboard``, on trio and on asyncio), against a queue in trouble made for
real (``_dashboard_scenario``).  The overview shows the lagging group and
the stranded consumer; on the dead letters, a requeue asks first and, once
confirmed, the entry is back in the stream and gone from the dead letter;
a read-only dashboard refuses the action.  Each page's screenshot is saved
(``TRF_SCREENSHOTS``: a directory; default the test's tmp_path); with
``TRF_UPDATE_DOCS_SCREENSHOT=1`` the overview's also goes to
``docs/_static/dashboard-overview.png``.

Without the browser the tests fail in CI (``CI`` set: ``.ci/run`` installs
it) and are skipped elsewhere, saying what to install.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from _dashboard_scenario import BAD, DEAD, STREAM, make_healthy, make_trouble
from _paths import ROOT

from trio_redis_finalize._transport import open_client

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or "/usr/bin/chromium"
DRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"


def _need_browser() -> None:
    missing = [p for p in (CHROMIUM, DRIVER) if not os.access(p, os.X_OK)]
    if not missing:
        return
    why = (f"no headless browser: {', '.join(missing)} missing (as root: apt-get install -y chromium "
           "chromium-driver)")
    if os.environ.get("CI"):
        pytest.fail(f"{why}; CI must run the browser tests (.ci/run installs them)")
    pytest.skip(why)


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    _need_browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1560,560",
                 f"--user-data-dir={tmp_path / 'chromium-profile'}"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    driver.set_page_load_timeout(30)
    driver.implicitly_wait(0)
    try:
        yield driver
    finally:
        driver.quit()


class Dashboard:
    """``trio-redis-finalize dashboard`` in a child process."""

    def __init__(self, url: str, backend: str, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trio_redis_finalize", "dashboard", "--url", url, "--port", "0",
             "--backend", backend, "--refresh", "1", *args],
            stderr=subprocess.PIPE, text=True)
        assert self.proc.stderr is not None
        line = self.proc.stderr.readline()
        m = re.search(r"http://127\.0\.0\.1:(\d+)/", line)
        assert m, f"the dashboard did not start: {line!r}"
        self.base = f"http://127.0.0.1:{m.group(1)}"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    where = Path(os.environ.get("TRF_SCREENSHOTS") or tmp_path / "screenshots")
    where.mkdir(parents=True, exist_ok=True)
    return where


def wait_for(driver: Any, css: str, timeout: float = 15.0) -> Any:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout).until(ec.presence_of_element_located((By.CSS_SELECTOR, css)))


def setup_queues(url: str) -> None:
    async def main() -> None:
        async with open_client(url) as client:
            await make_healthy(url, client)
            await make_trouble(url, client)

    anyio.run(main)


async def _redis(url: str, *cmd: Any) -> Any:
    async with open_client(url) as client:
        return await client.execute(*cmd)


def redis(url: str, *cmd: Any) -> Any:
    return anyio.run(_redis, url, *cmd)


def settled(check: Any, browser: Any) -> None:
    """``check(browser)``, again if the page's refresh replaced what it looked at meanwhile."""
    from selenium.common.exceptions import StaleElementReferenceException

    for attempt in range(5):
        try:
            check(browser)
            return
        except StaleElementReferenceException:
            if attempt == 4:
                raise


def check_overview(browser: Any) -> None:
    from selenium.webdriver.common.by import By

    row = browser.find_element(By.CSS_SELECTOR, "tr[data-sub='orders / billing']")
    # problems first: the troubled group on top, red
    first = browser.find_element(By.CSS_SELECTOR, "table.overview tbody tr")
    assert first.get_attribute("data-sub") == "orders / billing"
    assert "bad" in (row.get_attribute("class") or "")
    lag = row.find_element(By.CSS_SELECTOR, "td.lag").text
    assert lag in ("150", "100+"), lag  # Redis 6.2 counts the lag up to 100
    stranded = row.find_element(By.CSS_SELECTOR, ".stranded").text
    assert "stranded 3" in stranded and "worker-dead" in stranded
    assert "1 lapsed" in row.text and "overdue" in row.text and "lag" in row.text
    assert row.find_elements(By.CSS_SELECTOR, "svg.chart rect[fill='#c62828']")  # the last hour, drawn
    healthy = browser.find_element(By.CSS_SELECTOR, "tr[data-sub='payments / ledger']")
    assert "ok" in (healthy.get_attribute("class") or "")


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_overview_and_requeue_in_a_browser(redis_url: str, backend: str, browser: Any, shots: Path) -> None:
    from selenium.webdriver.common.by import By

    setup_queues(redis_url)
    dash = Dashboard(redis_url, backend, "--token", "s3cret")
    try:
        # log in with the token
        browser.get(dash.base + "/")
        wait_for(browser, "#token").send_keys("s3cret")
        browser.find_element(By.ID, "login").click()
        wait_for(browser, "tr[data-sub='orders / billing']")
        settled(check_overview, browser)
        # the page's own script refreshes it in place (and what it shows stays)
        wait_for(browser, "main[data-updated]", 10)
        settled(check_overview, browser)
        browser.save_screenshot(str(shots / f"overview-{backend}.png"))
        if os.environ.get("TRF_UPDATE_DOCS_SCREENSHOT") and backend == "trio":
            browser.save_screenshot(str(ROOT / "docs" / "_static" / "dashboard-overview.png"))

        # the subscription's page
        browser.get(dash.base + "/sub/orders?group=billing")
        table = wait_for(browser, "table.consumers")
        assert "worker-dead" in table.text and "lapsed" in table.text
        assert len(browser.find_elements(By.CSS_SELECTOR, "table.pending tbody tr")) == 3
        browser.save_screenshot(str(shots / f"subscription-{backend}.png"))

        # the dead letters: requeue the first, with confirmation
        browser.get(dash.base + "/")
        wait_for(browser, "tr[data-sub='orders / billing'] td a[href*='dead']").click()
        wait_for(browser, "svg.hist")
        rows = browser.find_elements(By.CSS_SELECTOR, "table.dead tbody tr")
        assert len(rows) == BAD
        entry = rows[0].get_attribute("data-id")
        browser.save_screenshot(str(shots / f"dead-letters-{backend}.png"))
        rows[0].find_element(By.CSS_SELECTOR, "button.requeue").click()
        plan = wait_for(browser, "#plan").text
        assert plan == f"This will requeue 1 message from {DEAD} (1 to {STREAM}).", plan
        assert redis(redis_url, "XLEN", DEAD) == BAD  # asked first: nothing moved yet
        browser.save_screenshot(str(shots / f"confirm-{backend}.png"))
        browser.find_element(By.ID, "confirm").click()
        note = wait_for(browser, "#note").text
        assert note == "requeued 1 message"
        ids = [r.get_attribute("data-id")
               for r in browser.find_elements(By.CSS_SELECTOR, "table.dead tbody tr")]
        assert entry not in ids and len(ids) == BAD - 1
        assert [e[0].decode() for e in redis(redis_url, "XRANGE", DEAD, "-", "+")] == ids
        _, flat = redis(redis_url, "XREVRANGE", STREAM, "+", "-", "COUNT", 1)[0]
        assert flat[flat.index(b"bad") + 1] == b"yes"  # back in the stream, as it was
        browser.save_screenshot(str(shots / f"requeued-{backend}.png"))
    finally:
        dash.stop()


def test_a_read_only_dashboard_refuses_in_a_browser(redis_url: str, browser: Any, shots: Path) -> None:
    from selenium.webdriver.common.by import By

    setup_queues(redis_url)
    dash = Dashboard(redis_url, "trio")  # no credentials: read-only
    try:
        browser.get(dash.base + "/dead/" + DEAD.replace("{", "%7B").replace("}", "%7D"))
        wait_for(browser, "table.dead")
        assert browser.find_element(By.ID, "mode").text == "read-only"
        button = browser.find_element(By.CSS_SELECTOR, "table.dead tbody tr button.requeue")
        assert not button.is_enabled()
        browser.save_screenshot(str(shots / "read-only.png"))
        # forced through anyway (the button enabled by hand): the server refuses
        browser.execute_script("arguments[0].disabled = false; arguments[0].click();", button)
        message = wait_for(browser, "#message").text
        assert "read-only" in message
        assert "Read-only" in browser.title
        assert redis(redis_url, "XLEN", DEAD) == BAD
        browser.save_screenshot(str(shots / "read-only-refused.png"))
    finally:
        dash.stop()
