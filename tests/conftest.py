"""Test-wide settings.

The calibration of checkpointing's own costs (``planner.api._calibrate_checkpoint_overheads``) times checkpointed
steps against eager until every median is known within 0.5% of a step, up to 32 rounds a profile repeat: 97% of
posing a test-size model (GPT-2: 13.7 of 14.1 s). No test holds a plan's predicted time to a measurement (the
benchmarks do: ``benchmarks/fidelity.py``), so the tests calibrate with 3 rounds a profile repeat, 2 s a group (at
least 3 rounds): the same code, less precise. Their subprocesses (the CLI, notebooks, distributed ranks) plan with
``PLANNER_CALIBRATION_SECONDS=1``. A test whose plan must not move with those times asks for ``full_calibration``.

The suite runs on every core (``-n auto --dist loadfile`` in ``pyproject.toml``), each worker on one torch thread:
on a 2-core machine 7.0 min, against 13.8-14.5 min in one process.
"""

import os

import pytest
import torch

import planner.api

FULL = {"CALIBRATION_ROUNDS": planner.api.CALIBRATION_ROUNDS, "CALIBRATION_SECONDS": planner.api.CALIBRATION_SECONDS,
        "CALIBRATION_MIN_ROUNDS": planner.api.CALIBRATION_MIN_ROUNDS}


def pytest_configure(config):
    """Under ``pytest -n N`` (pytest-xdist) each worker, and what it starts, runs torch on one thread: N workers of
    the machine's thread count each made every test several times slower on a 2-core machine."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="session")
def _short_calibration():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(planner.api, "CALIBRATION_ROUNDS", 3)
        patch.setattr(planner.api, "CALIBRATION_SECONDS", 2.0)
        patch.setattr(planner.api, "CALIBRATION_MIN_ROUNDS", 3)
        patch.setitem(os.environ, planner.api.CALIBRATION_SECONDS_VARIABLE, "1")
        yield


@pytest.fixture
def full_calibration(monkeypatch):
    """The calibration as users run it (the autocast test's plan, timed in 8 rounds, was one of 4 runs a plan
    predicted 7% over its measured peak)."""
    for name, value in FULL.items():
        monkeypatch.setattr(planner.api, name, value)


@pytest.fixture(autouse=True)
def _fresh_poses():
    """Each test plans from its own measurements (``planner.api.remembered_pose`` keeps them within a test)."""
    planner.api.forget_poses()
    yield
    planner.api.forget_poses()


@pytest.fixture()
def fallback_random():
    """Compiled dropout draws what eager dropout draws (``torch._inductor.config.fallback_random``); compiled code
    is forgotten afterwards."""
    import torch._inductor.config as inductor_config
    previous = inductor_config.fallback_random
    inductor_config.fallback_random = True
    yield
    inductor_config.fallback_random = previous
    torch._dynamo.reset()
