"""The live sessions page in a real headless Chromium (Debian chromium + chromium-driver) via selenium."""
import pytest

import browserproc
from envserve.client import EnvClient, check
from serverproc import ServerProcess
from webproc import WebProcess

pytestmark = pytest.mark.skipif(not browserproc.AVAILABLE, reason=browserproc.MISSING)
MOVE = "<think>look</think><answer>{}</answer>"
WAIT = 60  # seconds a page condition may take on a loaded machine; not what is tested


@pytest.fixture(scope="module")
def replica():
    with ServerProcess(["sokoban"], workers=1, metrics=False) as s:
        yield s


@pytest.fixture(scope="module")
def web(replica):
    with WebProcess.facade([replica.address]) as w:
        yield w


def card_field(browser, sid, cls):
    """Text of one field of a session's card, or None while the card is not on the page."""
    return browser.execute_script(
        "const c = [...document.querySelectorAll('article.session')]"
        "  .find(e => e.getAttribute('data-session-id') === arguments[0]);"
        "if (!c) return null; const f = c.querySelector('.' + arguments[1]); return f ? f.textContent : null;",
        sid, cls)


def image_width(browser, sid):
    return browser.execute_script(
        "const c = [...document.querySelectorAll('article.session')]"
        "  .find(e => e.getAttribute('data-session-id') === arguments[0]);"
        "const img = c && c.querySelector('img.obs');"
        "return img && !img.hidden && img.complete ? img.naturalWidth : 0;", sid)


def wait_for(browser, condition):
    from selenium.webdriver.support.ui import WebDriverWait
    return WebDriverWait(browser, WAIT, poll_frequency=0.1).until(lambda _: condition())


def test_page_shows_sessions_as_they_step(browser, web, replica):
    with EnvClient(replica.address) as env:
        sid = env.open("sokoban", 1, {"render_image": True, "image_size": 96})[0]
        env.reset([sid], seeds=[21])
        r1 = check(env.step([(sid, MOVE.format("Left"))])[0])
        browser.get(web.url + "/")
        wait_for(browser, lambda: card_field(browser, sid, "turn") == "1")
        assert wait_for(browser, lambda: image_width(browser, sid)) == 96
        assert float(card_field(browser, sid, "reward")) == pytest.approx(r1.reward, abs=1e-3)
        assert card_field(browser, sid, "obs-text") == r1.observation.text

        r2 = check(env.step([(sid, MOVE.format("Up, Right"))])[0])
        wait_for(browser, lambda: card_field(browser, sid, "turn") == "2")
        assert float(card_field(browser, sid, "reward")) == pytest.approx(r2.reward, abs=1e-3)
        assert float(card_field(browser, sid, "ret")) == pytest.approx(r1.reward + r2.reward, abs=1e-3)
        assert MOVE.format("Up, Right") in card_field(browser, sid, "last-action")

        env.close_sessions([sid])
        wait_for(browser, lambda: card_field(browser, sid, "turn") is None)


def test_untrusted_text_stays_text(browser, web, replica):
    # The agent's text (and any observation) is shown verbatim, never parsed as HTML.
    attack = ('<img src=x onerror="document.title=\'owned\'"><b id="injected">bold</b>'
              '<script>document.title="owned"</script>')
    with EnvClient(replica.address) as env:
        sid = env.open("sokoban", 1)[0]
        env.reset([sid], seeds=[4])
        env.step([(sid, attack)])  # an invalid format: still a turn, with the text as its action
        browser.get(web.url + "/")
        wait_for(browser, lambda: card_field(browser, sid, "turn") == "1")
        assert attack in card_field(browser, sid, "last-action")
        assert browser.execute_script("return document.getElementById('injected')") is None
        assert "owned" not in browser.title
        env.close_sessions([sid])


ALICE, MONITOR = "alice-token-1", "monitor-token-2"


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    """A replica with session tokens and a state token that reads every session, and a facade
    whose monitor token is that state token: the page then needs it."""
    d = tmp_path_factory.mktemp("live-tokens")
    (d / "tokens").write_text(f"{ALICE}\n")
    (d / "state").write_text(f"{MONITOR} name=monitor reads=*\n")
    (d / "monitor").write_text(f"{MONITOR}\n")
    with ServerProcess(["sokoban"], workers=1, metrics=False,
                       extra=["--token-file", str(d / "tokens"), "--state-token-file", str(d / "state")]) as s, \
            WebProcess.facade([s.address], extra=["--monitor-token-file", str(d / "monitor")]) as w:
        yield s, w


def login_shown(browser):
    return browser.execute_script("return !document.getElementById('login').hidden")


def give_token(browser, token):
    from selenium.webdriver.common.by import By
    browser.find_element(By.ID, "token").send_keys(token)
    browser.find_element(By.ID, "login-go").click()


def test_page_asks_for_the_monitor_token_and_keeps_it_for_the_tab(browser, secured):
    replica, web = secured
    with EnvClient(replica.address, token=ALICE) as env:
        sid = env.open("sokoban", 1)[0]
        env.reset([sid], seeds=[5])
        check(env.step([(sid, MOVE.format("Left"))])[0])
        browser.get(web.url + "/")
        wait_for(browser, lambda: login_shown(browser))
        assert card_field(browser, sid, "turn") is None  # nothing shown without a token
        give_token(browser, "not-the-token")
        wait_for(browser, lambda: login_shown(browser) and "refused" in browser.execute_script(
            "return document.getElementById('login-why').textContent"))
        give_token(browser, MONITOR)
        wait_for(browser, lambda: card_field(browser, sid, "turn") == "1")
        assert not login_shown(browser)
        # Kept in sessionStorage, sent as a bearer header: a reload asks nothing.
        assert browser.execute_script("return sessionStorage.getItem('envserve-live-token')") == MONITOR
        browser.refresh()
        wait_for(browser, lambda: card_field(browser, sid, "turn") == "1")
        assert not login_shown(browser)
        # Forgotten: asked again, and the sessions leave the page.
        browser.execute_script("document.getElementById('forget').click()")
        wait_for(browser, lambda: login_shown(browser) and card_field(browser, sid, "turn") is None)
        assert browser.execute_script("return sessionStorage.getItem('envserve-live-token')") is None
        env.close_sessions([sid])
