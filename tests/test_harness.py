"""The suite's own footing: the environment is the locked one, and xdist keeps a group together.

Module fixtures that hold a real server (sshd, `ow vla serve`) rely on `--dist loadgroup` sending
all tests of an `xdist_group` to one worker; when a pytest release broke that, the tests of one
group ran on two workers, each with its own server, and failed at teardown on a clean machine.
"""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


def _locked() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"constraints.txt pins exact versions only: {line!r}"
            pins[req.name] = spec.version
    return pins


def test_installed_versions_are_the_locked_ones():
    pins = _locked()
    assert {"pytest", "pytest-xdist", "torch", "transformers"} <= set(pins)
    wrong = []
    for name, version in pins.items():
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue  # an optional part's dependency this environment does not need
        if installed.split("+", 1)[0] != version:  # torch's local label (+cpu) names the build
            wrong.append(f"{name} {installed} (locked {version})")
    assert not wrong, "rebuild the environment with `make venv`: " + ", ".join(wrong)


@pytest.mark.xdist_group("harness")
def test_xdist_groups_stay_on_one_worker(request):
    # on a worker, xdist itself reads the "loadgroup" value (its "dist" option says "no" there)
    if not hasattr(request.config, "workerinput") or not request.config.getvalue("loadgroup"):
        pytest.skip("only meaningful under `pytest -n N --dist loadgroup`, as `make test` runs it")
    # xdist sends a group to one worker by the "@group" suffix it adds to the node id
    assert re.search(r"@harness$", request.node.nodeid), request.node.nodeid
