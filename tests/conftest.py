"""Test-wide settings.

The calibration of checkpointing's own costs (``planner.api._calibrate_checkpoint_overheads``) times checkpointed
steps against eager until every median is known within 0.5% of a step, up to 32 rounds a profile repeat: 97% of
posing a test-size model (GPT-2: 13.7 of 14.1 s). No test holds a plan's predicted time to a measurement (the
benchmarks do: ``benchmarks/fidelity.py``), so the tests calibrate with at most 8 rounds, 10 s a group: the same
code, less precise.
"""

import pytest

import planner.api


@pytest.fixture(autouse=True, scope="session")
def _short_calibration():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(planner.api, "CALIBRATION_ROUNDS", 8)
        patch.setattr(planner.api, "CALIBRATION_SECONDS", 10.0)
        yield
