#!/usr/bin/env python3
"""Folio bootstrap: make a working Folio install and run it.

Uses only the standard library, so any Python 3.11+ can run it straight from a
fresh checkout; every launcher (installer/linux/folio-launcher.sh, the Windows
Folio.cmd, the Start-menu and application-menu entries) calls it too.

Usage::

    python3 installer/bootstrap.py [OPTIONS] [FOLIO_ARGS ...]
    python3 installer/bootstrap.py [OPTIONS] -- COMMAND [ARGS ...]
    python3 installer/bootstrap.py [OPTIONS] --launch [APP_ARGS ...]

The first form runs ``folio FOLIO_ARGS`` from the venv (with no FOLIO_ARGS it
only installs and fetches, then says so).  The second form runs an arbitrary
COMMAND with the venv activated (its bin folder first on PATH, VIRTUAL_ENV
set).  The third form is what the launchers use: install if needed, check that
Qt can open a window, then start the desktop app (``--launch --smoke-test``
opens it, loads the engine, runs a few seconds and exits 0)::

    python3 installer/bootstrap.py generate "Write a haiku about memory"
    python3 installer/bootstrap.py --extras test -- python -m pytest

Where the install goes (the *layout*):

- checkout layout (the default when the bootstrap sits in a git checkout, i.e.
  ``<checkout>/.git`` exists, or with ``--checkout``): the venv is
  ``<checkout>/.venv`` and its log ``.venv/folio-install.log``.  This is what
  the README's commands and CI use;
- user layout (``--user``, and the default anywhere else, e.g. the copy that
  installer/linux/install.sh or the Windows installer puts in place): everything
  lives in the per-user data folder, ``$FOLIO_HOME`` if set, else
  ``$XDG_DATA_HOME/folio`` (``~/.local/share/folio``) on Linux,
  ``%LOCALAPPDATA%\\Folio`` on Windows, ``~/Library/Application Support/Folio``
  on macOS: ``venv/`` and ``logs/install.log``, ``logs/launcher.log``,
  ``logs/folio.log``.  Never inside Program Files.

In both layouts Folio is installed editable from the folder that holds this
``installer/`` folder, so the code and its ``resources/`` stay side by side.

Options (only before FOLIO_ARGS, ``--`` or ``--launch``)::

    --extras LIST   install optional dependency groups too (comma separated,
                    repeatable), e.g. ``--extras test``
    --no-fetch      do not fetch the default model
    --reinstall     ignore the install stamp and run every install step again
    --torch BUILD   cpu, cuda or auto (the default): which PyTorch build
    --user          use the user layout even in a git checkout
    --checkout      use the checkout layout even without .git
    --windowed      no console: log to the logs folder, report errors in a
                    dialog, start the app without a console window (implied
                    when sys.stdout is None, as under pythonw)
    --launch        start the desktop app (the launchers' mode); what follows
                    goes to the app
    -h, --help      show this text

Steps, each skipped when already done:

1. create the venv with the Python running this script.  When that Python is
   older than 3.11 the bootstrap looks for a newer one (``$FOLIO_PYTHON``,
   python3.14 .. python3.11, ``py -3.x`` on Windows) and re-runs itself there;
2. choose the PyTorch build: ``--torch``, else ``FOLIO_TORCH=cpu|cuda|auto``,
   else the ``torch`` key of the ``[install]`` section of the app's settings
   file (``folio.ini`` in the app's data folder; the settings dialog can write
   it), else the choice the install stamp records, else detection: CUDA when
   ``nvidia-smi`` answers within 5 s and reports a driver new enough for
   PyTorch 2.13.0's CUDA 13.0 build (580.65.06 on Linux, 580.88 on Windows),
   otherwise CPU, and the reason is printed;
3. install the dependencies.  On the machine ``installer/requirements-cpu.lock``
   was made for (its header names it; today CPython 3.11, Linux x86_64) and
   with the CPU build, from that lock: pinned, ``--require-hashes``.  Elsewhere,
   with the CUDA build, or with ``FOLIO_NO_LOCK=1``: torch 2.13.0 unpinned (the
   CPU build ``torch==2.13.0+cpu`` from pip's indexes, retried with the PyTorch
   CPU index; on macOS/Windows PyPI's torch is the CPU build) and Folio's
   dependencies as pyproject.toml states them;
4. ``pip install -e <app>[EXTRAS]``;
5. check in a subprocess that torch imports and, for the CUDA build, sees the
   GPU; when it does not, switch to the CPU build and say why;
6. compile the CPU kernels once; write ``<venv>/folio-install.json`` (layout,
   hashes of pyproject.toml and the lock, torch build, extras).  When it
   matches, steps 1-6 are skipped entirely and no pip runs;
7. unless ``--no-fetch`` or the ``--`` form: fetch the default model if missing.

pip's output goes to the install log; when a step fails the script prints the
end of that log and its path and exits with status 1.  A failed upgrade keeps
the previous install when it still imports (its stamp is restored), and
``--launch`` then starts that previous install.  Usage errors exit with 2;
otherwise the exit status is that of folio / COMMAND / the app.
"""

from __future__ import annotations

import configparser
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

TORCH_VERSION = "2.13.0"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# PyPI's torch 2.13.0 for Linux is the CUDA 13.0 build; on Windows PyPI only has the
# CPU build, so the CUDA build comes from PyTorch's cu130 index.
TORCH_CUDA_INDEX_WINDOWS = "https://download.pytorch.org/whl/cu130"
TORCH_CUDA = "13.0"
# The oldest drivers CUDA 13.0 runs on (NVIDIA's CUDA 13.0 release notes, table 3).
# CUDA 13 does not start on a 12.x-era driver at all, so an older driver means CPU.
CUDA_MIN_DRIVER = {"linux": (580, 65, 6), "win32": (580, 88)}
NVIDIA_SMI_TIMEOUT_S = 5.0
STAMP_NAME = "folio-install.json"
LOG_NAME = "folio-install.log"
RECIPE = 2  # bump when the install steps change so that existing venvs redo them
MIN_PYTHON = (3, 11)
APP_ID = "Folio.Folio"  # Windows AppUserModelID, also set by folio/platform_setup.py

CHECKOUT = Path(__file__).resolve().parent.parent
LOCK_FILE = CHECKOUT / "installer" / "requirements-cpu.lock"
_LOCK_TARGET_RE = re.compile(r"^#\s*folio-lock-target:\s*(\S+)\s+torch=(\w+)", re.MULTILINE)

