"""Debian's chromium driven headless by selenium, for the tests that look at pages in a real browser
(the live sessions page, the documentation site)."""
from __future__ import annotations

import os
import shutil

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
AVAILABLE = os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)
MISSING = "needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)"
# Flags that let chromium run headless in a container and keep it off the network.
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run", "--disable-quic", "--disable-sync",
         "--disable-dev-shm-usage")


def start_browser(profile_dir, window=(1280, 900)):
    """A headless chromium with its own profile folder; the caller quits it."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in (*FLAGS, f"--user-data-dir={profile_dir}", f"--window-size={window[0]},{window[1]}"):
        opts.add_argument(flag)
    return webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=opts)
