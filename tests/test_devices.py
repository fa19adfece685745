import dataclasses

import pytest

from planner.devices import DEVICES, DeviceSpec, Precision, device_spec
from planner.errors import PlannerError


def test_registry_holds_the_published_dense_figures():
    assert sorted(DEVICES) == ["a100", "h100", "h200", "l4", "rtx4090"]
    h100, h200, a100 = DEVICES["h100"], DEVICES["h200"], DEVICES["a100"]
    assert h100.peak_flops(Precision.HALF) == pytest.approx(989.4e12)  # dense, not the 2:4-sparse 1979
    assert h200.peak_flops(Precision.HALF) == h100.peak_flops(Precision.HALF)  # same chip, more and faster memory
    assert h200.memory_bandwidth > h100.memory_bandwidth > a100.memory_bandwidth
    assert h200.memory_bytes > h100.memory_bytes and 80e9 < h100.memory_bytes < 80 * 2**30
    for spec in DEVICES.values():
        assert spec.half_flops >= spec.tf32_flops >= spec.fp32_flops > 0
        assert 0 < spec.launch_seconds < 1e-4 and spec.description


def test_roofline_is_the_slower_of_compute_and_memory_plus_launch():
    spec = DeviceSpec("toy", fp32_flops=1e12, tf32_flops=2e12, half_flops=4e12, memory_bandwidth=1e11,
                      memory_bytes=2**30, launch_seconds=1e-6)
    assert spec.op_seconds(1e12, 0) == pytest.approx(1.0 + 1e-6)  # compute bound
    assert spec.op_seconds(1e12, 0, Precision.HALF) == pytest.approx(0.25 + 1e-6)
    assert spec.op_seconds(1e9, 1e11) == pytest.approx(1.0 + 1e-6)  # memory bound
    assert spec.op_seconds(0, 0) == spec.launch_seconds
    faster = dataclasses.replace(spec, memory_bandwidth=2e11)
    assert faster.op_seconds(1e9, 1e11) < spec.op_seconds(1e9, 1e11)


def test_lookup_is_forgiving_about_spelling_and_names_the_known_devices():
    assert device_spec("RTX-4090") is DEVICES["rtx4090"] and device_spec(" H200 ") is DEVICES["h200"]
    custom = DeviceSpec("mine", 1e12, 1e12, 1e12, 1e11, 2**30)
    assert device_spec(custom) is custom
    with pytest.raises(PlannerError, match=r"unknown device 'v100'.*a100, h100, h200, l4, rtx4090.*DeviceSpec"):
        device_spec("v100")


def test_specs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEVICES["h100"].memory_bytes = 1
