"""Unit tests for installer/bootstrap.py: decisions and parsing, no real installs."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BOOTSTRAP = ROOT / "installer" / "bootstrap.py"


def _load():
    spec = importlib.util.spec_from_file_location("folio_bootstrap_under_test", BOOTSTRAP)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


B = _load()

posix_only = pytest.mark.skipif(os.name != "posix", reason="fake nvidia-smi is a shell script")


# ---------------------------------------------------------------- argument parsing


def test_parse_folio_args():
    o = B.parse_args(["generate", "Write a haiku about memory"])
    assert o.folio_args == ["generate", "Write a haiku about memory"]
    assert o.command is None and o.extras == [] and o.fetch and not o.reinstall


def test_parse_command_after_double_dash():
    o = B.parse_args(["--extras", "test", "--", "python", "-m", "pytest", "-q"])
    assert o.extras == ["test"]
    assert o.command == ["python", "-m", "pytest", "-q"]
    assert o.folio_args == []


def test_parse_options_stop_at_first_folio_arg():
    o = B.parse_args(["--no-fetch", "--reinstall", "generate", "--max-tokens", "5", "--", "x"])
    assert not o.fetch and o.reinstall
    assert o.folio_args == ["generate", "--max-tokens", "5", "--", "x"]
    assert o.command is None


def test_parse_extras_forms():
    o = B.parse_args(["--extras=test,gui", "--extras", "test", "--extras", "docs"])
    assert o.extras == ["test", "gui", "docs"]


def test_parse_nothing_and_help():
    o = B.parse_args([])
    assert o.folio_args == [] and o.command is None and not o.help
    assert B.parse_args(["-h"]).help and B.parse_args(["--help"]).help


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--"], "must be followed by a command"),
        (["--extras"], "needs a value"),
        (["--extras", "te st"], "invalid extra"),
        (["--extras", "x]"], "invalid extra"),
        (["--version"], "-- folio --version"),
    ],
)
def test_parse_errors(argv, message):
    with pytest.raises(B.UsageError, match=message):
        B.parse_args(argv)


def test_main_usage_error_exits_2(capsys):
    assert B.main(["--bogus"]) == 2
    assert "unknown option --bogus" in capsys.readouterr().err


def test_help_runs_without_installing():
    out = subprocess.run(
        [sys.executable, str(BOOTSTRAP), "--help"], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0
    assert "--extras" in out.stdout and "FOLIO_TORCH" in out.stdout


# ---------------------------------------------------------------- GPU detection


def fake_nvidia_smi(tmp_path: Path, body: str, monkeypatch) -> None:
    bindir = tmp_path / "fakebin"
    bindir.mkdir()
    exe = bindir / "nvidia-smi"
    exe.write_text("#!/bin/sh\n" + body + "\n")
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setattr(B.sys, "platform", "linux")


@posix_only
def test_hanging_nvidia_smi_means_cpu_after_timeout(tmp_path, monkeypatch):
    fake_nvidia_smi(tmp_path, "sleep 60", monkeypatch)
    t0 = time.monotonic()
    assert B.detect_nvidia_gpu(timeout=0.5) is False
    assert time.monotonic() - t0 < 5
    assert B.torch_choice({}, None, lambda: B.detect_nvidia_gpu(timeout=0.5)) == "cpu"


def test_default_probe_timeout_is_5s():
    assert B.NVIDIA_SMI_TIMEOUT_S == 5.0
    assert B.detect_nvidia_gpu.__defaults__ == (5.0,)


@posix_only
def test_answering_nvidia_smi_means_cuda(tmp_path, monkeypatch):
    fake_nvidia_smi(tmp_path, 'echo "GPU 0: NVIDIA H200 (UUID: GPU-1234)"', monkeypatch)
    assert B.detect_nvidia_gpu(timeout=5) is True
    assert B.torch_choice({}, None, B.detect_nvidia_gpu) == "cuda"


@posix_only
def test_failing_nvidia_smi_means_cpu(tmp_path, monkeypatch):
    fake_nvidia_smi(
        tmp_path, 'echo "NVIDIA-SMI has failed because it could not communicate"; exit 9',
        monkeypatch,
    )
    assert B.detect_nvidia_gpu(timeout=5) is False


def test_no_nvidia_smi_means_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert B.detect_nvidia_gpu() is False


# ---------------------------------------------------------------- torch choice


def never(*a):
    raise AssertionError("GPU detection must not run")


@pytest.mark.parametrize("value, expected", [("cpu", "cpu"), ("CUDA", "cuda"), (" cpu ", "cpu")])
def test_folio_torch_overrides_detection_and_stamp(value, expected):
    assert B.torch_choice({"FOLIO_TORCH": value}, {"torch": "cuda"}, never) == expected


def test_folio_torch_invalid():
    with pytest.raises(B.UsageError, match="FOLIO_TORCH"):
        B.torch_choice({"FOLIO_TORCH": "rocm"}, None, never)


def test_auto_reuses_stamp_choice_without_probing():
    assert B.torch_choice({}, {"torch": "cuda"}, never) == "cuda"
    assert B.torch_choice({"FOLIO_TORCH": "auto"}, {"torch": "cpu"}, never) == "cpu"


def test_auto_detects_without_stamp():
    assert B.torch_choice({}, None, lambda: True) == "cuda"
    assert B.torch_choice({}, {"torch": "weird"}, lambda: False) == "cpu"


def test_torch_install_attempts():
    assert B.torch_install_attempts("cuda", "linux") == [["torch==2.13.0"]]
    assert B.torch_install_attempts("cpu", "linux") == [
        ["torch==2.13.0+cpu"],
        ["--extra-index-url", "https://download.pytorch.org/whl/cpu", "--timeout", "30",
         "torch==2.13.0+cpu"],
    ]
    assert B.torch_install_attempts("cpu", "darwin") == [["torch==2.13.0"]]
    assert B.torch_install_attempts("cpu", "win32") == [["torch==2.13.0"]]


# ---------------------------------------------------------------- install flow (faked pip)


class FakePip:
    def __init__(self, fail=()):
        self.calls: list[list[str]] = []
        self.fail = list(fail)  # substrings: a call containing one fails (once each)

    def __call__(self, cmd, log_path, env):
        self.calls.append(cmd)
        assert env["VIRTUAL_ENV"] and env["PIP_NO_INPUT"] == "1"
        with open(log_path, "a") as log:
            log.write("pip says: " + " ".join(cmd[3:]) + "\n")
        line = " ".join(cmd)
        for f in self.fail:
            if f in line:
                self.fail.remove(f)
                with open(log_path, "a") as log:
                    log.write("ERROR: No matching distribution found for " + cmd[-1] + "\n")
                return 1
        return 0

    def args(self):
        return [c[4:] for c in self.calls]


class FakeVenv:
    def __init__(self):
        self.created: list[bool] = []

    def __call__(self, venv, clear, log_path):
        self.created.append(clear)
        py = B.venv_python(venv)
        py.parent.mkdir(parents=True, exist_ok=True)
        py.write_text("")
        (venv / "pyvenv.cfg").write_text("home = /usr/bin\n")


@pytest.fixture
def checkout(tmp_path):
    root = tmp_path / "checkout"
    root.mkdir()
    (root / "pyproject.toml").write_text('[project]\nname = "folio-llm"\n')
    return root


def install(checkout, extras=(), env=None, pip=None, venv_maker=None, **kw):
    pip = pip or FakePip()
    venv_maker = venv_maker or FakeVenv()
    kw.setdefault("compile_kernels", lambda python, log, env: 0)
    ran = B.ensure_installed(
        checkout, checkout / ".venv", list(extras),
        env={"FOLIO_TORCH": "cpu"} if env is None else env,
        runner=pip, make_venv=venv_maker, detect_gpu=never,
        python_ok=lambda p: p.exists(), **kw,
    )
    return ran, pip, venv_maker


def test_kernels_compile_after_install_and_a_failure_keeps_no_stamp(checkout):
    compiled = []
    ran, pip, _ = install(checkout, compile_kernels=lambda python, log, env: compiled.append(python) or 0)
    assert ran and len(compiled) == 1 and len(pip.calls) == 2
    (checkout / ".venv" / "folio-install.json").unlink()
    with pytest.raises(B.InstallError, match="kernels failed to compile"):
        install(checkout, compile_kernels=lambda python, log, env: 1)
    assert not (checkout / ".venv" / "folio-install.json").exists()


def test_first_install_runs_steps_in_order(checkout, monkeypatch):
    monkeypatch.setattr(B.sys, "platform", "linux")
    ran, pip, venv = install(checkout, ["test"])
    assert ran and venv.created == [False]
    assert pip.args() == [["torch==2.13.0+cpu"], ["-e", f"{checkout}[test]"]]
    stamp = json.loads((checkout / ".venv" / "folio-install.json").read_text())
    assert stamp["torch"] == "cpu" and stamp["extras"] == ["test"]
    assert stamp["venv"] == str(checkout / ".venv")
    assert (checkout / ".venv" / "folio-install.log").exists()


def test_matching_stamp_skips_pip(checkout):
    install(checkout, ["test"])
    ran, pip, venv = install(checkout, ["test"])
    assert not ran and pip.calls == [] and venv.created == []
    # fewer extras than installed: still covered
    ran, pip, _ = install(checkout, [])
    assert not ran and pip.calls == []
    # FOLIO_TORCH unset: the stamp's choice is reused, no GPU probe (detect_gpu=never)
    ran, pip, _ = install(checkout, [], env={})
    assert not ran and pip.calls == []


def test_changed_pyproject_reinstalls_and_keeps_extras(checkout):
    install(checkout, ["test"])
    with open(checkout / "pyproject.toml", "a") as fh:
        fh.write("# changed\n")
    ran, pip, venv = install(checkout, [])
    assert ran and venv.created == []
    assert pip.args()[-1] == ["-e", f"{checkout}[test]"]
    assert install(checkout, ["test"])[0] is False


def test_new_extra_reinstalls(checkout):
    install(checkout, [])
    ran, pip, _ = install(checkout, ["test"])
    assert ran and pip.args()[-1] == ["-e", f"{checkout}[test]"]


def test_reinstall_flag_ignores_stamp(checkout):
    install(checkout, [])
    ran, pip, _ = install(checkout, [], reinstall=True)
    assert ran and len(pip.calls) == 2


def test_torch_switch_uninstalls_first(checkout, monkeypatch):
    monkeypatch.setattr(B.sys, "platform", "linux")
    install(checkout, [], env={"FOLIO_TORCH": "cpu"})
    ran, pip, _ = install(checkout, [], env={"FOLIO_TORCH": "cuda"})
    assert ran
    assert pip.args() == [["-y", "torch"], ["torch==2.13.0"], ["-e", str(checkout)]]
    assert pip.calls[0][2:4] == ["pip", "uninstall"]


def test_cpu_torch_falls_back_to_pytorch_index(checkout, monkeypatch):
    monkeypatch.setattr(B.sys, "platform", "linux")
    pip = FakePip(fail=["install torch==2.13.0+cpu"])
    ran, pip, _ = install(checkout, [], pip=pip)
    assert pip.args() == [
        ["torch==2.13.0+cpu"],
        ["--extra-index-url", "https://download.pytorch.org/whl/cpu", "--timeout", "30",
         "torch==2.13.0+cpu"],
        ["-e", str(checkout)],
    ]


def test_failed_step_raises_with_log_and_leaves_no_stamp(checkout, monkeypatch):
    monkeypatch.setattr(B.sys, "platform", "linux")
    install(checkout, [])
    with open(checkout / "pyproject.toml", "a") as fh:
        fh.write("# changed\n")
    pip = FakePip(fail=["-e"])
    with pytest.raises(B.InstallError) as info:
        install(checkout, [], pip=pip)
    assert "could not install Folio" in str(info.value)
    log = info.value.log_path
    assert log == checkout / ".venv" / "folio-install.log"
    assert "No matching distribution" in B.log_tail(log)
    assert not (checkout / ".venv" / "folio-install.json").exists()
    # the next run retries instead of trusting a half-done install
    ran, pip, _ = install(checkout, [])
    assert ran


def test_torch_failure_message(checkout, monkeypatch):
    monkeypatch.setattr(B.sys, "platform", "linux")
    pip = FakePip(fail=["torch==2.13.0+cpu", "torch==2.13.0+cpu"])
    with pytest.raises(B.InstallError, match=r"PyTorch 2\.13\.0 \(CPU build\)"):
        install(checkout, [], pip=pip)


def test_moved_checkout_recreates_venv(checkout):
    install(checkout, [])
    stamp_path = checkout / ".venv" / "folio-install.json"
    stamp = json.loads(stamp_path.read_text())
    stamp["venv"] = "/somewhere/else/.venv"
    stamp_path.write_text(json.dumps(stamp))
    ran, pip, venv = install(checkout, [])
    assert ran and venv.created == [True]


def test_main_reports_install_failure(checkout, monkeypatch, capsys):
    def boom(*a, **k):
        raise B.InstallError("could not install Folio (pip install -e x)", checkout / "log")

    (checkout / "log").write_text("line one\nERROR: resolution impossible\n")
    monkeypatch.setattr(B, "ensure_installed", boom)
    assert B.main(["generate", "hi"]) == 1
    err = capsys.readouterr().err
    assert "ERROR: could not install Folio" in err
    assert "resolution impossible" in err and f"Full log: {checkout / 'log'}" in err


def test_main_wires_command_and_fetch(monkeypatch):
    calls = []
    monkeypatch.setattr(B, "ensure_installed", lambda *a, **k: calls.append(("install", a[2])))
    monkeypatch.setattr(B, "ensure_default_model", lambda *a, **k: calls.append(("fetch",)))
    monkeypatch.setattr(B, "exec_in_venv", lambda venv, argv, env=None: calls.append(argv) or 7)
    assert B.main(["--extras", "test", "--", "python", "-m", "pytest"]) == 7
    assert calls == [("install", ["test"]), ["python", "-m", "pytest"]]
    calls.clear()
    assert B.main(["generate", "x"]) == 7
    assert calls[:2] == [("install", []), ("fetch",)]
    assert calls[2][0].endswith("folio") and calls[2][1:] == ["generate", "x"]
    calls.clear()
    assert B.main(["--no-fetch", "generate", "x"]) == 7
    assert ("fetch",) not in calls


def test_ensure_default_model_runs_fetch_only_when_missing(tmp_path):
    runs = []

    def run(cmd, **kw):
        runs.append(cmd)
        rc = present if "-c" in cmd else 0
        return subprocess.CompletedProcess(cmd, rc)

    present = 0
    assert B.ensure_default_model(tmp_path, tmp_path / ".venv", {"PATH": ""}, run=run) is False
    assert len(runs) == 1 and runs[0][-1] == str(tmp_path / "engine" / "model" / "fetch.py")
    present = 1
    runs.clear()
    assert B.ensure_default_model(tmp_path, tmp_path / ".venv", {"PATH": ""}, run=run) is True
    assert runs[1][1:] == ["models", "fetch-default"]


def test_model_check_snippet_against_real_fetch_module(tmp_path):
    env = dict(os.environ, FOLIO_MODELS_DIR=str(tmp_path))
    check = [sys.executable, "-P", "-c", B._CHECK_MODEL_SNIPPET,
             str(ROOT / "engine" / "model" / "fetch.py")]
    assert subprocess.run(check, env=env, timeout=60).returncode == 1


def test_venv_environ():
    env = B.venv_environ(Path("/x/.venv"), {"PATH": "/usr/bin", "PYTHONHOME": "/bad"})
    assert env["PATH"].split(os.pathsep)[0] == str(B.venv_bin(Path("/x/.venv")))
    assert env["VIRTUAL_ENV"] == "/x/.venv" and "PYTHONHOME" not in env


# ---------------------------------------------------------------- real install


@pytest.mark.slow
def test_real_bootstrap_in_a_copy(tmp_path):
    import shutil

    copy = tmp_path / "folio"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".venv", ".git", "*.egg-info"))
    cmd = [sys.executable, str(copy / "installer" / "bootstrap.py"), "--",
           "python", "-c", "import torch, engine; print(torch.__version__)"]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip().startswith("2.13.0")
    stamp = copy / ".venv" / "folio-install.json"
    stamped = stamp.stat().st_mtime_ns
    second = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0
    # Nothing was reinstalled: no install step ran and the stamp was not rewritten.
    assert "Installing" not in second.stderr and "Compiling" not in second.stderr
    assert stamp.stat().st_mtime_ns == stamped
