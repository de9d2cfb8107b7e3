"""Headless Chromium for the console's browser tests: Debian's `chromium` and `chromium-driver`,
installed on demand (root and apt-get only) as tests/bus/sshd_testkit.py installs sshd, and driven
by selenium through /usr/bin/chromedriver (the packaged driver: nothing is downloaded).

`python tests/ground/chromium_testkit.py --install` installs them (as `make test` does before the
suite); it always exits 0 and says what happened, and the browser tests skip with that reason
when Chromium is still missing."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PACKAGES = ("chromium", "chromium-driver")
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
INSTALL_LOCK = Path(tempfile.gettempdir()) / "orbitweaver-chromium-install.lock"


def present() -> bool:
    return all(os.access(p, os.X_OK) for p in (CHROMIUM, CHROMEDRIVER))


def _apt_get(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["apt-get", "-q", "-y", "-o", "DPkg::Lock::Timeout=300", *args],
        env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=900,
    )


def install_chromium() -> str | None:
    """None when Chromium and its driver are there (installed now if need be), else why not."""
    if present():
        return None
    wanted = " ".join(PACKAGES)
    if os.geteuid() != 0:
        return f"{wanted} not installed and installing needs root (apt-get install {wanted})"
    if not shutil.which("apt-get"):
        return f"{wanted} not installed and this system has no apt-get"
    INSTALL_LOCK.touch(exist_ok=True)
    with open(INSTALL_LOCK) as lock:  # concurrent test workers install once
        fcntl.flock(lock, fcntl.LOCK_EX)
        if present():
            return None
        try:
            result = _apt_get(["install", "--no-install-recommends", *PACKAGES])
            if result.returncode != 0:  # package lists missing or stale on a fresh machine
                update = _apt_get(["update"])
                result = (
                    _apt_get(["install", "--no-install-recommends", *PACKAGES]) if update.returncode == 0 else update
                )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"apt-get install {wanted} failed: {exc}"
        if result.returncode != 0 or not present():
            tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
            return f"apt-get install {wanted} failed (exit {result.returncode}): {' | '.join(tail)}"
    return None


def driver(width: int = 1280, height: int = 900):
    """A headless Chromium under selenium; the caller quits it."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run"):
        options.add_argument(arg)
    options.add_argument(f"--window-size={width},{height}")
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


if __name__ == "__main__":
    if "--install" not in sys.argv[1:]:
        print(__doc__)
        sys.exit(2)
    reason = install_chromium()
    print(f"Chromium for the console's browser tests: {CHROMIUM if reason is None else 'not available: ' + reason}")
    sys.exit(0)
