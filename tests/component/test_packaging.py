"""What the two packages promise each other and what they take from upstream, checked on the
files: the daemon and its client released in lockstep, the 0.0.x turbojpeg wheel bounded, and its
bundled libturbojpeg found where prefetchd looks for it (an upstream change of its folder layout
breaks this test, not a user's run)."""

from __future__ import annotations

import importlib.util
import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from prefetchd.workers import tjlib
from tests.conftest import REPO


def _project(path: Path) -> dict:
    return tomllib.loads(path.read_text())["project"]


def _requirement(name: str) -> Requirement:
    found = [Requirement(r) for r in _project(REPO / "pyproject.toml")["dependencies"]]
    (requirement,) = [r for r in found if r.name == name]
    return requirement


def test_the_daemon_requires_exactly_its_own_version_of_the_client():
    """The daemon imports the client's batch format, job-folder layout and folder checks (some of
    them internal): a client of another version may write or read them otherwise."""
    daemon = _project(REPO / "pyproject.toml")["version"]
    client = _project(REPO / "client" / "pyproject.toml")["version"]
    assert daemon == client, f"prefetchd {daemon} and prefetchd-client {client}: release them with one version"
    pin = _requirement("prefetchd-client").specifier
    assert str(pin) == f"=={daemon}", f"prefetchd requires prefetchd-client{pin}; it must be =={daemon}"


def test_turbojpeg_is_bounded_below_its_next_minor():
    """A 0.0.x package may change anything in its next release, the folder of its bundled library
    included; a new minor is taken on purpose, after this file's last test passes with it."""
    specifier = _requirement("turbojpeg").specifier
    upper = [s for s in specifier if s.operator == "<"]
    assert upper and Version(upper[0].version) <= Version("0.1"), f"turbojpeg{specifier} has no bound below 0.1"


@pytest.mark.skipif(importlib.util.find_spec("turbojpeg") is None, reason="the turbojpeg wheel is not installed here")
def test_the_turbojpeg_wheels_bundled_library_is_found_and_is_turbojpeg_3():
    """tjlib globs the folder auditwheel (Linux) or delocate (macOS) puts a wheel's libraries in.
    With the wheel installed, the first candidate must be its bundled library, and it must load
    with the TurboJPEG 3 API; else the decoder "turbojpeg" would quietly fall back to the system's
    (Debian 12's 2.1 has no TurboJPEG 3 API) or be missing."""
    first = tjlib.candidates()[0]
    assert first not in tjlib.SYSTEM_NAMES, (
        "the turbojpeg wheel is installed but tjlib.candidates() found no bundled libturbojpeg in "
        f"{Path(importlib.util.find_spec('turbojpeg').origin).parent}/turbojpeg.libs or .dylibs: the wheel's layout "
        "changed; update tjlib.candidates() and the bound in pyproject.toml"
    )
    assert re.search(r"libturbojpeg[^/]*$", first), first
    tjlib.load()
    assert tjlib.lib is not None and tjlib.lib._name == first, f"loaded {tjlib.lib and tjlib.lib._name}, not {first}"
