"""Unit tests for installer/bootstrap.py: decisions and parsing, no real installs."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
import tomllib
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
# nvidia-smi is replaced by a script that prints canned output; the bootstrap asks it
# for `--query-gpu=name,driver_version --format=csv,noheader`.


def fake_nvidia_smi(tmp_path: Path, body: str, monkeypatch) -> None:
    bindir = tmp_path / "fakebin"
    bindir.mkdir()
    exe = bindir / "nvidia-smi"
    exe.write_text("#!/bin/sh\n" + body + "\n")
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setattr(B.sys, "platform", "linux")


RECENT = 'echo "NVIDIA H200, 580.95.05"'
TWO_GPUS = 'printf "NVIDIA GeForce RTX 4090, 590.44.01\\nNVIDIA GeForce RTX 4090, 590.44.01\\n"'
OLD = 'echo "NVIDIA GeForce GTX 1080, 535.183.01"'


@posix_only
@pytest.mark.parametrize("body", [RECENT, TWO_GPUS])
def test_recent_driver_means_cuda(tmp_path, monkeypatch, body):
    fake_nvidia_smi(tmp_path, body, monkeypatch)
    probe = B.probe_nvidia(timeout=5)
    assert probe.usable and probe.driver and probe.name.startswith("NVIDIA")
    assert B.detect_nvidia_gpu(timeout=5) is True
    assert B.choose_torch({}, None, B.probe_nvidia) == ("cuda", probe.reason)


@posix_only
def test_old_driver_means_cpu_and_says_why(tmp_path, monkeypatch):
    fake_nvidia_smi(tmp_path, OLD, monkeypatch)
    probe = B.probe_nvidia(timeout=5)
    assert not probe.usable and probe.driver == "535.183.01"
    assert "535.183.01 is older than 580.65.06" in probe.reason and "update the driver" in probe.reason
    variant, why = B.choose_torch({}, None, B.probe_nvidia)
    assert variant == "cpu" and why == probe.reason


def test_driver_minimum_per_platform(tmp_path, monkeypatch):
    def probe(body, platform_name):
        exe = tmp_path / "nvidia-smi"
        exe.write_text("#!/bin/sh\n" + body + "\n")
        exe.chmod(0o755)
        monkeypatch.setenv("PATH", str(tmp_path))
        return B.probe_nvidia(timeout=5, platform_name=platform_name)

    if os.name != "posix":
        pytest.skip("fake nvidia-smi is a shell script")
    assert probe('echo "RTX A4000, 580.65.06"', "linux").usable
    assert not probe('echo "RTX A4000, 580.65.05"', "linux").usable
    assert probe('echo "RTX A4000, 580.88"', "win32").usable
    assert not probe('echo "RTX A4000, 580.65.06"', "win32").usable  # Windows needs 580.88


@posix_only
def test_hanging_nvidia_smi_means_cpu_after_timeout(tmp_path, monkeypatch):
    fake_nvidia_smi(tmp_path, "sleep 60", monkeypatch)
    t0 = time.monotonic()
    probe = B.probe_nvidia(timeout=0.5)
    assert probe.usable is False and "did not answer within 0.5 s" in probe.reason
    assert time.monotonic() - t0 < 5
    assert B.torch_choice({}, None, lambda: B.probe_nvidia(timeout=0.5)) == "cpu"


def test_default_probe_timeout_is_5s():
    assert B.NVIDIA_SMI_TIMEOUT_S == 5.0
    assert B.detect_nvidia_gpu.__defaults__ == (5.0,)
    assert B.probe_nvidia.__defaults__[0] == 5.0


@posix_only
@pytest.mark.parametrize("body, reason", [
    ('echo "NVIDIA-SMI has failed because it could not communicate"; exit 9', "failed (exit status 9)"),
    ('echo "No devices were found"', "listed no GPU"),
    ("true", "listed no GPU"),
])
def test_failing_or_empty_nvidia_smi_means_cpu(tmp_path, monkeypatch, body, reason):
    fake_nvidia_smi(tmp_path, body, monkeypatch)
    probe = B.probe_nvidia(timeout=5)
    assert probe.usable is False and reason in probe.reason
    assert B.detect_nvidia_gpu(timeout=5) is False


def test_no_nvidia_smi_means_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    probe = B.probe_nvidia()
    assert not probe and "not found" in probe.reason
    assert B.detect_nvidia_gpu() is False
    assert B.choose_torch({}, None, B.probe_nvidia)[0] == "cpu"


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


def test_torch_precedence_cli_env_setting_stamp():
    assert B.choose_torch({"FOLIO_TORCH": "cuda"}, {"torch": "cuda"}, never, cli="cpu")[0] == "cpu"
    assert B.choose_torch({"FOLIO_TORCH": "cuda"}, None, never, cli="auto", setting="cpu")[0] == "cuda"
    assert B.choose_torch({}, {"torch": "cuda"}, never, setting="cpu") == (
        "cpu", "chosen by the app's settings ([install] torch)")
    assert B.choose_torch({}, {"torch": "cuda"}, never, setting="auto")[0] == "cuda"


def test_torch_setting_read_from_the_apps_settings_file(tmp_path):
    env = {"FOLIO_DATA_DIR": str(tmp_path)}
    assert B.torch_setting(env) is None
    (tmp_path / "folio.ini").write_text("[General]\nx=1\n\n[install]\ntorch=CPU\n")
    assert B.torch_setting(env) == "cpu"
    (tmp_path / "folio.ini").write_text("[install]\ntorch=rocm\n")
    assert B.torch_setting(env) is None


def test_torch_install_attempts():
    assert B.torch_install_attempts("cuda", "linux") == [["torch==2.13.0"]]
    assert B.torch_install_attempts("cpu", "linux") == [
        ["torch==2.13.0+cpu"],
        ["--extra-index-url", "https://download.pytorch.org/whl/cpu", "--timeout", "30",
         "torch==2.13.0+cpu"],
    ]
    assert B.torch_install_attempts("cpu", "darwin") == [["torch==2.13.0"]]
    assert B.torch_install_attempts("cpu", "win32") == [["torch==2.13.0"]]
    assert B.torch_install_attempts("cuda", "win32") == [
        ["--extra-index-url", "https://download.pytorch.org/whl/cu130", "--timeout", "30",
         "torch==2.13.0"]]


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
    kw.setdefault("verify", lambda python, log, env: {"version": "2.13.0", "cuda": False})
    ran = B.ensure_installed(
        checkout, checkout / ".venv", list(extras),
        env={"FOLIO_TORCH": "cpu"} if env is None else env,
        runner=pip, make_venv=venv_maker, python_ok=lambda p: p.exists(),
        **{"detect_gpu": never, **kw},
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


def sees_gpu(python, log, env):
    return {"version": "2.13.0", "cuda": True, "device": "NVIDIA H200"}


def test_torch_switch_uninstalls_first(checkout, monkeypatch):
    monkeypatch.setattr(B.sys, "platform", "linux")
    install(checkout, [], env={"FOLIO_TORCH": "cpu"})
    ran, pip, _ = install(checkout, [], env={"FOLIO_TORCH": "cuda"}, verify=sees_gpu)
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
    with pytest.raises(B.InstallError) as info:  # and the old venv no longer imports
        install(checkout, [], pip=pip, verify=lambda *a: None)
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


def test_cuda_build_without_gpu_falls_back_to_cpu(checkout, monkeypatch, capsys):
    monkeypatch.setattr(B.sys, "platform", "linux")
    ran, pip, _ = install(checkout, [], env={}, detect_gpu=lambda: B.GpuProbe(True, "H200"))
    assert ran
    assert pip.args() == [["torch==2.13.0"], ["-e", str(checkout)],  # CUDA build, no GPU seen
                          ["-y", "torch"],
                          ["torch==2.13.0+cpu"], ["-e", str(checkout)]]
    stamp = json.loads((checkout / ".venv" / "folio-install.json").read_text())
    assert stamp["torch"] == "cpu"
    assert "torch.cuda.is_available() == False" in capsys.readouterr().err
    log = (checkout / ".venv" / "folio-install.log").read_text()
    assert "could not use the GPU" in log
    # the next run keeps the CPU build without probing again
    assert install(checkout, [], env={})[0] is False


def test_verify_failure_is_an_install_error(checkout):
    with pytest.raises(B.InstallError, match="does not import"):
        install(checkout, [], verify=lambda python, log, env: None)
    assert not (checkout / ".venv" / "folio-install.json").exists()


def test_failed_upgrade_keeps_the_previous_working_install(checkout, monkeypatch):
    monkeypatch.setattr(B.sys, "platform", "linux")
    install(checkout, [])
    stamp_path = checkout / ".venv" / "folio-install.json"
    before = json.loads(stamp_path.read_text())
    with open(checkout / "pyproject.toml", "a") as fh:
        fh.write("# upgraded\n")
    with pytest.raises(B.InstallError) as info:
        install(checkout, [], pip=FakePip(fail=["-e"]))
    assert info.value.kept_previous
    assert json.loads(stamp_path.read_text()) == before  # the old install stays in use
    # ... but it does not satisfy the new pyproject, so the next run retries
    assert install(checkout, [])[0] is True


def test_failed_upgrade_of_a_broken_venv_keeps_nothing(checkout, monkeypatch):
    monkeypatch.setattr(B.sys, "platform", "linux")
    install(checkout, [])
    with open(checkout / "pyproject.toml", "a") as fh:
        fh.write("# upgraded\n")
    with pytest.raises(B.InstallError) as info:
        install(checkout, [], pip=FakePip(fail=["-e"]), verify=lambda *a: None)
    assert not info.value.kept_previous
    assert not (checkout / ".venv" / "folio-install.json").exists()


# ---------------------------------------------------------------- lock file


LOCK_HEADER = "# folio-lock-target: {tag} torch=cpu\nnumpy==2.4.6 \\\n    --hash=sha256:{h}\n"


def write_lock(path: Path, tag: str) -> Path:
    path.write_text(LOCK_HEADER.format(tag=tag, h="0" * 64))
    return path


def test_lock_applies_only_to_its_target_and_the_cpu_build(tmp_path):
    lock = write_lock(tmp_path / "req.lock", B.machine_tag())
    assert B.lock_applies(lock, "cpu", {})
    assert not B.lock_applies(lock, "cuda", {})
    assert not B.lock_applies(lock, "cpu", {"FOLIO_NO_LOCK": "1"})
    assert B.lock_applies(lock, "cpu", {"FOLIO_NO_LOCK": "0"})
    assert not B.lock_applies(write_lock(tmp_path / "other.lock", "cp312-win32-amd64"), "cpu", {})
    assert not B.lock_applies(tmp_path / "missing.lock", "cpu", {})
    assert not B.lock_applies(None, "cpu", {})


def test_machine_tag():
    assert B.machine_tag("linux", "X86_64", (3, 11)) == "cp311-linux-x86_64"


def test_shipped_lock_is_pinned_and_hashed():
    lock = ROOT / "installer" / "requirements-cpu.lock"
    text = lock.read_text()
    assert "folio-lock-target: cp311-linux-x86_64 torch=cpu" in text
    reqs = [r for r in text.replace("\\\n", " ").splitlines() if r and not r.startswith("#")]
    names = {r.split("==")[0].lower().replace("_", "-") for r in reqs}
    for r in reqs:
        assert re.match(r"^[A-Za-z0-9_.-]+==\S+\s+--hash=sha256:[0-9a-f]{64}$", r.strip()), r
    # every runtime dependency of pyproject.toml, the CPU torch, and the build backend
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    wanted = {re.split(r"[\s<>=!~;\[]", d, maxsplit=1)[0].lower().replace("_", "-") for d in deps}
    assert wanted | {"setuptools"} <= names, wanted - names
    assert "torch==2.13.0+cpu" in text


def test_install_from_lock(checkout, monkeypatch, tmp_path):
    lock = write_lock(tmp_path / "req.lock", B.machine_tag())
    ran, pip, _ = install(checkout, [], dep_lock=lock)
    assert pip.args() == [["--require-hashes", "-r", str(lock)],
                          ["--no-build-isolation", "--no-deps", "-e", str(checkout)]]
    stamp = json.loads((checkout / ".venv" / "folio-install.json").read_text())
    assert stamp["lock_sha256"] == B.file_sha256(lock)
    # unchanged: nothing runs; a changed lock reinstalls (pip then replaces what changed)
    assert install(checkout, [], dep_lock=lock)[0] is False
    lock.write_text(lock.read_text() + "# new pin\n")
    ran, pip, _ = install(checkout, ["test"], dep_lock=lock)
    assert ran and pip.args() == [["--require-hashes", "-r", str(lock)],
                                  ["--no-build-isolation", "-e", f"{checkout}[test]"]]


def test_lock_falls_back_to_the_pytorch_cpu_index(checkout, tmp_path):
    lock = write_lock(tmp_path / "req.lock", B.machine_tag())
    ran, pip, _ = install(checkout, [], dep_lock=lock, pip=FakePip(fail=["--require-hashes -r"]))
    assert pip.args()[1] == ["--extra-index-url", "https://download.pytorch.org/whl/cpu",
                             "--timeout", "30", "--require-hashes", "-r", str(lock)]


def test_cuda_ignores_the_cpu_lock(checkout, monkeypatch, tmp_path):
    monkeypatch.setattr(B.sys, "platform", "linux")
    lock = write_lock(tmp_path / "req.lock", B.machine_tag())
    ran, pip, _ = install(checkout, [], env={"FOLIO_TORCH": "cuda"}, dep_lock=lock, verify=sees_gpu)
    assert pip.args() == [["torch==2.13.0"], ["-e", str(checkout)]]


# ---------------------------------------------------------------- layout and Python


def test_layout_checkout_when_git_present(tmp_path):
    (tmp_path / ".git").mkdir()
    lay = B.choose_layout(None, tmp_path, {"HOME": "/h"}, "linux")
    assert lay.mode == "checkout" and lay.venv == tmp_path / ".venv"
    assert lay.install_log == tmp_path / ".venv" / "folio-install.log"


def test_layout_user_data_folder(tmp_path):
    lay = B.choose_layout(None, tmp_path, {"HOME": "/h"}, "linux")
    assert lay.mode == "user" and lay.venv == Path("/h/.local/share/folio/venv")
    assert lay.install_log == Path("/h/.local/share/folio/logs/install.log")
    lay = B.choose_layout("user", tmp_path, {"HOME": "/h", "XDG_DATA_HOME": "/x"}, "linux")
    assert lay.root == Path("/x/folio")
    # a relative XDG_DATA_HOME is invalid (XDG spec) and ignored
    assert B.user_data_root({"HOME": "/h", "XDG_DATA_HOME": "rel"}, "linux") == Path("/h/.local/share/folio")
    assert B.user_data_root({"HOME": "/h", "FOLIO_HOME": "/f"}, "linux") == Path("/f")
    win = {"LOCALAPPDATA": "C:/Users/Zoë Ångström/AppData/Local", "USERPROFILE": "C:/Users/Zoë Ångström"}
    assert B.user_data_root(win, "win32") == Path("C:/Users/Zoë Ångström/AppData/Local/Folio")
    (tmp_path / ".git").mkdir()
    assert B.choose_layout("user", tmp_path, {"HOME": "/h"}, "linux").mode == "user"


def test_user_layout_refuses_program_files():
    env = {"FOLIO_HOME": os.path.join("C:" + os.sep, "Program Files", "Folio"),
           "ProgramFiles": "C:" + os.sep + "Program Files"}
    with pytest.raises(B.UsageError, match="must not be inside"):
        B.choose_layout("user", Path("/app"), env, "win32")


def test_app_settings_file_matches_platformdirs(tmp_path):
    platformdirs = pytest.importorskip("platformdirs")
    env = {"HOME": str(Path.home())}
    if sys.platform.startswith("linux"):
        env["XDG_DATA_HOME"] = os.environ.get("XDG_DATA_HOME", "")
    assert B.app_settings_file(env) == Path(platformdirs.user_data_dir("folio")) / "folio.ini"


@posix_only
def test_find_python_skips_old_and_broken_candidates(tmp_path):
    def fake(name, version):
        exe = tmp_path / name
        exe.write_text(f"#!/bin/sh\n{sys.executable} -c 'import sys; sys.version_info = {version!r}; "
                       f"exec(sys.argv[-1])' \"$@\"\n")
        exe.chmod(0o755)

    fake("python3.14", (3, 10, 0))  # claims to be old
    (tmp_path / "python3.13").write_text("#!/bin/sh\nexit 3\n")  # broken
    (tmp_path / "python3.13").chmod(0o755)
    env = {"PATH": str(tmp_path)}
    assert B.find_python("linux", env) is None
    fake("python3.12", (3, 12, 1))
    assert B.find_python("linux", env) == sys.executable
    assert B.python_candidates("win32", {})[0] == ["py", "-3.14"]
    assert B.python_candidates("linux", {"FOLIO_PYTHON": "/opt/py"})[0] == ["/opt/py"]


def test_parse_new_options():
    o = B.parse_args(["--user", "--torch", "CPU", "--windowed", "--launch", "--smoke-test", "x"])
    assert o.layout == "user" and o.torch == "cpu" and o.windowed and o.launch
    assert o.folio_args == ["--smoke-test", "x"] and o.command is None
    assert B.parse_args(["--checkout", "--torch=auto"]).layout == "checkout"
    with pytest.raises(B.UsageError, match="--torch must be"):
        B.parse_args(["--torch", "rocm"])

