"""Parsing of device specifications and the split of cores."""

import pytest

from multigpu.devices import Device, assign_cores, parse_devices


def test_gpu_spellings():
    got = parse_devices([0, "cuda:1", "gpu:2"], num_gpus=3)
    assert [d.spec for d in got] == ["cuda:0", "cuda:1", "cuda:2"]


def test_cpu_spellings_and_speed():
    got = parse_devices(["cpu:0", "cpu:1@0.5"], num_gpus=0)
    assert got == [Device("cpu", 0), Device("cpu", 1, 0.5)]
    assert got[1].spec == "cpu:1@0.5"


def test_comma_string():
    assert [d.spec for d in parse_devices("cpu:0,cpu:1", num_gpus=0)] == ["cpu:0", "cpu:1"]


def test_auto_without_gpu_picks_cpu_devices(monkeypatch):
    monkeypatch.setattr("multigpu.devices.usable_cores", lambda: [0, 1])
    assert [d.spec for d in parse_devices("auto", num_gpus=0)] == ["cpu:0", "cpu:1"]
    assert [d.spec for d in parse_devices(None, num_gpus=2)] == ["cuda:0", "cuda:1"]


@pytest.mark.parametrize(
    ("devices", "message"),
    [
        ([0], "no GPU: use CPU devices"),
        (["cuda:3"], "does not exist"),
        (["tpu:0"], "Unknown device"),
        (["cpu:0", "cpu:0"], "listed twice"),
        (["cpu:1@0"], "speed factor"),
        (["cpu:1@1.5"], "speed factor"),
        (["cpu:1@nan"], "speed factor"),
        ([], "at least one device"),
        ([1.5], "GPU index"),
    ],
)
def test_bad_devices_say_what_was_received(devices, message):
    with pytest.raises(ValueError, match=message):
        parse_devices(devices, num_gpus=0)


def test_gpu_index_on_gpu_machine_lists_visible():
    with pytest.raises(ValueError, match="Visible GPUs: cuda:0, cuda:1"):
        parse_devices(["cuda:2"], num_gpus=2)


def test_cores_are_split_in_blocks():
    devs = assign_cores(parse_devices(["cpu:0", "cpu:1"], num_gpus=0), cores=[0, 1, 2, 3])
    assert [d.cores for d in devs] == [(0, 1), (2, 3)]


def test_more_cpu_devices_than_cores_share_with_a_warning():
    with pytest.warns(UserWarning, match="share 2 cores"):
        devs = assign_cores(parse_devices(["cpu:0", "cpu:1", "cpu:2"], num_gpus=0), cores=[0, 1])
    assert [d.cores for d in devs] == [(0,), (1,), (0,)]


def test_gpus_for_jax_come_from_the_driver_narrowed_by_cuda_visible_devices(tmp_path, monkeypatch):
    """On JAX the GPU count cannot come from JAX before a rank joins: the driver's list, as CUDA narrows it."""
    from multigpu.devices import driver_gpu_count

    for bus in ("0000:01:00.0", "0000:02:00.0", "0000:03:00.0"):
        (tmp_path / bus).mkdir()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert driver_gpu_count(str(tmp_path)) == 3
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    assert driver_gpu_count(str(tmp_path)) == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,7,0")  # CUDA stops at the first device it cannot use
    assert driver_gpu_count(str(tmp_path)) == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert driver_gpu_count(str(tmp_path)) == 0
    assert driver_gpu_count(str(tmp_path / "missing")) == 0


def test_a_gpu_device_on_a_jax_without_gpus_fails_naming_the_version():
    from multigpu.backend.jax.group import check_platform

    check_platform(Device("cuda", 0), "gpu", "0.10.2")
    check_platform(Device("cpu", 1), "cpu", "0.10.2")
    with pytest.raises(RuntimeError, match=r"'cuda:1' is a GPU, but jax 0.10.2 found no GPU.*jax\[cuda12\]"):
        check_platform(Device("cuda", 1), "cpu", "0.10.2")


def test_gpus_the_driver_lists_but_the_backend_cannot_use_are_named_not_passed_over(monkeypatch):
    """A CPU build of torch on a machine whose driver lists GPUs: ``auto`` says why it takes CPU devices, and
    asking for a GPU says the same instead of "no GPU"."""
    from multigpu import devices

    monkeypatch.setattr(devices, "driver_gpu_count", lambda root="": 2)
    with pytest.warns(UserWarning, match=r"driver lists 2 GPU\(s\), but Keras's torch backend cannot use them"):
        found = devices.parse_devices("auto", num_gpus=0)
    assert all(d.kind == "cpu" for d in found)
    with pytest.raises(ValueError, match=r"Device 0 does not exist\. The NVIDIA driver lists 2 GPU\(s\).*CUDA build"):
        devices.parse_devices([0], num_gpus=0)
    monkeypatch.setattr(devices, "driver_gpu_count", lambda root="": 0)
    with pytest.raises(ValueError, match="This machine has no GPU"):
        devices.parse_devices([0], num_gpus=0)


def test_multigpu_devices_says_why_listed_gpus_are_not_usable(monkeypatch, capsys):
    import argparse

    from multigpu import devices
    from multigpu.cli import devices as devices_cmd

    monkeypatch.setattr(devices, "driver_gpu_count", lambda root="": 1)
    assert devices_cmd.run(argparse.Namespace(json=False)) == 0
    out = capsys.readouterr().out
    assert out.startswith("GPUs not usable: The NVIDIA driver lists 1 GPU(s), but Keras's torch backend"), out
    assert "No GPU found" not in out
