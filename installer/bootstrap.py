#!/usr/bin/env python3
"""Folio bootstrap: make a working Folio install in ``<checkout>/.venv`` and run it.

Uses only the standard library, so any Python 3.11+ can run it straight from a
fresh checkout (the later double-click launchers call it too).

Usage::

    python3 installer/bootstrap.py [OPTIONS] [FOLIO_ARGS ...]
    python3 installer/bootstrap.py [OPTIONS] -- COMMAND [ARGS ...]

The first form runs ``.venv/bin/folio FOLIO_ARGS`` (with no FOLIO_ARGS it only
installs and fetches, then says so).  The second form runs an arbitrary COMMAND
with the venv activated (``.venv/bin`` first on PATH, VIRTUAL_ENV set), e.g.::

    python3 installer/bootstrap.py generate "Write a haiku about memory"
    python3 installer/bootstrap.py --extras test -- python -m pytest

Options (only before FOLIO_ARGS or ``--``)::

    --extras LIST   install optional dependency groups too (comma separated,
                    repeatable), e.g. ``--extras test``
    --no-fetch      do not fetch the default model before running folio
    --reinstall     ignore the install stamp and run every install step again
    -h, --help      show this text

Steps, each skipped when already done:

1. create ``.venv`` with the Python running this script;
2. install PyTorch 2.13.0: the CUDA build (plain ``torch==2.13.0`` from PyPI)
   when ``nvidia-smi -L`` lists a GPU within 5 s, otherwise the CPU build
   (``torch==2.13.0+cpu`` from pip's configured indexes, retried with
   ``--extra-index-url https://download.pytorch.org/whl/cpu`` if that fails; on
   macOS and Windows PyPI's ``torch==2.13.0`` is already the CPU build).
   ``FOLIO_TORCH=cpu|cuda`` overrides detection; ``FOLIO_TORCH=auto`` (or unset)
   detects once and then keeps what the install stamp records;
3. ``pip install -e <checkout>[EXTRAS]``;
4. write ``.venv/folio-install.json`` (hash of pyproject.toml, torch build,
   extras).  When it matches, steps 1-3 are skipped entirely and no pip runs;
5. folio form only, unless ``--no-fetch``: if the default model is not yet in
   the models folder, run ``folio models fetch-default``.

pip's output goes to ``.venv/folio-install.log``; when a step fails the script
prints the end of that log and its path and exits with status 1.  Usage errors
exit with 2; otherwise the exit status is that of folio / COMMAND.
"""

from __future__ import annotations

import hashlib
import json
import os
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
NVIDIA_SMI_TIMEOUT_S = 5.0
STAMP_NAME = "folio-install.json"
LOG_NAME = "folio-install.log"
RECIPE = 1  # bump when the install steps change so that existing venvs redo them
MIN_PYTHON = (3, 11)

CHECKOUT = Path(__file__).resolve().parent.parent

# Loads engine/model/fetch.py by path (not via ``import engine``, whose package
# may import torch) and asks whether the default model is present and verified.
_CHECK_MODEL_SNIPPET = (
    "import importlib.util, sys\n"
    "spec = importlib.util.spec_from_file_location('_folio_fetch_check', sys.argv[1])\n"
    "mod = importlib.util.module_from_spec(spec)\n"
    "sys.modules[spec.name] = mod\n"
    "spec.loader.exec_module(mod)\n"
    "sys.exit(0 if mod.is_fetched() else 1)\n"
)


class UsageError(Exception):
    pass


class InstallError(Exception):
    def __init__(self, message: str, log_path: Path | None = None):
        super().__init__(message)
        self.log_path = log_path


