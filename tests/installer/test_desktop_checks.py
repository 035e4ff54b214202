"""Before Qt starts: the xcb plugin's libraries (canned `ldd` output), the advice the
person gets, and the dialog that carries it (fake zenity / kdialog / notify-send)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.installer.test_bootstrap import B

posix_only = pytest.mark.skipif(os.name != "posix", reason="fake tools are shell scripts")

LDD_MISSING_CURSOR = """\
\tlinux-vdso.so.1 (0x00007ffd)
\tlibQt6XcbQpa.so.6 => /venv/PySide6/Qt/lib/libQt6XcbQpa.so.6 (0x00007f1)
\tlibxcb-cursor.so.0 => not found
\tlibxcb.so.1 => /lib/x86_64-linux-gnu/libxcb.so.1 (0x00007f2)
\tlibxcb-cursor.so.0 => not found
"""
LDD_FINE = "\tlibxcb.so.1 => /lib/x86_64-linux-gnu/libxcb.so.1 (0x00007f2)\n"


def ldd(output):
    def run(cmd, **kw):
        assert cmd[0] == "ldd"
        return subprocess.CompletedProcess(cmd, 0, stdout=output, stderr="")
    return run


@pytest.fixture
def venv_with_plugin(tmp_path):
    plugin = (tmp_path / "venv" / "lib" / "python3.11" / "site-packages" / "PySide6" / "Qt"
              / "plugins" / "platforms" / "libqxcb.so")
    plugin.parent.mkdir(parents=True)
    plugin.write_bytes(b"")
    return tmp_path / "venv"


def test_missing_libraries_parsed_once_each(venv_with_plugin):
    plugin = B.xcb_plugin(venv_with_plugin)
    assert plugin is not None and plugin.name == "libqxcb.so"
    assert B.missing_xcb_libraries(plugin, ldd(LDD_MISSING_CURSOR)) == ["libxcb-cursor.so.0"]
    assert B.missing_xcb_libraries(plugin, ldd(LDD_FINE)) == []


@pytest.mark.parametrize("family, command", [
    ("debian", "sudo apt install libxcb-cursor0"),
    ("fedora", "sudo dnf install xcb-util-cursor"),
    ("arch", "sudo pacman -S xcb-util-cursor"),
])
def test_advice_names_the_package(family, command):
    text = B.xcb_advice(["libxcb-cursor.so.0"], family)
    assert "libxcb-cursor.so.0" in text and command in text


def test_advice_for_unknown_distro_lists_all_and_unknown_libs():
    text = B.xcb_advice(["libxcb-cursor.so.0", "libxkbcommon-x11.so.0"], "")
    assert "libxcb-cursor0 libxkbcommon-x11-0" in text and "dnf" in text and "pacman" in text
    assert "package manager" in B.xcb_advice(["libweird.so.9"], "debian")


def test_distro_family_from_os_release(tmp_path):
    f = tmp_path / "os-release"
    f.write_text('NAME="Ubuntu"\nID=ubuntu\nID_LIKE=debian\n')
    assert B.linux_distro_family(f) == "debian"
    f.write_text('ID="opensuse-tumbleweed"\nID_LIKE="opensuse suse"\n')
    assert B.linux_distro_family(f) == "fedora"  # zypper names match Fedora's here
    f.write_text("ID=arch\n")
    assert B.linux_distro_family(f) == "arch"
    assert B.linux_distro_family(tmp_path / "missing") == ""


@pytest.mark.parametrize("env, expected", [
    ({"DISPLAY": ":0"}, (True, True)),
    ({"DISPLAY": ":0", "WAYLAND_DISPLAY": "wayland-0"}, (True, False)),
    ({"WAYLAND_DISPLAY": "wayland-0"}, (False, False)),
    ({"QT_QPA_PLATFORM": "offscreen", "DISPLAY": ":0"}, (False, False)),
    ({"QT_QPA_PLATFORM": "xcb"}, (True, True)),
    ({}, (False, False)),
])
def test_when_qt_may_use_xcb(env, expected):
    assert B.qt_may_use_xcb(env) == expected


def test_check_desktop(venv_with_plugin, monkeypatch):
    monkeypatch.setattr(B.sys, "platform", "linux")
    x11 = {"DISPLAY": ":0"}
    problem = B.check_desktop(venv_with_plugin, x11, ldd(LDD_MISSING_CURSOR), family="debian")
    assert "sudo apt install libxcb-cursor0" in problem
    assert B.check_desktop(venv_with_plugin, x11, ldd(LDD_FINE), family="debian") is None
    # a Wayland session: Qt takes Wayland, so only a note
    both = {"DISPLAY": ":0", "WAYLAND_DISPLAY": "w"}
    assert B.check_desktop(venv_with_plugin, both, ldd(LDD_MISSING_CURSOR), family="") is None
    offscreen = {"QT_QPA_PLATFORM": "offscreen"}
    assert B.check_desktop(venv_with_plugin, offscreen, ldd(LDD_MISSING_CURSOR)) is None


def fake_tool(folder: Path, name: str) -> Path:
    record = folder / f"{name}.args"
    exe = folder / name
    exe.write_text(f'#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done > "{record}"\n')
    exe.chmod(0o755)
    return record


@posix_only
@pytest.mark.parametrize("tools, used", [
    (["zenity", "kdialog", "notify-send"], "zenity"),
    (["kdialog", "notify-send"], "kdialog"),
    (["notify-send"], "notify-send"),
])
def test_dialog_uses_the_first_tool_present(tmp_path, tools, used):
    records = {t: fake_tool(tmp_path, t) for t in tools}
    env = {"PATH": str(tmp_path), "DISPLAY": ":0"}
    assert B.show_error_dialog("Folio cannot open its window", "install libxcb-cursor0", env) == used
    args = records[used].read_text().splitlines()
    assert "install libxcb-cursor0" in args and "Folio cannot open its window" in args
    assert all(not r.exists() for t, r in records.items() if t != used)


@posix_only
def test_no_dialog_without_display_or_tools(tmp_path):
    fake_tool(tmp_path, "zenity")
    assert B.show_error_dialog("t", "x", {"PATH": str(tmp_path)}) is None
    assert B.show_error_dialog("t", "x", {"PATH": str(tmp_path / "none"), "DISPLAY": ":0"}) is None


def test_main_launch_stops_with_dialog_when_xcb_is_missing(monkeypatch, tmp_path):
    shown = []
    monkeypatch.setattr(B, "ensure_installed", lambda *a, **k: False)
    monkeypatch.setattr(B, "ensure_default_model", lambda *a, **k: False)
    monkeypatch.setattr(B, "check_desktop", lambda venv, env: "sudo apt install libxcb-cursor0")
    monkeypatch.setattr(B, "show_error_dialog", lambda title, text: shown.append(text))
    monkeypatch.setattr(B, "launch_app", lambda *a: pytest.fail("must not start Qt"))
    monkeypatch.setenv("FOLIO_HOME", str(tmp_path))
    assert B.main(["--user", "--launch"]) == 3
    assert shown == ["sudo apt install libxcb-cursor0"]


def test_main_launch_starts_the_app_through_platform_setup(monkeypatch, tmp_path):
    started = []
    monkeypatch.setattr(B, "ensure_installed", lambda *a, **k: False)
    monkeypatch.setattr(B, "ensure_default_model", lambda *a, **k: False)
    monkeypatch.setattr(B, "check_desktop", lambda venv, env: None)
    monkeypatch.setattr(B, "launch_app", lambda layout, args, windowed: started.append(
        (layout.mode, args, B.launch_command(layout.venv, args, windowed))) or 0)
    monkeypatch.setenv("FOLIO_HOME", str(tmp_path))
    assert B.main(["--user", "--launch", "--smoke-test"]) == 0
    mode, args, cmd = started[0]
    assert mode == "user" and args == ["--smoke-test"]
    assert cmd[1:] == ["-m", "folio", "--smoke-test"]
    assert cmd[0] == str(B.venv_python(tmp_path / "venv"))


def test_failed_upgrade_still_launches_the_kept_install(monkeypatch, tmp_path):
    def fail(*a, **k):
        exc = B.InstallError("could not install Folio (pip install -e x)", tmp_path / "log")
        exc.kept_previous = True
        raise exc

    started = []
    monkeypatch.setattr(B, "ensure_installed", fail)
    monkeypatch.setattr(B, "ensure_default_model", lambda *a, **k: pytest.fail("no fetch"))
    monkeypatch.setattr(B, "check_desktop", lambda venv, env: None)
    monkeypatch.setattr(B, "launch_app", lambda *a: started.append(a) or 0)
    monkeypatch.setenv("FOLIO_HOME", str(tmp_path))
    assert B.main(["--user", "--launch"]) == 0 and started
    assert B.main(["--user"]) == 1  # without --launch the failure is the result
