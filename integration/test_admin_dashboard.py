"""The broker's dashboard in real headless Chromium (selenium + chromedriver).

Needs Debian's ``chromium`` and ``chromium-driver`` packages; skipped without them except
under CI, where their absence is a failure.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from test_admin_standalone import start_with_http

from pigeon.client import Client
from pigeon.core.testing.servers import Standalone, headless_chromium

pytestmark = pytest.mark.integration

TOPIC = "persistent://public/default/dashboard-events"


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[object]:
    with headless_chromium(
        tmp_path / "chromium-profile",
        "--window-size=1280,1000",
        required=True,
        screenshot=tmp_path / "dashboard.png",
    ) as driver:
        yield driver


def _produce_until(url: str, stop: threading.Event) -> None:
    """Keep a trickle of messages flowing (bounded: at most 60 s)."""
    deadline = time.monotonic() + 60
    with Client(url) as client, client.create_producer(TOPIC) as producer:
        while not stop.is_set() and time.monotonic() < deadline:
            for _ in range(10):
                producer.send_async(b"x" * 64)
            producer.flush()
            time.sleep(0.1)


def test_dashboard_shows_health_topics_and_rising_counters(
    standalone_factory: Callable[..., Standalone], browser: object
) -> None:
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver: object = browser
    server, url = start_with_http(standalone_factory)
    driver.get(url + "/dashboard?refresh=0.5")  # type: ignore[attr-defined]
    # The page re-renders its tables on every refresh: an element found a moment ago may
    # be gone, so every read goes through the wait, which retries on stale elements.
    wait = WebDriverWait(  # type: ignore[var-annotated]
        driver,  # type: ignore[arg-type]
        20,
        poll_frequency=0.2,
        ignored_exceptions=(StaleElementReferenceException,),
    )
    wait.until(lambda d: d.find_element(By.ID, "status").text == "ok")
    wait.until(lambda d: "No topic is loaded yet" in d.find_element(By.ID, "no-topics").text)

    stop = threading.Event()
    producer = threading.Thread(target=_produce_until, args=(server.url, stop), daemon=True)
    producer.start()
    try:
        row = f'tr[data-topic="{TOPIC}"]'
        cell = row + ' td[data-field="msgs_in"]'
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, cell))
        first = wait.until(
            lambda d: int(d.find_element(By.CSS_SELECTOR, cell).get_attribute("data-value"))
        )
        wait.until(
            lambda d: int(d.find_element(By.CSS_SELECTOR, cell).get_attribute("data-value")) > first
        )
        # the rate column and the broker-wide "in" card show traffic, the chart has samples
        wait.until(
            lambda d: (
                float(
                    d.find_element(
                        By.CSS_SELECTOR, row + ' td[data-field="msg_rate_in"]'
                    ).text.replace(",", "")
                )
                > 0
            )
        )
        wait.until(lambda d: d.find_element(By.ID, "load-rate-in").text not in ("\u2013", "0"))
        wait.until(
            lambda d: int(d.find_element(By.ID, "chart").get_attribute("data-samples") or 0) > 1
        )
        wait.until(
            lambda d: (
                {
                    c.get_attribute("data-check")
                    for c in d.find_elements(By.CSS_SELECTOR, "#checks tr[data-check]")
                }
                == {"metadata", "bookies", "broker"}
            )
        )
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#bookies tr[data-bookie]"))
        # byte rates read as a person writes them: "16.9 MB/s", not "16,920,763.2"
        wait.until(
            lambda d: (
                re.fullmatch(
                    r"\d+ B/s|\d+\.\d [kMGTP]B/s",
                    d.find_element(
                        By.CSS_SELECTOR, "#bookies td[data-field=write_bytes_per_s]"
                    ).text,
                )
                is not None
            )
        )
        wait.until(lambda d: d.find_element(By.ID, "error").get_attribute("hidden") is not None)
    finally:
        stop.set()
        producer.join(30)