# On Windows a child console process opens its own console window unless told not
# to; in windowed mode (pythonw) every child runs with CREATE_NO_WINDOW.
_CREATE_NO_WINDOW = 0x08000000
_popen_flags = 0

# Loads engine/model/fetch.py by path (importing only engine.paths, never torch) and asks whether the default model is present and verified.
_CHECK_MODEL_SNIPPET = (
    "import importlib.util, sys\n"
    "spec = importlib.util.spec_from_file_location('_folio_fetch_check', sys.argv[1])\n"
    "mod = importlib.util.module_from_spec(spec)\n"
    "sys.modules[spec.name] = mod\n"
    "spec.loader.exec_module(mod)\n"
    "sys.exit(0 if mod.is_fetched() else 1)\n"
)

# Run in the venv after installing: torch must import, and the CUDA build must see
# a GPU.  One JSON line on stdout; anything else (a traceback) goes to the log.
_VERIFY_SNIPPET = (
    "import json, torch\n"
    "info = {'version': torch.__version__, 'cuda_build': torch.version.cuda,\n"
    "        'cuda': bool(torch.cuda.is_available())}\n"
    "if info['cuda']:\n"
    "    info['device'] = torch.cuda.get_device_name(0)\n"
    "print(json.dumps(info))\n"
)


class UsageError(Exception):
    pass


class InstallError(Exception):
    def __init__(self, message: str, log_path: Path | None = None):
        super().__init__(message)
        self.log_path = log_path
        self.kept_previous = False  # True when the previous working install was kept


def say(msg: str) -> None:
    stream = sys.stderr if sys.stderr is not None else sys.stdout
    if stream is not None:
        print(f"[folio] {msg}", file=stream, flush=True)


# --------------------------------------------------------------------------- CLI


@dataclass
class Options:
    extras: list[str] = field(default_factory=list)
    fetch: bool = True
    reinstall: bool = False
    help: bool = False
    torch: str | None = None
    layout: str | None = None  # "user", "checkout" or None (decide from .git)
    windowed: bool = False
    launch: bool = False
    folio_args: list[str] = field(default_factory=list)
    command: list[str] | None = None


_EXTRA_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?$")
_TORCH_VALUES = ("auto", "cpu", "cuda")


def _add_extras(opts: Options, value: str) -> None:
    for name in (v.strip() for v in value.split(",")):
        if not name:
            continue
        if not _EXTRA_RE.match(name):
            raise UsageError(f"invalid extra name {name!r}")
        if name not in opts.extras:
            opts.extras.append(name)


def _set_torch(opts: Options, value: str) -> None:
    value = value.strip().lower()
    if value not in _TORCH_VALUES:
        raise UsageError(f"--torch must be cpu, cuda or auto, not {value!r}")
    opts.torch = value


def parse_args(argv: list[str]) -> Options:
    opts = Options()
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            opts.command = argv[i + 1:]
            if not opts.command:
                raise UsageError("'--' must be followed by a command to run in the venv")
            return opts
        if arg in ("-h", "--help"):
            opts.help = True
        elif arg in ("--extras", "--torch"):
            if i + 1 >= len(argv):
                example = "--extras test" if arg == "--extras" else "--torch cpu"
                raise UsageError(f"{arg} needs a value, e.g. {example}")
            i += 1
            (_add_extras if arg == "--extras" else _set_torch)(opts, argv[i])
        elif arg.startswith("--extras="):
            _add_extras(opts, arg.split("=", 1)[1])
        elif arg.startswith("--torch="):
            _set_torch(opts, arg.split("=", 1)[1])
        elif arg == "--no-fetch":
            opts.fetch = False
        elif arg == "--reinstall":
            opts.reinstall = True
        elif arg in ("--user", "--checkout"):
            opts.layout = arg[2:]
        elif arg == "--windowed":
            opts.windowed = True
        elif arg == "--launch":
            opts.launch = True
            opts.folio_args = argv[i + 1:]
            return opts
        elif arg.startswith("-"):
            raise UsageError(
                f"unknown option {arg}; to pass it to folio write: -- folio {arg}"
            )
        else:
            opts.folio_args = argv[i:]
            return opts
        i += 1
    return opts


# --------------------------------------------------------------------------- layout


def user_data_root(env: dict[str, str] | None = None, platform_name: str = sys.platform) -> Path:
    """The per-user install root, as platformdirs would place Folio's data.

    Re-implemented here because the bootstrap runs before any package is installed.
    """
    env = os.environ if env is None else env
    if env.get("FOLIO_HOME"):
        return Path(env["FOLIO_HOME"]).expanduser()
    home = Path(env.get("HOME") or env.get("USERPROFILE") or Path.home())
    if platform_name == "win32":
        base = env.get("LOCALAPPDATA") or str(home / "AppData" / "Local")
        return Path(base) / "Folio"
    if platform_name == "darwin":
        return home / "Library" / "Application Support" / "Folio"
    xdg = env.get("XDG_DATA_HOME", "").strip()
    # The XDG spec: a relative XDG_DATA_HOME is invalid and must be ignored.
    base = Path(xdg) if xdg and os.path.isabs(xdg) else home / ".local" / "share"
    return base / "folio"


def app_settings_file(env: dict[str, str] | None = None, platform_name: str = sys.platform) -> Path:
    """The desktop app's settings file (gui/store.py's data_dir() / folio.ini)."""
    env = os.environ if env is None else env
    if env.get("FOLIO_DATA_DIR"):
        return Path(env["FOLIO_DATA_DIR"]).expanduser() / "folio.ini"
    home = Path(env.get("HOME") or env.get("USERPROFILE") or Path.home())
    if platform_name == "win32":
        # platformdirs.user_data_dir("folio") with appauthor defaulting to appname
        base = env.get("LOCALAPPDATA") or str(home / "AppData" / "Local")
        return Path(base) / "folio" / "folio" / "folio.ini"
    if platform_name == "darwin":
        return home / "Library" / "Application Support" / "folio" / "folio.ini"
    xdg = env.get("XDG_DATA_HOME", "").strip()
    base = Path(xdg) if xdg and os.path.isabs(xdg) else home / ".local" / "share"
    return base / "folio" / "folio.ini"


def torch_setting(env: dict[str, str] | None = None) -> str | None:
    """``[install] torch = cpu|cuda|auto`` from the app's settings file, if set."""
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read(app_settings_file(env), encoding="utf-8")
        value = parser.get("install", "torch", fallback="").strip().lower()
    except (configparser.Error, OSError, UnicodeDecodeError):
        return None
    return value if value in _TORCH_VALUES else None


