"""The file watch of `reload_on_change` (process/watch.py), one look at a time: what counts
as a change (content or link target, not a rewrite of the same bytes), that a change waits
one look to settle, and the Kubernetes ConfigMap swap of the `..data` link."""

from __future__ import annotations

import os
from pathlib import Path

from _config_helpers import load_ok

from gateway.process.watch import Watcher, changed, stamp, watched


class Probe:
    """A watcher over `paths` that counts its calls to on_change."""

    def __init__(self, paths: list[str], enabled: bool = True) -> None:
        self.calls = 0
        self.on = enabled
        self.watcher = Watcher(lambda: paths, self._changed, lambda: self.on)

    def _changed(self) -> None:
        self.calls += 1

    def looks(self, n: int) -> list[bool]:
        return [self.watcher.poll() for _ in range(n)]


def configmap(folder: Path, version: str, text: str) -> Path:
    """A ConfigMap volume as the kubelet writes it: `config.toml -> ..data/config.toml`,
    `..data -> ..<version>`; a second call swaps `..data` atomically to a new version."""
    (folder / f"..{version}").mkdir()
    (folder / f"..{version}" / "config.toml").write_text(text)
    link = folder / "..data_tmp"
    link.symlink_to(f"..{version}")
    os.replace(link, folder / "..data")  # rename(2): the swap the kubelet makes
    if not (folder / "config.toml").is_symlink():
        (folder / "config.toml").symlink_to("..data/config.toml")
    return folder / "config.toml"


def test_an_edit_is_acted_on_once_it_has_settled(tmp_path: Path) -> None:
    """The first look takes the files as they are; an edit is seen, acted on at the next
    look that finds it unchanged, and only once."""
    path = tmp_path / "config.toml"
    path.write_text("a = 1\n")
    probe = Probe([str(path)])
    assert probe.looks(2) == [False, False]
    path.write_text("a = 2\n")
    assert probe.looks(3) == [False, True, False]
    assert probe.calls == 1


def test_a_file_still_being_written_waits(tmp_path: Path) -> None:
    """A file that differs at each look is not acted on until two looks agree."""
    path = tmp_path / "settings.json"
    path.write_text("{}")
    probe = Probe([str(path)])
    probe.looks(1)
    for part in ('{"vllm"', '{"vllm": {}', '{"vllm": {}}'):
        path.write_text(part)
        assert probe.looks(1) == [False]
    assert probe.looks(1) == [True]


def test_the_same_bytes_written_again_are_no_change(tmp_path: Path) -> None:
    """Content, not mtime: rewriting a file unchanged (a resync) reloads nothing."""
    path = tmp_path / "config.toml"
    path.write_text("a = 1\n")
    probe = Probe([str(path)])
    probe.looks(1)
    os.utime(path, ns=(1, 1))
    path.write_text("a = 1\n")
    assert probe.looks(3) == [False, False, False]


def test_a_configmap_swap_of_the_data_link_is_seen(tmp_path: Path) -> None:
    """Swapping `..data` to a new folder changes what `config.toml` reads, through links,
    although `config.toml` itself (the link) never changes."""
    path = configmap(tmp_path, "2026_01", "a = 1\n")
    probe = Probe([str(path)])
    probe.looks(1)
    configmap(tmp_path, "2026_02", "a = 2\n")
    assert path.read_text() == "a = 2\n"
    assert probe.looks(2) == [False, True]
    assert stamp([str(path)])[str(path)][0].endswith("..2026_02/config.toml")


def test_a_deleted_file_is_a_change(tmp_path: Path) -> None:
    """A file that vanished is a change (the reload then refuses it and keeps what runs)."""
    path = tmp_path / "config.toml"
    path.write_text("a = 1\n")
    before = stamp([str(path)])
    path.unlink()
    assert changed(before, stamp([str(path)])) == [str(path)]


def test_a_path_new_to_the_watch_is_not_a_change(tmp_path: Path) -> None:
    """A key file that a reload added is watched from then on, not reloaded for."""
    old, new = tmp_path / "a", tmp_path / "b"
    old.write_text("1")
    new.write_text("2")
    assert changed(stamp([str(old)]), stamp([str(old), str(new)])) == []


def test_off_reads_nothing_and_on_takes_the_files_as_they_are(tmp_path: Path) -> None:
    """While disabled no change is acted on; enabled again, the files then are the base."""
    path = tmp_path / "config.toml"
    path.write_text("a = 1\n")
    probe = Probe([str(path)], enabled=False)
    path.write_text("a = 2\n")
    assert probe.looks(3) == [False, False, False]
    assert repr(probe.watcher) == "<Watcher off files=0>"
    probe.on = True
    assert probe.looks(3) == [False, False, False]
    assert repr(probe.watcher) == "<Watcher watching files=1>"
    assert probe.calls == 0


def test_the_watched_files_are_those_a_reload_reads(tmp_path: Path) -> None:
    """config.toml, settings.json and each named key's key_file (beside settings.json)."""
    (tmp_path / "team.key").write_text("sk-team-0123456789abcdef\n")
    settings = {
        "channel": {"keys": [{"name": "team", "key_file": "team.key"}]},
        "vllm": {"instances": ["http://127.0.0.1:8000"]},
    }
    config = load_ok(tmp_path, "", settings)
    assert watched(config) == [
        str(tmp_path / "config.toml"),
        str(tmp_path / "settings.json"),
        str(tmp_path / "team.key"),
    ]