def say(msg: str) -> None:
    print(f"[folio] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- CLI


@dataclass
class Options:
    extras: list[str] = field(default_factory=list)
    fetch: bool = True
    reinstall: bool = False
    help: bool = False
    folio_args: list[str] = field(default_factory=list)
    command: list[str] | None = None


_EXTRA_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?$")


def _add_extras(opts: Options, value: str) -> None:
    for name in (v.strip() for v in value.split(",")):
        if not name:
            continue
        if not _EXTRA_RE.match(name):
            raise UsageError(f"invalid extra name {name!r}")
        if name not in opts.extras:
            opts.extras.append(name)


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
        elif arg == "--extras":
            if i + 1 >= len(argv):
                raise UsageError("--extras needs a value, e.g. --extras test")
            i += 1
            _add_extras(opts, argv[i])
        elif arg.startswith("--extras="):
            _add_extras(opts, arg.split("=", 1)[1])
        elif arg == "--no-fetch":
            opts.fetch = False
        elif arg == "--reinstall":
            opts.reinstall = True
        elif arg.startswith("-"):
            raise UsageError(
                f"unknown option {arg}; to pass it to folio write: -- folio {arg}"
            )
        else:
            opts.folio_args = argv[i:]
            return opts
        i += 1
    return opts


# --------------------------------------------------------------------------- venv paths


def venv_bin(venv: Path) -> Path:
    return venv / ("Scripts" if os.name == "nt" else "bin")


def venv_python(venv: Path) -> Path:
    return venv_bin(venv) / ("python.exe" if os.name == "nt" else "python")


def venv_environ(venv: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env["VIRTUAL_ENV"] = str(venv)
    env["PATH"] = str(venv_bin(venv)) + os.pathsep + env.get("PATH", "")
    env.pop("PYTHONHOME", None)
    env.pop("__PYVENV_LAUNCHER__", None)
    return env


# --------------------------------------------------------------------------- torch choice


def detect_nvidia_gpu(timeout: float = NVIDIA_SMI_TIMEOUT_S) -> bool:
    """True if ``nvidia-smi -L`` lists a GPU within ``timeout`` seconds.

    A missing, failing or hanging nvidia-smi means no usable GPU.  The probe runs
    in its own process group which is killed on timeout, and its output goes to
    a temporary file, so a hung driver cannot block the bootstrap.
    """
    if sys.platform == "darwin":
        return False
    exe = shutil.which("nvidia-smi")
    if not exe:
        return False
    with tempfile.TemporaryFile() as out:
        try:
            proc = subprocess.Popen(
                [exe, "-L"], stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.DEVNULL,
                start_new_session=(os.name == "posix"),
            )
        except OSError:
            return False
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
            return False
        out.seek(0)
        text = out.read().decode("utf-8", "replace")
    return rc == 0 and re.search(r"^GPU \d+", text, re.MULTILINE) is not None


def torch_choice(env: dict[str, str], stamp: dict | None, detect=detect_nvidia_gpu) -> str:
    """``"cpu"`` or ``"cuda"``: FOLIO_TORCH, else the stamp's earlier choice, else detect."""
    value = env.get("FOLIO_TORCH", "").strip().lower() or "auto"
    if value not in ("auto", "cpu", "cuda"):
        raise UsageError(f"FOLIO_TORCH must be cpu, cuda or auto, not {value!r}")
    if value != "auto":
        return value
    if stamp and stamp.get("torch") in ("cpu", "cuda"):
        return stamp["torch"]
    return "cuda" if detect() else "cpu"


def torch_install_attempts(variant: str, platform: str = sys.platform) -> list[list[str]]:
    """pip install arguments to try in order until one succeeds."""
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


# --------------------------------------------------------------------------- stamp


def pyproject_sha256(checkout: Path) -> str:
    try:
        return hashlib.sha256((checkout / "pyproject.toml").read_bytes()).hexdigest()
    except OSError as exc:
        raise InstallError(f"cannot read {checkout / 'pyproject.toml'}: {exc}") from exc


def read_stamp(venv: Path) -> dict | None:
    try:
        data = json.loads((venv / STAMP_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def wanted_stamp(checkout: Path, venv: Path, extras: list[str], torch: str) -> dict:
    return {
        "recipe": RECIPE,
        "pyproject_sha256": pyproject_sha256(checkout),
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
                check=False,
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
        text=True, errors="replace", check=False,
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
        return subprocess.run([str(python), "-c", code], check=False).returncode == 0
    except OSError:
        return False


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
    detect_gpu=detect_nvidia_gpu,
    python_ok=venv_is_usable,
    lock=_VenvLock,
    compile_kernels=None,
) -> bool:
    """Install Folio into ``venv`` unless the stamp says it is there; True if pip ran."""
    compile_kernels = compile_kernels or (lambda python, log, env: warm_up_kernels(python, log, env, runner))
    env = dict(os.environ if env is None else env)
    python = venv_python(venv)

    stamp = None if reinstall else read_stamp(venv)
    want = wanted_stamp(checkout, venv, extras, torch_choice(env, stamp, detect_gpu))
    if stamp_satisfies(stamp, want) and python.exists():
        return False

    with lock(venv):
        old = read_stamp(venv)  # another bootstrap may have finished meanwhile
        if not reinstall and stamp_satisfies(old, want) and python.exists():
            return False
        log_path = venv / LOG_NAME
        moved = bool(old) and old.get("venv") != str(venv)
        venv.mkdir(parents=True, exist_ok=True)
        log_path.write_text(f"Folio install log (python {sys.version.split()[0]})\n",
                            encoding="utf-8")
        if moved or not python_ok(python):
            # An old venv (moved checkout, broken or too old Python) is wiped first.
            clear = moved or python.exists() or (venv / "pyvenv.cfg").exists()
            say(f"Creating the virtual environment {venv} ...")
            make_venv(venv, clear=clear, log_path=log_path)
            old = None
        (venv / STAMP_NAME).unlink(missing_ok=True)  # never trust a half-finished install

        pip_env = venv_environ(venv, env)
        pip_env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1", PIP_USER="0")
        pip = [str(python), "-m", "pip", "install"]

        torch = want["torch"]
        if old and old.get("torch") in ("cpu", "cuda") and old["torch"] != torch:
            say(f"Switching PyTorch from the {old['torch']} to the {torch} build ...")
            runner([str(python), "-m", "pip", "uninstall", "-y", "torch"], log_path, pip_env)

        say(f"Installing {torch_label(torch)}; this can take a few minutes "
            f"(log: {log_path}) ...")
        attempts = torch_install_attempts(torch)
        for n, args in enumerate(attempts, start=1):
            if runner(pip + args, log_path, pip_env) == 0:
                break
            if n < len(attempts):
                say("  not found there; trying the PyTorch CPU package index ...")
        else:
            raise InstallError(f"could not install {torch_label(torch)}", log_path)

        # Keep extras installed by earlier runs, so the stamp stays a superset.
        previous = (old.get("extras") or []) if old else []
        all_extras = sorted(set(extras) | set(previous))
        target = str(checkout) + (f"[{','.join(all_extras)}]" if all_extras else "")
        say(f"Installing Folio{' with extras ' + ','.join(all_extras) if all_extras else ''}"
            " and its dependencies ...")
        if runner(pip + ["-e", target], log_path, pip_env) != 0:
            raise InstallError(f"could not install Folio (pip install -e {target})", log_path)

        say("Compiling Folio's CPU kernels ...")
        if compile_kernels(python, log_path, pip_env) != 0:
            raise InstallError("Folio installed, but its kernels failed to compile", log_path)

        write_stamp(venv, dict(want, extras=all_extras))
        say("Install complete.")
        return True


def ensure_default_model(checkout: Path, venv: Path, env: dict[str, str] | None = None,
                         run=subprocess.run) -> bool:
    """Run ``folio models fetch-default`` if the default model is missing; True if it ran."""
    venv_env = venv_environ(venv, env)
    fetch_py = checkout / "engine" / "model" / "fetch.py"
    check = [str(venv_python(venv)), "-P", "-c", _CHECK_MODEL_SNIPPET, str(fetch_py)]
    try:
        present = run(check, env=venv_env, stdin=subprocess.DEVNULL, check=False).returncode == 0
    except OSError:
        present = False
    if present:
        return False
    say("Fetching the default model (SmolLM2-135M-Instruct, about 100 MB) ...")
    folio = shutil.which("folio", path=venv_env["PATH"]) or str(venv_bin(venv) / "folio")
    try:
        rc = run([folio, "models", "fetch-default"], env=venv_env, check=False).returncode
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
    sys.stdout.flush()
    sys.stderr.flush()
    if os.name == "posix":
        os.execve(exe, argv, venv_env)
    return subprocess.call([exe, *argv[1:]], env=venv_env)


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    try:
        opts = parse_args(sys.argv[1:] if argv is None else argv)
    except UsageError as exc:
        print(f"bootstrap.py: error: {exc}\n(see: python3 installer/bootstrap.py --help)",
              file=sys.stderr)
        return 2
    if opts.help:
        print(__doc__)
        return 0
    if sys.version_info < MIN_PYTHON:
        say(f"Folio needs Python {'.'.join(map(str, MIN_PYTHON))} or newer; this is "
            f"{sys.version.split()[0]} ({sys.executable}). Run the bootstrap with a newer "
            f"python3.")
        return 1

    venv = CHECKOUT / ".venv"
    try:
        ensure_installed(CHECKOUT, venv, opts.extras, reinstall=opts.reinstall)
        if opts.command is None and opts.fetch:
            ensure_default_model(CHECKOUT, venv)
    except UsageError as exc:
        print(f"bootstrap.py: error: {exc}", file=sys.stderr)
        return 2
    except InstallError as exc:
        say(f"ERROR: {exc}.")
        if exc.log_path is not None:
            tail = log_tail(exc.log_path)
            if tail:
                say("Last lines of the install log:\n" + tail)
            say(f"Full log: {exc.log_path}")
        return 1

    if opts.command is not None:
        return exec_in_venv(venv, opts.command)
    if opts.folio_args:
        return exec_in_venv(venv, [str(venv_bin(venv) / "folio"), *opts.folio_args])
    say(f"Folio is ready. Try: python3 {Path(__file__).name} generate \"Hello\" "
        f"(or run {venv_bin(venv) / 'folio'} directly)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
