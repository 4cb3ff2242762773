"""The docs site builds (strict) and works in a browser: the home page and a guide render, and the search finds a
config key on the config reference.

Headless Chromium (Debian's `chromium` and `chromium-driver`) through selenium (the `docs` extra). Without them
the test skips with the reason, unless SHARDWISE_REQUIRE_BROWSER=1 (as .ci/run sets): then it fails.
"""

from __future__ import annotations

import functools
import http.server
import importlib.util
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser"))), None)
CHROMEDRIVER = shutil.which("chromedriver")


def _missing() -> str | None:
    needs = {"chromium": CHROMIUM, "chromedriver (chromium-driver)": CHROMEDRIVER,
             "mkdocs (pip install -e '.[docs]')": importlib.util.find_spec("mkdocs"),
             "selenium (pip install -e '.[docs]')": importlib.util.find_spec("selenium")}
    missing = [name for name, found in needs.items() if not found]
    return f"needs {', '.join(missing)}" if missing else None


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    reason = _missing()
    if reason:
        if os.environ.get("SHARDWISE_REQUIRE_BROWSER") == "1":
            pytest.fail(f"SHARDWISE_REQUIRE_BROWSER=1 but the docs browser test {reason}")
        pytest.skip(reason)
    out = tmp_path_factory.mktemp("site")
    build = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(out)], cwd=ROOT,
                           env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, capture_output=True, text=True, timeout=120)
    assert build.returncode == 0, f"mkdocs build --strict failed:\n{build.stdout}{build.stderr}"
    handler = functools.partial(Quiet, directory=str(out))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


class Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def browser(site: str) -> Iterator[object]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    # Root in a container: Chromium's sandbox needs user namespaces it may not have, and /dev/shm may be small.
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,900"):
        options.add_argument(flag)
    # The Debian driver, named explicitly: selenium would otherwise try to download one.
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


def _heading(browser, site: str, path: str) -> str:
    from selenium.webdriver.common.by import By

    browser.get(f"{site}/{path}")
    assert "shardwise" in browser.title, (path, browser.title)
    return browser.find_element(By.CSS_SELECTOR, "article h1").text


def test_home_and_a_guide_render(browser, site: str) -> None:
    assert _heading(browser, site, "").strip(), "the home page has no h1"
    assert "ZeRO" in _heading(browser, site, "guides/zero/")


# `offload_param` is also a word of the guides; `stage3_prefetch_bucket_size` appears on the reference only inside
# its dotted key (`zero_optimization.stage3_prefetch_bucket_size`), so it is found only if the search splits there.
@pytest.mark.parametrize("key", ["offload_param", "stage3_prefetch_bucket_size"])
def test_search_finds_a_config_key_on_the_config_reference(browser, site: str, key: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    # Material opens its search with the query in ?q= (search runs in a web worker over search_index.json).
    browser.get(f"{site}/?q={key}")
    links = WebDriverWait(browser, 15).until(
        expected_conditions.presence_of_all_elements_located((By.CSS_SELECTOR, ".md-search-result__list a")))
    hrefs = [a.get_attribute("href") for a in links]
    assert any("/reference/config/" in h for h in hrefs), (key, hrefs)