@dataclass
class Layout:
    mode: str  # "checkout" or "user"
    app: Path  # the source folder installed editable (holds installer/, resources/)
    root: Path  # checkout, or the per-user data folder
    venv: Path
    logs: Path

    @property
    def install_log(self) -> Path:
        return self.venv / LOG_NAME if self.mode == "checkout" else self.logs / "install.log"


def choose_layout(mode: str | None, app: Path = CHECKOUT, env: dict[str, str] | None = None,
                  platform_name: str = sys.platform) -> Layout:
    if mode is None:
        mode = "checkout" if (app / ".git").exists() else "user"
    if mode == "checkout":
        return Layout("checkout", app, app, app / ".venv", app / ".venv" / "logs")
    root = user_data_root(env, platform_name)
    if platform_name == "win32":
        env = os.environ if env is None else env
        for var in ("ProgramFiles", "ProgramFiles(x86)", "ProgramW6432"):
            pf = env.get(var)
            if pf and os.path.normcase(str(root)).startswith(os.path.normcase(pf.rstrip("\\/") + os.sep)):
                raise UsageError(f"the Folio data folder {root} must not be inside {pf}; "
                                 "unset FOLIO_HOME or point it at a per-user folder")
    return Layout("user", app, root, root / "venv", root / "logs")


# --------------------------------------------------------------------------- venv paths


def venv_bin(venv: Path) -> Path:
    return venv / ("Scripts" if os.name == "nt" else "bin")


def venv_python(venv: Path, windowed: bool = False) -> Path:
    if os.name == "nt":
        return venv_bin(venv) / ("pythonw.exe" if windowed else "python.exe")
    return venv_bin(venv) / "python"


