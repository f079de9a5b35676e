"""The dashboard's login in real headless Chromium (selenium + chromedriver): with
authentication on it asks for a token, keeps it in sessionStorage only, sends it as the
bearer, returns to the login page on a 401 and forgets the token on "Log out"."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from secure_admin_support import SecureAdminStandalone

from pigeon.core.testing.servers import headless_chromium

pytestmark = pytest.mark.integration


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    with headless_chromium(tmp_path / "chromium-profile") as driver:
        yield driver


def test_dashboard_login_token_in_session_storage_and_logout(
    secure_admin: SecureAdminStandalone, browser: Any
) -> None:
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    s, driver = secure_admin, browser
    wait = WebDriverWait(
        driver, 20, poll_frequency=0.2, ignored_exceptions=(StaleElementReferenceException,)
    )

    def shown(element_id: str) -> bool:
        return bool(driver.find_element(By.ID, element_id).is_displayed())

    def log_in(token: str) -> None:
        wait.until(lambda d: shown("login"))
        driver.find_element(By.ID, "token").send_keys(token)
        driver.find_element(By.ID, "login-submit").click()

    driver.get(s.url + "/dashboard?refresh=0.5")
    wait.until(lambda d: shown("login") and not shown("content"))

    # a refused token: back to the login page, told why, and the token is not kept
    bad = s.token("admin", expiry_s=-60)
    log_in(bad)
    wait.until(lambda d: "refused the token" in d.find_element(By.ID, "login-error").text)
    assert bad not in driver.page_source
    assert driver.execute_script("return sessionStorage.length") == 0

    good = s.token("admin")
    log_in(good)
    wait.until(lambda d: d.find_element(By.ID, "status").text in ("ok", "degraded"))
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#bookies tr[data-bookie]"))
    assert shown("logout") and not shown("login")
    assert driver.execute_script("return sessionStorage.getItem('pigeon.admin.token')") == good
    assert driver.execute_script("return localStorage.length") == 0
    assert driver.get_cookies() == []
    assert good not in driver.page_source
    refreshed = int(driver.find_element(By.TAG_NAME, "body").get_attribute("data-refreshed"))
    wait.until(
        lambda d: (
            int(d.find_element(By.TAG_NAME, "body").get_attribute("data-refreshed")) > refreshed
        )
    )

    driver.find_element(By.ID, "logout").click()
    wait.until(lambda d: shown("login") and not shown("content"))
    assert driver.execute_script("return sessionStorage.length") == 0
    driver.refresh()  # nothing remembered: still the login page
    wait.until(lambda d: shown("login"))
