"""Test-wide settings.

The calibration of checkpointing's own costs (``planner.api._calibrate_checkpoint_overheads``) times checkpointed
steps against eager until every median is known within 0.5% of a step, up to 32 rounds a profile repeat: 97% of
posing a test-size model (GPT-2: 13.7 of 14.1 s). No test holds a plan's predicted time to a measurement (the
benchmarks do: ``benchmarks/fidelity.py``), so the tests calibrate with 3 to 8 rounds, 10 s a group: the same
code, less precise. A test whose plan must not move with those times asks for ``full_calibration``.
"""

import pytest

import planner.api

FULL = {"CALIBRATION_ROUNDS": planner.api.CALIBRATION_ROUNDS, "CALIBRATION_SECONDS": planner.api.CALIBRATION_SECONDS,
        "CALIBRATION_MIN_ROUNDS": planner.api.CALIBRATION_MIN_ROUNDS}


@pytest.fixture(autouse=True, scope="session")
def _short_calibration():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(planner.api, "CALIBRATION_ROUNDS", 8)
        patch.setattr(planner.api, "CALIBRATION_SECONDS", 10.0)
        patch.setattr(planner.api, "CALIBRATION_MIN_ROUNDS", 3)
        yield


@pytest.fixture
def full_calibration(monkeypatch):
    """The calibration as users run it (the autocast test's plan, timed in 8 rounds, was one of 4 runs a plan
    predicted 7% over its measured peak)."""
    for name, value in FULL.items():
        monkeypatch.setattr(planner.api, name, value)