def pip_environ(venv: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """The venv's environment for pip: never prompt, never install into ~/.local."""
    env = venv_environ(venv, base)
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1", PIP_USER="0")
    return env


def venv_environ(venv: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env["VIRTUAL_ENV"] = str(venv)
    env["PATH"] = str(venv_bin(venv)) + os.pathsep + env.get("PATH", "")
    env.pop("PYTHONHOME", None)
    env.pop("__PYVENV_LAUNCHER__", None)
    return env


# --------------------------------------------------------------------------- finding Python


def python_candidates(platform_name: str = sys.platform,
                      env: dict[str, str] | None = None) -> list[list[str]]:
    """Commands that may start a Python >= 3.11, most preferred first."""
    env = os.environ if env is None else env
    found: list[list[str]] = []
    if env.get("FOLIO_PYTHON"):
        found.append([env["FOLIO_PYTHON"]])
    minors = range(14, MIN_PYTHON[1] - 1, -1)
    if platform_name == "win32":
        found += [["py", f"-3.{m}"] for m in minors] + [["python3"], ["python"]]
    else:
        found += [[f"python3.{m}"] for m in minors] + [["python3"]]
    return found


def find_python(platform_name: str = sys.platform, env: dict[str, str] | None = None,
                run=subprocess.run) -> str | None:
    """Path of the first Python >= 3.11 among ``python_candidates``, or None."""
    code = (f"import sys; print(sys.executable if sys.version_info >= {MIN_PYTHON!r} "
            "else '')")
    search_path = (env or os.environ).get("PATH")
    for cmd in python_candidates(platform_name, env):
        exe = shutil.which(cmd[0], path=search_path)
        if exe is None:
            continue
        try:
            proc = run([exe, *cmd[1:], "-c", code], capture_output=True, text=True,
                       timeout=15, stdin=subprocess.DEVNULL, check=False)
        except (OSError, subprocess.TimeoutExpired):
            continue
        path = (proc.stdout or "").strip()
        if proc.returncode == 0 and path:
            return path
    return None


# --------------------------------------------------------------------------- torch choice


@dataclass
class GpuProbe:
    """What ``nvidia-smi`` said; truthy when the CUDA build of PyTorch can use the GPU."""

    usable: bool
    reason: str
    name: str | None = None
    driver: str | None = None

    def __bool__(self) -> bool:
        return self.usable


def _run_with_timeout(cmd: list[str], timeout: float) -> tuple[int | None, str]:
    """(exit status or None on timeout, output).  The probe runs in its own process
    group which is killed on timeout, and its output goes to a temporary file, so a
    hung driver cannot block the bootstrap."""
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=(os.name == "posix"), creationflags=_popen_flags,
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                if os.name == "posix":
                    os.killpg(proc.pid, signal.SIGKILL)
                else:
                    proc.kill()
                proc.wait(timeout=1)
            except (OSError, subprocess.TimeoutExpired):
                pass  # stuck in the kernel; leave it behind
            return None, ""
        out.seek(0)
        return rc, out.read().decode("utf-8", "replace")


def _version_tuple(text: str) -> tuple[int, ...] | None:
    parts = re.findall(r"\d+", text)
    return tuple(int(p) for p in parts) if parts else None


def probe_nvidia(timeout: float = NVIDIA_SMI_TIMEOUT_S,
                 platform_name: str = sys.platform) -> GpuProbe:
    """Ask ``nvidia-smi`` for the GPUs and the driver version (within ``timeout`` s)."""
    if platform_name == "darwin":
        return GpuProbe(False, "macOS has no CUDA")
    exe = shutil.which("nvidia-smi")
    if not exe:
        return GpuProbe(False, "nvidia-smi was not found (no NVIDIA driver installed)")
    cmd = [exe, "--query-gpu=name,driver_version", "--format=csv,noheader"]
    try:
        rc, text = _run_with_timeout(cmd, timeout)
    except OSError as exc:
        return GpuProbe(False, f"nvidia-smi could not start: {exc}")
    if rc is None:
        return GpuProbe(False, f"nvidia-smi did not answer within {timeout:g} s")
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    if rc != 0:
        return GpuProbe(False, f"nvidia-smi failed (exit status {rc}): {first[:200]}")
    gpus = []
    for line in text.splitlines():
        name, sep, driver = line.rpartition(",")
        if sep and _version_tuple(driver) and name.strip():
            gpus.append((name.strip(), driver.strip()))
    if not gpus:
        return GpuProbe(False, f"nvidia-smi listed no GPU ({first[:200] or 'no output'})")
    name, driver = gpus[0]
    key = "win32" if platform_name == "win32" else "linux"
    need = CUDA_MIN_DRIVER[key]
    need_text = ".".join(f"{n:02d}" if i else str(n) for i, n in enumerate(need))
    if _version_tuple(driver) < need:
        return GpuProbe(
            False,
            f"{name} found, but its NVIDIA driver {driver} is older than {need_text}, the "
            f"oldest that PyTorch {TORCH_VERSION}'s CUDA {TORCH_CUDA} build runs on; "
            "update the driver to use the GPU",
            name, driver,
        )
    return GpuProbe(True, f"{name} with NVIDIA driver {driver}", name, driver)


def detect_nvidia_gpu(timeout: float = NVIDIA_SMI_TIMEOUT_S) -> bool:
    """True if nvidia-smi reports, within ``timeout`` s, a GPU the CUDA build can use."""
    return bool(probe_nvidia(timeout))


def choose_torch(env: dict[str, str], stamp: dict | None, detect=probe_nvidia,
                 cli: str | None = None, setting: str | None = None) -> tuple[str, str]:
    """(``"cpu"`` or ``"cuda"``, why).  Order: ``--torch``, ``FOLIO_TORCH``, the app's
    setting, the stamp's earlier choice, detection.  ``auto`` at any level defers."""
    value = env.get("FOLIO_TORCH", "").strip().lower() or "auto"
    if value not in _TORCH_VALUES:
        raise UsageError(f"FOLIO_TORCH must be cpu, cuda or auto, not {value!r}")
    for source, choice in (("--torch", cli), ("FOLIO_TORCH", value),
                           ("the app's settings ([install] torch)", setting)):
        if choice and choice != "auto":
            return choice, f"chosen by {source}"
    if stamp and stamp.get("torch") in ("cpu", "cuda"):
        return stamp["torch"], "kept from the previous install"
    probe = detect()
    if isinstance(probe, GpuProbe):
        return ("cuda" if probe else "cpu"), probe.reason
    return ("cuda", "an NVIDIA GPU answered") if probe else ("cpu", "no usable NVIDIA GPU")


def torch_choice(env: dict[str, str], stamp: dict | None, detect=probe_nvidia) -> str:
    """``"cpu"`` or ``"cuda"``: FOLIO_TORCH, else the stamp's earlier choice, else detect."""
    return choose_torch(env, stamp, detect)[0]


def torch_install_attempts(variant: str, platform: str = sys.platform) -> list[list[str]]:
    """pip install arguments to try in order until one succeeds (no lock file)."""
    if variant == "cuda" and platform == "win32":
        # PyPI's Windows torch is CPU-only; the PyTorch index's +cu130 local version
        # sorts above it, so this picks the CUDA build.
        return [["--extra-index-url", TORCH_CUDA_INDEX_WINDOWS, "--timeout", "30",
                 f"torch=={TORCH_VERSION}"]]
    if variant == "cuda" or not platform.startswith("linux"):
        # Linux: PyPI's torch is the CUDA build.  macOS/Windows: PyPI's is CPU.
        return [[f"torch=={TORCH_VERSION}"]]
    cpu = f"torch=={TORCH_VERSION}+cpu"
    # First the configured indexes (a local mirror or find-links may have the CPU
    # wheel; PyPI itself rejects the +cpu local version within seconds), then
    # the PyTorch CPU index.  pip's own default --timeout is 15 s; 30 s caps how
    # long an unreachable index can stall each of pip's retries.
    return [[cpu], ["--extra-index-url", TORCH_CPU_INDEX, "--timeout", "30", cpu]]


def torch_label(variant: str) -> str:
    return f"PyTorch {TORCH_VERSION} ({'CUDA' if variant == 'cuda' else 'CPU'} build)"


# --------------------------------------------------------------------------- lock file


def machine_tag(platform_name: str = sys.platform, machine: str | None = None,
                version: tuple[int, int] = sys.version_info[:2]) -> str:
    """``cp311-linux-x86_64``: what installer/make_lock.py writes as the lock's target."""
    machine = (machine or platform.machine()).lower()
    return f"cp{version[0]}{version[1]}-{platform_name}-{machine}"


def lock_applies(lock: Path | None, variant: str, env: dict[str, str] | None = None,
                 tag: str | None = None) -> bool:
    """Use ``lock`` for this install?  Only for its target machine and torch build."""
    env = os.environ if env is None else env
    if lock is None or env.get("FOLIO_NO_LOCK", "").strip() not in ("", "0"):
        return False
    try:
        head = lock.read_text(encoding="utf-8")[:4096]
    except OSError:
        return False
    m = _LOCK_TARGET_RE.search(head)
    return bool(m) and m.group(1) == (tag or machine_tag()) and m.group(2) == variant


def lock_install_attempts(lock: Path) -> list[list[str]]:
    # Same fallback as torch_install_attempts: the +cpu torch wheel may only be on
    # the PyTorch CPU index.  Hashes are checked whichever index serves a file.
    base = ["--require-hashes", "-r", str(lock)]
    return [base, ["--extra-index-url", TORCH_CPU_INDEX, "--timeout", "30", *base]]


# --------------------------------------------------------------------------- stamp


def file_sha256(path: Path) -> str:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as exc:
        raise InstallError(f"cannot read {path}: {exc}") from exc


def pyproject_sha256(checkout: Path) -> str:
    return file_sha256(checkout / "pyproject.toml")


def read_stamp(venv: Path) -> dict | None:
    try:
        data = json.loads((venv / STAMP_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def wanted_stamp(checkout: Path, venv: Path, extras: list[str], torch: str,
                 lock: Path | None = None) -> dict:
    return {
        "recipe": RECIPE,
        "pyproject_sha256": pyproject_sha256(checkout),
        "lock_sha256": file_sha256(lock) if lock is not None else None,
        "torch": torch,
        "torch_version": TORCH_VERSION,
        "extras": sorted(set(extras)),
        "checkout": str(checkout),
        "venv": str(venv),
    }


def stamp_satisfies(stamp: dict | None, want: dict) -> bool:
    """The recorded install covers ``want`` (same everything, superset of extras)."""
    if not stamp:
        return False
    for key, value in want.items():
        if key == "extras":
            have = stamp.get("extras")
            if not isinstance(have, list) or not set(value) <= set(have):
                return False
        elif stamp.get(key) != value:
            return False
    return True


def write_stamp(venv: Path, stamp: dict) -> None:
    tmp = venv / (STAMP_NAME + ".tmp")
    tmp.write_text(json.dumps(stamp, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, venv / STAMP_NAME)


# --------------------------------------------------------------------------- running steps


def run_logged(cmd: list[str], log_path: Path, env: dict[str, str]) -> int:
    """Run ``cmd`` with its output appended to ``log_path``; return the exit status."""
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"\n$ {shlex.join(cmd)}\n")
        log.flush()
        start = time.monotonic()
        try:
            rc = subprocess.run(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                check=False, creationflags=_popen_flags,
            ).returncode
        except OSError as exc:
            log.write(f"could not start: {exc}\n")
            return 127
        log.write(f"[exit status {rc} after {time.monotonic() - start:.1f} s]\n")
        return rc


def log_tail(log_path: Path, lines: int = 15) -> str:
    try:
        text = log_path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join("    " + ln for ln in text.rstrip().splitlines()[-lines:])


def create_venv(venv: Path, clear: bool, log_path: Path) -> None:
    cmd = [sys.executable, "-m", "venv", *(["--clear"] if clear else []), str(venv)]
    proc = subprocess.run(
        cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, errors="replace", check=False, creationflags=_popen_flags,
    )
    venv.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"$ {shlex.join(cmd)}\n{proc.stdout}")
    if proc.returncode != 0:
        hint = ""
        if "ensurepip" in proc.stdout:
            hint = (
                " Your Python lacks the venv/ensurepip module; on Debian or Ubuntu install "
                "it with: sudo apt install python3-venv"
            )
        raise InstallError(f"could not create the virtual environment {venv}.{hint}", log_path)


def venv_is_usable(python: Path) -> bool:
    if not python.exists():
        return False
    code = f"import sys; sys.exit(0 if sys.version_info >= {MIN_PYTHON!r} else 1)"
    try:
        return subprocess.run([str(python), "-c", code], check=False,
                              creationflags=_popen_flags).returncode == 0
    except OSError:
        return False


def verify_torch(python: Path, log_path: Path, env: dict[str, str]) -> dict | None:
    """Import torch in the venv (a fresh process); its facts, or None if it fails."""
    with open(log_path, "a", encoding="utf-8") as log:
        log.write("\n$ (verify) python -c 'import torch ...'\n")
        log.flush()
        try:
            proc = subprocess.run(
                [str(python), "-c", _VERIFY_SNIPPET], stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=log, env=env, text=True, timeout=300,
                check=False, creationflags=_popen_flags,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.write(f"verify failed: {exc}\n")
            return None
        log.write(proc.stdout)
    if proc.returncode != 0:
        return None
    for line in reversed(proc.stdout.splitlines()):
        try:
            info = json.loads(line)
        except ValueError:
            continue
        if isinstance(info, dict):
            return info
    return None


class _VenvLock:
    """Exclusive lock on the venv folder so two bootstraps do not install at once."""

    def __init__(self, venv: Path):
        self.venv = venv
        self.fd: int | None = None

    def __enter__(self) -> _VenvLock:
        try:
            import fcntl
        except ImportError:  # Windows
            return self
        self.venv.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.venv, os.O_RDONLY)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.close(self.fd)


def warm_up_kernels(python: Path, log_path: Path, env: dict[str, str], runner=run_logged) -> int:
    """Compile the numba decode kernel once per install, so the first reply does not
    wait ~10 s for it (numba caches the machine code in the package folder)."""
    return runner([str(python), "-c", "from kernels.paged_attention import warm_up; warm_up()"], log_path, env)


def ensure_installed(
    checkout: Path,
    venv: Path,
    extras: list[str],
    *,
    env: dict[str, str] | None = None,
    reinstall: bool = False,
    runner=run_logged,
    make_venv=create_venv,
    detect_gpu=probe_nvidia,
    python_ok=venv_is_usable,
    lock=_VenvLock,
    compile_kernels=None,
    verify=verify_torch,
    dep_lock: Path | None = None,
    log_path: Path | None = None,
    torch_cli: str | None = None,
    torch_setting_value: str | None = None,
    _fallback_reason: str | None = None,
) -> bool:
    """Install Folio into ``venv`` unless the stamp says it is there; True if pip ran.

    ``dep_lock`` is the hash-pinned lock file to use when it applies to this
    machine and torch build (see ``lock_applies``); ``log_path`` defaults to
    ``<venv>/folio-install.log``.
    """
    compile_kernels = compile_kernels or (lambda python, log, env: warm_up_kernels(python, log, env, runner))
    env = dict(os.environ if env is None else env)
    python = venv_python(venv)
    log_path = log_path or venv / LOG_NAME

    stamp = None if reinstall else read_stamp(venv)
    if _fallback_reason:
        torch, why = "cpu", _fallback_reason
    else:
        torch, why = choose_torch(env, stamp, detect_gpu, torch_cli, torch_setting_value)
    use_lock = dep_lock if lock_applies(dep_lock, torch, env) else None
    want = wanted_stamp(checkout, venv, extras, torch, use_lock)
    if stamp_satisfies(stamp, want) and python.exists():
        return False

    with lock(venv):
        old = read_stamp(venv)  # another bootstrap may have finished meanwhile
        if not reinstall and stamp_satisfies(old, want) and python.exists():
            return False
        moved = bool(old) and old.get("venv") != str(venv)
        venv.mkdir(parents=True, exist_ok=True)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        if not _fallback_reason:
            log_path.write_text(f"Folio install log (python {sys.version.split()[0]}, "
                                f"{time.strftime('%Y-%m-%d %H:%M:%S')})\n", encoding="utf-8")
        with open(log_path, "a", encoding="utf-8") as log:
            log.write(f"{torch_label(torch)}: {why}\n")
        say(f"Using {torch_label(torch)}: {why}.")
        recreate = moved or not python_ok(python)
        previous = None if recreate else old
        (venv / STAMP_NAME).unlink(missing_ok=True)  # never trust a half-finished install
        try:
            ran = _install_steps(
                checkout, venv, extras, env, want, old, recreate, torch, use_lock, log_path,
                runner=runner, make_venv=make_venv, compile_kernels=compile_kernels,
                verify=verify,
            )
        except InstallError as exc:
            if exc.log_path is None:
                exc.log_path = log_path
            # pip changes nothing when resolving or downloading fails and rolls a
            # package back when installing it fails, so the previous install usually
            # still works: if it still imports, keep it (and its stamp) in use.
            if previous and verify(python, log_path, venv_environ(venv, env)) is not None:
                write_stamp(venv, previous)
                exc.kept_previous = True
            raise
        if isinstance(ran, _CudaUnusable):
            say(f"The CUDA build cannot use the GPU ({ran.reason}); switching to the CPU "
                "build ...")
            runner([str(python), "-m", "pip", "uninstall", "-y", "torch"], log_path,
                   pip_environ(venv, env))
            return ensure_installed(
                checkout, venv, extras, env=env, reinstall=True, runner=runner,
                make_venv=make_venv, detect_gpu=detect_gpu, python_ok=python_ok,
                lock=_NoLock, compile_kernels=compile_kernels, verify=verify,
                dep_lock=dep_lock, log_path=log_path,
                _fallback_reason=f"the CUDA build could not use the GPU: {ran.reason}",
            )
        return ran


class _NoLock:
    """Used for the CPU fallback, which runs while the caller already holds the lock."""

    def __init__(self, venv: Path):
        pass

    def __enter__(self) -> _NoLock:
        return self

    def __exit__(self, *exc) -> None:
        pass


@dataclass
class _CudaUnusable:
    reason: str


def _install_steps(checkout, venv, extras, env, want, old, recreate, torch, use_lock, log_path,
                   *, runner, make_venv, compile_kernels, verify):
    python = venv_python(venv)
    if recreate:
        # An old venv (moved checkout, broken or too old Python) is wiped first.
        clear = python.exists() or (venv / "pyvenv.cfg").exists()
        say(f"Creating the virtual environment {venv} ...")
        make_venv(venv, clear=clear, log_path=log_path)
        old = None

    pip_env = pip_environ(venv, env)
    pip = [str(python), "-m", "pip", "install"]

    if old and old.get("torch") in ("cpu", "cuda") and old["torch"] != torch:
        say(f"Switching PyTorch from the {old['torch']} to the {torch} build ...")
        runner([str(python), "-m", "pip", "uninstall", "-y", "torch"], log_path, pip_env)

    if use_lock is not None:
        say(f"Installing {torch_label(torch)} and Folio's pinned dependencies (hash-checked "
            f"from {use_lock.name}); this can take a few minutes (log: {log_path}) ...")
        attempts = lock_install_attempts(use_lock)
    else:
        say(f"Installing {torch_label(torch)}; this can take a few minutes "
            f"(log: {log_path}) ...")
        attempts = torch_install_attempts(torch)
    for n, args in enumerate(attempts, start=1):
        if runner(pip + args, log_path, pip_env) == 0:
            break
        if n < len(attempts):
            say("  not found there; trying the PyTorch CPU package index ...")
    else:
        what = f"{torch_label(torch)} and the locked dependencies" if use_lock else torch_label(torch)
        raise InstallError(f"could not install {what}", log_path)

    # Keep extras installed by earlier runs, so the stamp stays a superset.
    previous = (old.get("extras") or []) if old else []
    all_extras = sorted(set(extras) | set(previous))
    target = str(checkout) + (f"[{','.join(all_extras)}]" if all_extras else "")
    say(f"Installing Folio{' with extras ' + ','.join(all_extras) if all_extras else ''}"
        " and its dependencies ...")
    # With the lock in place every runtime dependency (and setuptools, the build
    # backend) is already installed and hash-checked: build without an isolated
    # environment (which would fetch setuptools unchecked) and, when no extras are
    # wanted, without letting pip touch the dependencies at all.
    flags = (["--no-build-isolation"] + ([] if all_extras else ["--no-deps"])) if use_lock else []
    if runner(pip + flags + ["-e", target], log_path, pip_env) != 0:
        raise InstallError(f"could not install Folio (pip install -e {target})", log_path)

    info = verify(python, log_path, pip_env)
    if info is None:
        raise InstallError(f"{torch_label(torch)} was installed but does not import", log_path)
    if torch == "cuda" and not info.get("cuda"):
        return _CudaUnusable(
            f"torch {info.get('version')} (CUDA {info.get('cuda_build')}) reports "
            "torch.cuda.is_available() == False"
        )

    say("Compiling Folio's CPU kernels ...")
    if compile_kernels(python, log_path, pip_env) != 0:
        raise InstallError("Folio installed, but its kernels failed to compile", log_path)

    write_stamp(venv, dict(want, extras=all_extras))
    say("Install complete.")
    return True


def ensure_default_model(checkout: Path, venv: Path, env: dict[str, str] | None = None,
                         run=subprocess.run, output=None) -> bool:
    """Run ``folio models fetch-default`` if the default model is missing; True if it ran.

    ``output``: a file for the fetch's messages (windowed mode has no console).
    """
    venv_env = venv_environ(venv, env)
    fetch_py = checkout / "engine" / "model" / "fetch.py"
    check = [str(venv_python(venv)), "-P", "-c", _CHECK_MODEL_SNIPPET, str(fetch_py)]
    extra = {"creationflags": _popen_flags} if _popen_flags else {}
    try:
        present = run(check, env=venv_env, stdin=subprocess.DEVNULL, check=False,
                      **extra).returncode == 0
    except OSError:
        present = False
    if present:
        return False
    say("Fetching the default model (SmolLM2-135M-Instruct, about 100 MB) ...")
    folio = shutil.which("folio", path=venv_env["PATH"]) or str(venv_bin(venv) / "folio")
    if output is not None:
        extra.update(stdout=output, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        rc = run([folio, "models", "fetch-default"], env=venv_env, check=False,
                 **extra).returncode
    except OSError as exc:
        raise InstallError(f"could not run {folio}: {exc}") from exc
    if rc != 0:
        raise InstallError(
            "could not fetch the default model (see the messages above); run the same "
            "command again to retry, or pass --no-fetch to skip this step"
        )
    return True


def exec_in_venv(venv: Path, argv: list[str], env: dict[str, str] | None = None) -> int:
    """Replace this process with ``argv`` run inside the venv (subprocess on Windows)."""
    venv_env = venv_environ(venv, env)
    exe = shutil.which(argv[0], path=venv_env["PATH"])
    if exe is None:
        say(f"command not found in the venv or on PATH: {argv[0]}")
        return 127
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    if os.name == "posix":
        os.execve(exe, argv, venv_env)
    return subprocess.call([exe, *argv[1:]], env=venv_env, creationflags=_popen_flags)


# --------------------------------------------------------------------------- desktop checks


# Libraries the Qt xcb platform plugin loads that desktop installs may lack, and the
# package that ships each: (Debian/Ubuntu, Fedora/RHEL/openSUSE, Arch).  Qt >= 6.5
# needs libxcb-cursor, which minimal and older desktops often do not have.
XCB_PACKAGES = {
    "libxcb-cursor.so.0": ("libxcb-cursor0", "xcb-util-cursor", "xcb-util-cursor"),
    "libxkbcommon-x11.so.0": ("libxkbcommon-x11-0", "libxkbcommon-x11", "libxkbcommon-x11"),
    "libxkbcommon.so.0": ("libxkbcommon0", "libxkbcommon", "libxkbcommon"),
    "libxcb-icccm.so.4": ("libxcb-icccm4", "xcb-util-wm", "xcb-util-wm"),
    "libxcb-image.so.0": ("libxcb-image0", "xcb-util-image", "xcb-util-image"),
    "libxcb-keysyms.so.1": ("libxcb-keysyms1", "xcb-util-keysyms", "xcb-util-keysyms"),
    "libxcb-render-util.so.0": ("libxcb-render-util0", "xcb-util-renderutil", "xcb-util-renderutil"),
    "libxcb-shape.so.0": ("libxcb-shape0", "libxcb", "libxcb"),
    "libxcb-xinerama.so.0": ("libxcb-xinerama0", "libxcb", "libxcb"),
    "libxcb-xkb.so.1": ("libxcb-xkb1", "libxcb", "libxcb"),
    "libxcb-randr.so.0": ("libxcb-randr0", "libxcb", "libxcb"),
    "libxcb-shm.so.0": ("libxcb-shm0", "libxcb", "libxcb"),
    "libxcb-sync.so.1": ("libxcb-sync1", "libxcb", "libxcb"),
    "libxcb-xfixes.so.0": ("libxcb-xfixes0", "libxcb", "libxcb"),
    "libxcb-render.so.0": ("libxcb-render0", "libxcb", "libxcb"),
    "libxcb-randr.so": ("libxcb-randr0", "libxcb", "libxcb"),
    "libX11-xcb.so.1": ("libx11-xcb1", "libX11-xcb", "libx11"),
    "libEGL.so.1": ("libegl1", "libglvnd-egl", "libglvnd"),
    "libGL.so.1": ("libgl1", "libglvnd-glx", "libglvnd"),
    "libOpenGL.so.0": ("libopengl0", "libglvnd-opengl", "libglvnd"),
    "libfontconfig.so.1": ("libfontconfig1", "fontconfig", "fontconfig"),
    "libdbus-1.so.3": ("libdbus-1-3", "dbus-libs", "dbus"),
}


def linux_distro_family(os_release: Path = Path("/etc/os-release")) -> str:
    """``debian``, ``fedora``, ``arch`` or ``""`` from /etc/os-release ID / ID_LIKE."""
    try:
        text = os_release.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    ids = " ".join(re.findall(r"^(?:ID|ID_LIKE)=\"?([^\"\n]*)", text, re.MULTILINE)).lower()
    for family, names in (("debian", ("debian", "ubuntu")), ("arch", ("arch",)),
                          ("fedora", ("fedora", "rhel", "suse", "centos"))):
        if any(n in ids for n in names):
            return family
    return ""


def xcb_plugin(venv: Path) -> Path | None:
    for site in sorted(venv.glob("lib*/python3*/site-packages")):
        plugin = site / "PySide6" / "Qt" / "plugins" / "platforms" / "libqxcb.so"
        if plugin.exists():
            return plugin
    return None


def missing_xcb_libraries(plugin: Path, run=subprocess.run) -> list[str]:
    """Shared libraries the xcb plugin needs that the dynamic loader cannot find."""
    try:
        proc = run(["ldd", str(plugin)], capture_output=True, text=True, timeout=20,
                   check=False, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return []  # no ldd: let Qt report it
    missing = []
    for line in (proc.stdout or "").splitlines():
        m = re.match(r"\s*(\S+)\s+=>\s+not found", line)
        if m and m.group(1) not in missing:
            missing.append(m.group(1))
    return missing


def xcb_advice(missing: list[str], family: str) -> str:
    column = {"debian": 0, "fedora": 1, "arch": 2}.get(family)
    pkgs = [XCB_PACKAGES.get(lib) for lib in missing]
    known = [p for p in pkgs if p]
    text = (f"Folio cannot open its window: Qt's X11 (xcb) platform plugin needs "
            f"{', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not installed.")
    if not known:
        return text + " Install the package that provides it with your package manager."
    def uniq(col: int) -> str:
        return " ".join(dict.fromkeys(p[col] for p in known))
    commands = {0: f"sudo apt install {uniq(0)}", 1: f"sudo dnf install {uniq(1)}",
                2: f"sudo pacman -S {uniq(2)}"}
    if column is not None:
        return text + f" Install it with:\n\n    {commands[column]}\n\nthen start Folio again."
    return text + (f" Install it with one of:\n\n    {commands[0]}   (Debian, Ubuntu)\n"
                   f"    {commands[1]}   (Fedora)\n    {commands[2]}   (Arch)\n\n"
                   "then start Folio again.")


def qt_may_use_xcb(env: dict[str, str]) -> tuple[bool, bool]:
    """(Qt may pick xcb, xcb is the only choice).  Qt uses QT_QPA_PLATFORM when set,
    else Wayland in a Wayland session (falling back to xcb), else xcb."""
    forced = env.get("QT_QPA_PLATFORM", "").strip().lower()
    if forced:
        return forced.startswith("xcb"), forced.startswith("xcb")
    if not env.get("DISPLAY"):
        return False, False
    return True, not env.get("WAYLAND_DISPLAY")


def show_error_dialog(title: str, text: str, env: dict[str, str] | None = None,
                      run=subprocess.run) -> str | None:
    """Show ``text`` in a dialog without Qt (which may be the thing that is broken);
    the tool used (zenity, kdialog, notify-send, MessageBox) or None."""
    env = os.environ if env is None else env
    if sys.platform == "win32":
        try:
            import ctypes

            ctypes.windll.user32.MessageBoxW(None, text, title, 0x10)  # MB_ICONERROR
            return "MessageBox"
        except (ImportError, AttributeError, OSError):
            return None
    if not (env.get("DISPLAY") or env.get("WAYLAND_DISPLAY")):
        return None
    search = env.get("PATH")
    for tool, args in (
        ("zenity", ["--error", "--title", title, "--no-markup", "--text", text]),
        ("kdialog", ["--title", title, "--error", text]),
        ("notify-send", ["--urgency=critical", "--app-name=Folio", title, text]),
    ):
        exe = shutil.which(tool, path=search)
        if exe is None:
            continue
        try:
            run([exe, *args], check=False, timeout=600, stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(env))
        except (OSError, subprocess.TimeoutExpired):
            continue
        return tool
    return None


def check_desktop(venv: Path, env: dict[str, str], run=subprocess.run,
                  family: str | None = None) -> str | None:
    """Before Qt starts: an error message when the app cannot open a window, else None.
    Missing xcb libraries in a Wayland session are only logged (Qt uses Wayland)."""
    if not sys.platform.startswith("linux"):
        return None
    may, only = qt_may_use_xcb(env)
    if not may:
        return None
    plugin = xcb_plugin(venv)
    if plugin is None:
        return None
    missing = missing_xcb_libraries(plugin, run)
    if not missing:
        return None
    advice = xcb_advice(missing, linux_distro_family() if family is None else family)
    if not only:
        say("Note (Wayland session, so Qt should not need X11): " + advice)
        return None
    return advice


# --------------------------------------------------------------------------- windowed mode


def redirect_output(log_path: Path) -> None:
    """Under pythonw sys.stdout/sys.stderr are None and the first print raises:
    send both (and faulthandler's crash dumps) to ``log_path`` instead."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        if log_path.stat().st_size > 2_000_000:  # keep the log from growing forever
            os.replace(log_path, log_path.with_suffix(".old.log"))
    except OSError:
        pass
    stream = open(log_path, "a", encoding="utf-8", errors="backslashreplace", buffering=1)  # noqa: SIM115
    stream.write(f"\n--- {time.strftime('%Y-%m-%d %H:%M:%S')} bootstrap {sys.argv[1:]!r}\n")
    sys.stdout = sys.stderr = stream
    try:
        import faulthandler

        faulthandler.enable(stream)
    except (ImportError, OSError, ValueError):
        pass


def launch_command(venv: Path, args: list[str], windowed: bool) -> list[str]:
    """The app through folio/platform_setup.py (`python -m folio`), which redirects output when there is
    no console and sets the Windows AppUserModelID before Qt starts."""
    return [str(venv_python(venv, windowed)), "-m", "folio", *args]


def launch_app(layout: Layout, args: list[str], windowed: bool,
               env: dict[str, str] | None = None) -> int:
    app_env = venv_environ(layout.venv, env)
    app_env["FOLIO_LOG_DIR"] = str(layout.logs)
    cmd = launch_command(layout.venv, args, windowed)
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    if os.name == "posix":
        if windowed and sys.stdout is not None and hasattr(sys.stdout, "fileno"):
            # Started from a menu: the app's output goes to the same log.
            os.dup2(sys.stdout.fileno(), 1)
            os.dup2(sys.stdout.fileno(), 2)
        os.execve(cmd[0], cmd, app_env)
    if windowed:
        subprocess.Popen(cmd, env=app_env, creationflags=_popen_flags, close_fds=True,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
        return 0
    return subprocess.call(cmd, env=app_env)


# --------------------------------------------------------------------------- main


def _report_failure(exc: InstallError, windowed: bool) -> None:
    say(f"ERROR: {exc}.")
    if exc.log_path is not None:
        tail = log_tail(exc.log_path)
        if tail:
            say("Last lines of the install log:\n" + tail)
        say(f"Full log: {exc.log_path}")
    if exc.kept_previous:
        say("The previous install still works and was kept.")
    if windowed:
        where = f"\n\nDetails are in the log:\n{exc.log_path}" if exc.log_path else ""
        kept = "\n\nThe previous version is kept and starts now." if exc.kept_previous else ""
        show_error_dialog("Folio could not be installed", f"{exc}.{where}{kept}")


def main(argv: list[str] | None = None) -> int:
    global _popen_flags
    argv = sys.argv[1:] if argv is None else argv
    try:
        opts = parse_args(argv)
    except UsageError as exc:
        say(f"bootstrap.py: error: {exc}\n(see: python3 installer/bootstrap.py --help)")
        return 2
    windowed = opts.windowed or sys.stdout is None or sys.stderr is None
    if opts.help:
        if sys.stdout is not None:
            print(__doc__)
        return 0
    if sys.version_info < MIN_PYTHON:
        newer = find_python()
        if newer and os.path.realpath(newer) != os.path.realpath(sys.executable):
            return subprocess.call([newer, str(Path(__file__).resolve()), *argv])
        msg = (f"Folio needs Python {'.'.join(map(str, MIN_PYTHON))} or newer; this is "
               f"{sys.version.split()[0]} ({sys.executable}) and no newer one was found. "
               "Install Python 3.11 or newer (python.org, or your package manager).")
        say(msg)
        if windowed:
            show_error_dialog("Folio needs Python 3.11", msg)
        return 1

    try:
        layout = choose_layout(opts.layout)
    except UsageError as exc:
        say(f"bootstrap.py: error: {exc}")
        return 2
    if windowed:
        redirect_output(layout.logs / "launcher.log")
        if os.name == "nt":
            _popen_flags = _CREATE_NO_WINDOW

    kept_previous = False
    try:
        ensure_installed(
            layout.app, layout.venv, opts.extras, reinstall=opts.reinstall,
            dep_lock=LOCK_FILE, log_path=layout.install_log, torch_cli=opts.torch,
            torch_setting_value=torch_setting(),
        )
    except UsageError as exc:
        say(f"bootstrap.py: error: {exc}")
        return 2
    except InstallError as exc:
        _report_failure(exc, windowed)
        if not (opts.launch and exc.kept_previous):
            return 1
        kept_previous = True
    try:
        if opts.command is None and opts.fetch and not kept_previous:
            ensure_default_model(layout.app, layout.venv,
                                 output=sys.stdout if windowed else None)
    except InstallError as exc:
        _report_failure(exc, windowed)
        return 1

    if opts.command is not None:
        return exec_in_venv(layout.venv, opts.command)
    if opts.launch:
        problem = check_desktop(layout.venv, dict(os.environ))
        if problem:
            say(problem)
            show_error_dialog("Folio cannot open its window", problem)
            return 3
        return launch_app(layout, opts.folio_args, windowed)
    if opts.folio_args:
        return exec_in_venv(layout.venv, [str(venv_bin(layout.venv) / "folio"), *opts.folio_args])
    say(f"Folio is ready. Try: python3 {Path(__file__).name} generate \"Hello\" "
        f"(or run {venv_bin(layout.venv) / 'folio'} directly)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
