"""The published openpi client in its own virtual environment, for tests that drive our endpoints.

openpi-client pins numpy<2 (this project uses numpy 2), so it gets its own virtual environment,
built once from the package registry and cached in `.venv-openpi/` at the repository root
(override with OW_OPENPI_VENV); the registry is reached only to build it.
"""

import fcntl
import hashlib
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
# Its whole environment at the versions the suite last passed with (as constraints.txt is for
# .venv): a clean machine must not pick up whatever the registry holds newest that day.
OPENPI_LOCK = [
    "absl-py==2.5.1",
    "attrs==26.1.0",
    "dm-tree==0.1.10",
    "msgpack==1.2.4",
    "numpy==1.26.4",
    "pillow==13.0.0",
    "typing_extensions==4.16.0",
    "websockets==17.4",
    "wrapt==2.5.2",
]
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
    lock_id = hashlib.sha256("\n".join(OPENPI_LOCK).encode()).hexdigest()[:12]
    marker = root / f".installed-{OPENPI_CLIENT}-{lock_id}"  # a changed lock rebuilds the venv
    py = root / "bin" / "python"
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f"{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder at a time (parallel test workers)
        if marker.exists() and py.exists():
            return py
        shutil.rmtree(root, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(root)], check=True)
        constraints = root / "constraints.txt"
        constraints.write_text("\n".join(OPENPI_LOCK) + "\n")
        pip = subprocess.run(
            [
                str(py),
                "-m",
                "pip",
                "install",
                "-q",
                "--disable-pip-version-check",
                "-c",
                str(constraints),
                OPENPI_CLIENT,
                *UNDECLARED,
            ],
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
