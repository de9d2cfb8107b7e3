"""The published openpi client in its own virtual environment, for tests that drive our endpoints.

openpi-client pins numpy<2 (this project uses numpy 2), so it gets its own virtual environment,
built once from the package registry and cached in `.venv-openpi/` at the repository root
(override with OW_OPENPI_VENV); the registry is reached only to build it.
"""

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
OPENPI_CLIENT = "openpi-client==0.1.2"
# openpi-client 0.1.2 imports typing_extensions without declaring it as a dependency.
UNDECLARED = ["typing_extensions"]
NETWORK_ERRORS = (
    "NewConnectionError",
    "Temporary failure in name resolution",
    "Network is unreachable",
    "Could not fetch URL",
    "No matching distribution found",
    "ConnectTimeout",
    "ReadTimeout",
    "Connection refused",
    "ProxyError",
)


def openpi_python() -> Path:
    root = Path(os.environ.get("OW_OPENPI_VENV", REPO / ".venv-openpi"))
    marker = root / f".installed-{OPENPI_CLIENT}"
    py = root / "bin" / "python"
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f"{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder at a time (parallel test workers)
        if marker.exists() and py.exists():
            return py
        shutil.rmtree(root, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(root)], check=True)
        pip = subprocess.run(
            [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", OPENPI_CLIENT, *UNDECLARED],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if pip.returncode != 0:
            shutil.rmtree(root, ignore_errors=True)
            text = pip.stdout + pip.stderr
            if any(e in text for e in NETWORK_ERRORS):
                pytest.skip(f"pip cannot reach the package registry to install {OPENPI_CLIENT}: {text[-300:]}")
            raise AssertionError(f"installing {OPENPI_CLIENT} failed:\n{text}")
        marker.touch()
        return py
