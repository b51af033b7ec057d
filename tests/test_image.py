"""The image's inputs: requirements.lock against pyproject.toml, and deploy/Dockerfile's layers.

Fast and offline: no registry is asked, no image built. The lock covers every runtime
dependency of [project] with a version its specifier allows, on the image's platform; it
pins every package with hashes and names no machine-local index. The Dockerfile starts
from an exact Python release that pyproject's requires-python allows, and installs the
lock in a layer of its own before any code is copied.
"""

from __future__ import annotations

import re
import tomllib
from typing import Any

from deploykit import ROOT, deployment_guide, dockerfile_instructions
from packaging.markers import Marker, default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

LOCK = ROOT / "requirements.lock"
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)\s*(?:;\s*([^\\]+?))?\s*\\?$")
_BASE = re.compile(r"^python:(3\.\d+\.\d+)-slim(?:-[a-z]+)?$")


def _project() -> dict[str, Any]:
    project: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project


def _lock() -> dict[str, tuple[Version, str | None, list[str]]]:
    """name -> (version, marker, hashes) of each pin in requirements.lock."""
    pins: dict[str, tuple[Version, str | None, list[str]]] = {}
    current = None
    for line in LOCK.read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.startswith("--hash="):
            assert current is not None, line
            pins[current][2].append(stripped.removeprefix("--hash=").rstrip(" \\"))
            continue
        match = _PIN.match(stripped)
        assert match, f"requirements.lock: not an exact pin: {line!r}"
        name, version, marker = match.groups()
        current = canonicalize_name(name)
        assert current not in pins, f"{name} pinned twice"
        pins[current] = (Version(version), marker, [])
    return pins


def _base_python() -> str:
    """The Python release of the Dockerfile's FROM (`python:3.11.14-slim-bookworm`)."""
    (base,) = [rest for word, rest in dockerfile_instructions() if word == "FROM"]
    match = _BASE.match(base)
    assert match, f"FROM {base}: an exact python:X.Y.Z-slim tag (a release, not 3.11-slim)"
    return match.group(1)


def _image_environment() -> dict[str, str]:
    """Marker values of the image: Linux, x86-64 or not alike, its Python release."""
    release = _base_python()
    env = default_environment()
    env.update(
        python_version=release.rsplit(".", 1)[0],
        python_full_version=release,
        implementation_name="cpython",
        platform_python_implementation="CPython",
        sys_platform="linux",
        platform_system="Linux",
        os_name="posix",
    )
    return env


def test_the_lock_covers_every_runtime_dependency_with_an_allowed_version() -> None:
    """Each [project] dependency that applies in the image is pinned in requirements.lock,
    at a version its specifier allows."""
    pins = _lock()
    env = _image_environment()
    dependencies = [Requirement(d) for d in _project()["dependencies"]]
    assert dependencies
    for requirement in dependencies:
        if requirement.marker is not None and not requirement.marker.evaluate(env):
            continue
        name = canonicalize_name(requirement.name)
        assert name in pins, f"requirements.lock lacks {requirement}: run the pip-compile line"
        version = pins[name][0]
        assert requirement.specifier.contains(version, prereleases=True), (
            f"requirements.lock pins {name}=={version}, outside {requirement}: regenerate it"
        )


def test_the_lock_pins_every_package_with_hashes_and_no_local_index() -> None:
    """pip --require-hashes can install it anywhere: each pin exact and hashed, every pin
    applying in the image, no --index-url, --find-links or file path of the machine that
    generated it, and not the project itself (installed from the code, --no-deps)."""
    env = _image_environment()
    text = LOCK.read_text()
    for word in ("--index-url", "--extra-index-url", "--find-links", "file:", "-e "):
        assert word not in text, f"requirements.lock has {word!r}: see the pip-compile line"
    pins = _lock()
    assert canonicalize_name(_project()["name"]) not in pins
    for name, (_, marker, hashes) in pins.items():
        assert hashes, f"{name} has no --hash"
        assert all(h.startswith("sha256:") for h in hashes), name
        if marker:
            assert Marker(marker).evaluate(env), (name, marker)


def test_the_lock_says_the_command_the_docs_give() -> None:
    """requirements.lock's header names the pip-compile line of docs/deployment.md, with the
    Python minor release of the image."""
    lines = LOCK.read_text().splitlines()
    header = "\n".join(lines[: next(i for i, x in enumerate(lines) if not x.startswith("#"))])
    (command,) = re.findall(r"^#\s+(pip-compile .+)$", header, re.MULTILINE)
    assert command in deployment_guide()
    assert f"with Python {_base_python().rsplit('.', 1)[0]}" in header


def test_the_base_image_is_an_exact_python_release_that_pyproject_allows() -> None:
    """FROM names a Python release (not a moving 3.11-slim) within requires-python."""
    assert Version(_base_python()) in SpecifierSet(_project()["requires-python"])


def test_the_dependencies_are_installed_from_the_lock_before_the_code_is_copied() -> None:
    """The layer that installs the dependencies has only requirements.lock copied before it
    (a code change does not rebuild it); it installs the lock alone, hashes required; the
    project then installs with --no-deps."""
    steps = [(w, r) for w, r in dockerfile_instructions() if w in {"COPY", "ADD", "RUN", "FROM"}]
    copies = [(i, r.split()) for i, (w, r) in enumerate(steps) if w in {"COPY", "ADD"}]
    runs = [(i, r) for i, (w, r) in enumerate(steps) if w == "RUN"]
    (deps,) = [(i, r) for i, r in runs if "-r requirements.lock" in r]
    assert "--require-hashes" in deps[1]
    assert "--no-deps" in deps[1]
    before = [args for i, args in copies if i < deps[0]]
    assert before == [["requirements.lock", "./"]]
    (code,) = [(i, r) for i, r in runs if re.search(r"pip install (--no-deps )?\.", r)]
    assert "--no-deps" in code[1]
    assert code[0] > deps[0]
    assert any(args[0] == "gateway" for i, args in copies if deps[0] < i < code[0])
