"""One page of the built documentation site, opened in a real headless chromium over HTTP."""
import functools
import io
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import pytest

import browserproc

pytestmark = pytest.mark.skipif(not browserproc.AVAILABLE, reason=browserproc.MISSING)
WAIT = 60  # seconds a page may take to render on a loaded machine; not what is tested


@pytest.fixture(scope="module")
def site_url(built_site):
    code, output, site = built_site
    assert code == 0, output

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def visible_text(browser, selector):
    return browser.execute_script(
        "const e = document.querySelector(arguments[0]);"
        "if (!e) return null; const r = e.getBoundingClientRect();"
        "return r.width > 0 && r.height > 0 ? e.textContent.trim() : null;", selector)


def test_environment_page_renders_with_title_nav_and_content(browser, site_url, tmp_path):
    from PIL import Image
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(site_url + "/environments/sokoban/")
    wait = WebDriverWait(browser, WAIT, poll_frequency=0.1)
    wait.until(lambda b: visible_text(b, "article h1"))
    assert browser.title.startswith("sokoban")
    assert visible_text(browser, "article h1").startswith("sokoban")
    assert "envserve" in visible_text(browser, ".md-header__title")
    # the site navigation is drawn, with the environments section and this page in it
    nav = browser.execute_script(
        "return [...document.querySelectorAll('.md-nav__link')]"
        "  .filter(e => e.getBoundingClientRect().width > 0).map(e => e.textContent.trim())")
    assert "Environments" in nav and "sokoban" in nav
    # the first observation, a code block written from a live session, is on screen
    blocks = browser.execute_script("return [...document.querySelectorAll('article pre')].map(e => e.textContent)")
    assert any(b.strip().startswith("######") for b in blocks)

    png = browser.get_screenshot_as_png()
    (tmp_path / "sokoban.png").write_bytes(png)
    image = Image.open(io.BytesIO(png)).convert("L")
    assert image.size[0] >= 800
    lo, hi = image.getextrema()
    assert hi - lo > 100, "the screenshot is blank"
    # text and chrome, not one flat colour: many pixels differ from the most common shade
    histogram = image.histogram()
    assert sum(histogram) - max(histogram) > 0.02 * sum(histogram)
