"""engine.device: the device a user chooses, checked and resolved with one-line errors, and
`--device` on the command line. The machine's own GPU does not matter: torch's answers are
replaced with each case's."""

from __future__ import annotations

import pytest
import torch

from engine.device import DeviceChoice, DeviceError, parse_device, resolve_device, resolve_or_cpu
from folio.main import main
from tests.engine.tiny_models import write_chat_model


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


@pytest.mark.parametrize(
    "text, choice",
    [
        ("auto", DeviceChoice("auto")),
        ("CPU", DeviceChoice("cpu")),
        (" cuda ", DeviceChoice("cuda")),
        ("cuda:1", DeviceChoice("cuda", 1)),
    ],
)
def test_parse(text, choice):
    assert parse_device(text) == choice
    assert parse_device(str(choice)) == choice


@pytest.mark.parametrize("text", ["gpu", "cuda:", "cuda:-1", "cpu:0", "auto:1", "mps", ""])
def test_parse_refuses_what_is_not_a_choice(text):
    with pytest.raises(DeviceError, match="is not one of auto, cpu, cuda or cuda:N"):
        parse_device(text)


def test_without_a_gpu(no_gpu, monkeypatch):
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(DeviceError) as caught:
        resolve_device("cuda")
    message = str(caught.value)
    assert message.startswith("--device cuda: no CUDA GPU is available")
    assert "is a CPU build" in message and "\n" not in message
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    with pytest.raises(DeviceError, match=r"CUDA 12\.4\) finds no GPU, no NVIDIA driver"):
        resolve_device("cuda:0")


def test_with_two_gpus(two_gpus):
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(
        DeviceError, match=r"cuda:2: this machine has 2 CUDA GPUs \(cuda:0 to cuda:1\)"
    ):
        resolve_device("cuda:2")


def test_the_app_falls_back_to_the_cpu_with_a_note(no_gpu):
    device, note = resolve_or_cpu("cuda")
    assert device == torch.device("cpu")
    assert note.startswith("device cuda: no CUDA GPU is available") and note.endswith(
        "running on the CPU"
    )
    assert resolve_or_cpu("cpu") == (torch.device("cpu"), None)
    assert resolve_or_cpu("auto") == (torch.device("cpu"), None)
    device, note = resolve_or_cpu("tpu")  # a hand-edited settings file
    assert device == torch.device("cpu") and "'tpu' is not one of" in note


def test_app_keeps_a_gpu_that_is_there(two_gpus):
    assert resolve_or_cpu("cuda:1") == (torch.device("cuda", 1), None)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return write_chat_model(tmp_path_factory.mktemp("chat") / "tiny")


def test_cli_refuses_a_missing_gpu_in_one_line_before_reading_the_model(no_gpu, tmp_path, capsys):
    """The model path does not exist: the device is what is reported, before the model."""
    code = main(["generate", "hi", "--device", "cuda", "--model", str(tmp_path / "none.gguf")])
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith("folio: --device cuda: no CUDA GPU is available")
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "hi"],
        ["chat"],
        ["serve"],
        ["bench", "forward"],
        ["bench", "batched"],
    ],
)
def test_every_model_command_takes_device(argv, capsys):
    with pytest.raises(SystemExit) as caught:
        main([*argv, "--device", "tpu"])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert "argument --device: device 'tpu' is not one of auto, cpu, cuda or cuda:N" in err
    assert err.count("\n") == 1


def test_generate_on_the_cpu(chat_model, capsys):
    assert (
        main(
            [
                "generate",
                "hi",
                "--model",
                str(chat_model),
                "--device",
                "cpu",
                "--max-new-tokens",
                "3",
                "--temperature",
                "0",
                "--json",
            ]
        )
        == 0
    )
    assert '"new_tokens": 3' in capsys.readouterr().out


def test_device_memory_in_words():
    from engine.device import DeviceMemory, device_memory
    from engine.units import format_bytes

    assert device_memory("cpu") is None
    mib = 1 << 20
    vram = DeviceMemory(
        total=80_000 * mib, free=60_000 * mib, allocated=900 * mib, reserved=1_200 * mib
    )
    text = vram.describe(weights=700 * mib, kv=150 * mib)

    def size(n):
        return format_bytes(n, binary=True)

    # other: allocated less weights and KV; the reserve: reserved less allocated
    assert text == (
        f"VRAM: weights {size(700 * mib)} · KV {size(150 * mib)} · other {size(50 * mib)}"
        f" · allocator reserve {size(300 * mib)} · free {size(60_000 * mib)} of {size(80_000 * mib)}"
    )
    assert vram.describe(weights=900 * mib, kv=100 * mib).count(f"other {size(0)}") == 1
