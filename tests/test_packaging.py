"""The wheel: what it ships (gateway only, the simulator under gateway/sim) and that an
installed wheel runs `gateway --simulate` without the checkout's loadtest/ anywhere."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
import venv
import zipfile
from pathlib import Path

import pytest

from loadtest import harness

ROOT = Path(__file__).resolve().parent.parent
KEY = "sk-packaging"
_PIP = (sys.executable, "-m", "pip")
_OFFLINE = ("--quiet", "--no-deps", "--no-index")


def _can_build_wheels() -> bool:
    if importlib.util.find_spec("setuptools") is None:
        return False
    if importlib.util.find_spec("wheel") is not None:
        return True
    import setuptools

    major, minor = (int(part) for part in setuptools.__version__.split(".")[:2])
    return (major, minor) >= (70, 1)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's wheel, built from a copy of the sources (the checkout gets no build/)."""
    if not _can_build_wheels():
        pytest.skip("no wheel-building backend: setuptools>=70.1 (or older with `wheel`)")
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "results")
    # loadtest/ is copied too: the package list must leave it out, not its absence.
    for name in ("gateway", "loadtest"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    out = tmp / "dist"
    subprocess.run(
        [*_PIP, "wheel", *_OFFLINE, "--no-build-isolation", "-w", str(out), str(src)],
        check=True,
        cwd=tmp,
        timeout=120,
    )
    (built,) = out.glob("*.whl")
    return built


def test_wheel_ships_gateway_and_its_simulator_but_no_loadtest(wheel: Path) -> None:
    """The wheel's top-level packages are gateway alone; gateway/sim and its fleet are in it."""
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"gateway"}
    assert not [n for n in names if n.startswith("loadtest/")]
    for module in ("sim_vllm", "sim_engine", "sim_batching", "sim_prefix_cache", "sim_fleet"):
        assert f"gateway/sim/{module}.py" in names


def _fresh_venv(tmp_path: Path, wheel: Path) -> Path:
    """A new venv with the wheel installed by pip; the dependencies come from this venv's
    site-packages through a .pth line (a path added that way is not a site dir, so this
    venv's editable install of the checkout is not seen)."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    Path(site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [*_PIP, "--python", str(python), "install", *_OFFLINE, str(wheel)],
        check=True,
        timeout=120,
    )
    return env_dir


def _post(url: str, body: dict[str, object]) -> dict[str, object]:
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        answer: dict[str, object] = json.load(response)
        return answer


def test_installed_wheel_serves_simulate_without_the_checkout(wheel: Path, tmp_path: Path) -> None:
    """`gateway --simulate` from a fresh venv, cwd outside the checkout: loadtest is not
    importable there, and a chat completion through the simulated fleet answers 200."""
    env_dir = _fresh_venv(tmp_path, wheel)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["GATEWAY_API_KEY"] = KEY
    python = str(env_dir / "bin" / "python")
    probe = subprocess.run(
        [
            python,
            "-c",
            "import gateway, importlib.util as u; import gateway.sim.sim_vllm;"
            " print(gateway.__file__, u.find_spec('loadtest') is None)",
        ],
        check=True,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    ).stdout.split()
    assert probe[0].startswith(str(env_dir)), probe
    assert probe[1] == "True", "loadtest is importable in the fresh venv"

    port = harness.free_port()
    sims = [f"http://127.0.0.1:{harness.free_port()}" for _ in range(2)]
    config, _ = harness.gateway_files(
        tmp_path, port, sims, strategy="least_busy", max_num_seqs=4, gateway={"drain_delay": 0}
    )
    gateway = env_dir / "bin" / "gateway"  # the console script pip wrote
    proc = subprocess.Popen(
        [str(gateway), "--config", str(config), "--simulate", "--log-format", "json"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError):
                pass
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            assert time.monotonic() < deadline, "gateway --simulate never became ready"
            time.sleep(0.2)
        answer = _post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert answer["object"] == "chat.completion"
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
