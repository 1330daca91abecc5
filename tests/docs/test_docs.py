"""The documentation site: built strictly (a broken link or reference fails), its quick start and migration
pages executed block by block (so they cannot drift from the API), and the built site rendered in headless
Chromium (Debian's `chromium` and `chromium-driver`), where the search box must find "prepare".
"""

import functools
import http.server
import re
import shutil
import sys
import threading
from pathlib import Path

import pytest

from conftest import ROOT, run_command

DOCS = ROOT / "docs"
EXECUTED_PAGES = ["quickstart.md", "migration/raw-pytorch.md", "migration/accelerate.md", "migration/lightning.md",
                  "guides/accelerate-features.md"]
PYTHON_BLOCK = re.compile(r"^(?P<indent>[ \t]*)```python[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)


def python_blocks(page: Path) -> list:
    """The ```python blocks of a Markdown page, in order, dedented (a block inside an admonition is indented)."""
    blocks = []
    for match in PYTHON_BLOCK.finditer(page.read_text(encoding="utf-8")):
        indent = len(match.group("indent"))
        blocks.append("\n".join(line[indent:] for line in match.group("body").splitlines()))
    return blocks


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    pytest.importorskip("mkdocstrings")
    out = tmp_path_factory.mktemp("site")
    proc = run_command([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], timeout=300,
                       cwd=ROOT)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return out


@pytest.mark.slow
def test_site_builds_strictly_with_every_page(site):
    nav_pages = re.findall(r"^\s*-\s*(?:[^:\n]+:\s*)?([\w/.-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)
    assert nav_pages, "mkdocs.yml has no nav"
    for page in nav_pages:
        assert (DOCS / page).is_file(), f"mkdocs.yml names {page}, which docs/ lacks"
        built = site / (page[:-3] + "/index.html" if not page.endswith("index.md") else page[:-3] + ".html")
        assert built.is_file(), f"{page} was not built ({built})"
    in_nav = set(nav_pages)
    strays = [str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md") if str(p.relative_to(DOCS)) not in in_nav]
    assert not strays, f"pages that no navigation reaches: {strays}"


@pytest.mark.parametrize("page", EXECUTED_PAGES)
def test_page_code_runs(page, tmp_path):
    """Every ```python block of the page, in order, as one program: a fresh process, a fresh directory, CPU."""
    blocks = python_blocks(DOCS / page)
    assert blocks, f"{page} has no python block"
    script = tmp_path / "page.py"
    script.write_text("\n\n".join(f"# --- block {i + 1} of {page}\n{block}" for i, block in enumerate(blocks)))
    proc = run_command([sys.executable, str(script)], timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, (f"the code of docs/{page} failed ({len(blocks)} blocks run as one program):\n"
                                  f"STDOUT:\n{proc.stdout[-3000:]}\nSTDERR:\n{proc.stderr[-5000:]}")


def test_block_extraction_keeps_order_and_indentation(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("text\n```python\nx = 1\n```\n\n```bash\nls\n```\n!!! note\n    ```python\n    y = x + 1\n"
                    "    ```\n")
    assert python_blocks(page) == ["x = 1", "y = x + 1"]


@pytest.fixture(scope="module")
def served_site(site):
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):  # one line per request: noise in a failure report
            pass

    handler = functools.partial(Quiet, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def browser():
    webdriver = pytest.importorskip("selenium.webdriver")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if chromium is None or driver_path is None:
        pytest.skip("headless Chromium not installed (apt-get install chromium chromium-driver; make system-tools)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,900"):
        options.add_argument(arg)
    from selenium.webdriver.chrome.service import Service

    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.mark.slow
def test_quick_start_renders_and_search_finds_prepare(served_site, browser):
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(f"{served_site}/quickstart/")
    wait = WebDriverWait(browser, 30)
    wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, "article h1")))
    assert "Quick start" in browser.title, browser.title
    nav_links = browser.find_elements(By.CSS_SELECTOR, "nav.md-nav a.md-nav__link")
    assert len(nav_links) >= 5, "the navigation did not render"
    code = browser.find_elements(By.CSS_SELECTOR, "article .highlight pre code")
    assert code and any("Accelerator" in c.text or "Trainer" in c.text for c in code), "no code block rendered"

    # the search box: open it, type, and wait for the results the search worker finds in the built index
    box = wait.until(ec.element_to_be_clickable((By.CSS_SELECTOR, "input.md-search__input")))
    box.click()
    box.send_keys("prepare")
    box.send_keys(Keys.SPACE, Keys.BACKSPACE)  # a key event after the index loaded, as a user's typing gives
    # the results list is re-rendered as the worker answers each keystroke, so an element found one moment can be
    # gone the next: read the texts in one script call inside the page, and wait until one of them names prepare
    read_results = "return Array.from(document.querySelectorAll('.md-search-result__item')).map(e => e.textContent)"

    def prepare_found(driver):
        texts = driver.execute_script(read_results) or []
        return [t for t in texts if "prepare" in t.lower()] or None

    try:
        found = wait.until(prepare_found)
    except TimeoutException as error:
        raise AssertionError(f"the search found nothing naming 'prepare': {browser.execute_script(read_results)!r}") from error
    assert found
