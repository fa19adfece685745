"""Checks of the example models in ``examples/`` at size "test"."""

from __future__ import annotations

import dataclasses
import math
import os
import sys

import pytest
import torch

try:
    import examples  # noqa: F401
except ImportError:  # plain `pytest` does not put the repository root on sys.path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from examples.common import (  # noqa: E402
    EXAMPLES,
    Example,
    build_example,
    param_bytes,
    saved_activation_bytes,
)

NAMES = ["largeblock", "gpt2", "llama", "resnet", "unet", "bert"]
WITH_DROPOUT = {"gpt2", "llama", "bert"}

_EXPORTED: dict[str, tuple[Example, torch.nn.Module]] = {}


def exported(name: str) -> tuple[Example, torch.nn.Module]:
    """(example, ep.module()) for ``name``, exported once per test session."""
    if name not in _EXPORTED:
        ex = build_example(name)
        ep = torch.export.export(ex.model, ex.example_inputs, ex.example_kwargs, strict=False)
        _EXPORTED[name] = (ex, ep.module())
    return _EXPORTED[name]


def test_registry():
    assert sorted(EXAMPLES) == sorted(NAMES)
    with pytest.raises(KeyError):
        build_example("nope")
    with pytest.raises(ValueError):
        build_example("largeblock", size="huge")


@pytest.mark.parametrize("name", NAMES)
def test_build_contract(name):
    ex = build_example(name)
    assert isinstance(ex, Example)
    assert ex.name == name
    with pytest.raises(dataclasses.FrozenInstanceError):
        ex.name = "x"  # type: ignore[misc]
    assert ex.model.training
    assert all(m.training for m in ex.model.modules())
    assert isinstance(ex.example_inputs, tuple) and isinstance(ex.example_kwargs, dict)
    blocks = ex.model.get_submodule(ex.block_path)
    assert isinstance(blocks, (torch.nn.ModuleList, torch.nn.Sequential))
    assert len(blocks) >= 4
    # the repeated blocks hold most of the parameters
    in_blocks = sum(p.numel() for p in blocks.parameters())
    total = sum(p.numel() for p in ex.model.parameters())
    assert in_blocks >= 0.5 * total


@pytest.mark.parametrize("name", NAMES)
def test_same_seed_same_weights(name):
    a, b, c = build_example(name, seed=0), build_example(name, seed=0), build_example(name, seed=1)
    pa, pb, pc = (list(x.model.parameters()) for x in (a, b, c))
    assert all(torch.equal(x, y) for x, y in zip(pa, pb))
    assert not all(torch.equal(x, y) for x, y in zip(pa, pc))
    # building does not disturb the caller's RNG
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_example(name)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("name", NAMES)
def test_forward_backward_finite(name):
    ex = build_example(name)
    loss = ex.run()
    assert loss.dim() == 0 and math.isfinite(loss.item())
    loss.backward()
    for pname, p in ex.model.named_parameters():
        assert p.grad is not None, pname
        assert torch.isfinite(p.grad).all(), pname


@pytest.mark.parametrize("name", NAMES)
def test_export_matches_eager_exactly(name):
    ex, gm = exported(name)
    params = dict(ex.model.named_parameters())

    def loss_and_grads(model):
        for p in params.values():
            p.grad = None
        torch.manual_seed(1234)
        loss = ex.run(model)
        loss.backward()
        return loss.detach(), {k: p.grad.clone() for k, p in params.items()}

    eager_loss, eager_grads = loss_and_grads(ex.model)
    export_loss, export_grads = loss_and_grads(gm)
    assert torch.equal(eager_loss, export_loss), (eager_loss.item(), export_loss.item())
    for k in params:
        assert torch.equal(eager_grads[k], export_grads[k]), k

    if name in WITH_DROPOUT:
        # dropout really is active, so the equality above is not vacuous
        torch.manual_seed(4321)
        other = ex.run(ex.model).detach()
        assert not torch.equal(other, eager_loss)


@pytest.mark.parametrize("name", NAMES)
def test_export_shares_parameters_and_buffers(name):
    ex, gm = exported(name)
    ours = dict(ex.model.named_parameters())
    theirs = dict(gm.named_parameters())
    assert set(ours) == set(theirs)
    for k in ours:
        assert theirs[k] is ours[k], k
    our_bufs = dict(ex.model.named_buffers())
    their_bufs = dict(gm.named_buffers())
    for k in our_bufs:
        assert their_bufs[k] is our_bufs[k], k


@pytest.mark.parametrize("name", NAMES)
def test_activations_dominate(name):
    ex = build_example(name)
    pbytes = param_bytes(ex.model)
    sbytes = saved_activation_bytes(ex)
    assert sbytes >= 1.5 * pbytes, (sbytes, pbytes)


def test_largeblock_checkpoint_flag_matches():
    from examples.largeblock import CheckpointedModel

    ex = build_example("largeblock")
    assert isinstance(ex.model, CheckpointedModel)
    (x,) = ex.example_inputs
    params = list(ex.model.parameters())

    def grads(use_checkpoint):
        out = ex.model(x, use_checkpoint=use_checkpoint)
        g = torch.autograd.grad(ex.loss_fn(out), params)
        return out.detach(), g

    out0, g0 = grads(False)
    out1, g1 = grads(True)
    assert torch.equal(out0, out1)
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))


def test_the_demo_plans_trains_and_meets_its_prediction():
    """The README's main job at test size (``python -m examples.demo``, calibration cut to 1 s a group): the plan
    for half the eager peak measures exactly the peak it predicts and stays under its budget, every method gives
    eager's loss, and the planned model trains."""
    import re
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-m", "examples.demo", "--size", "test", "--steps", "2", "--repeats", "2"],
                            cwd=root, env={**os.environ, "PLANNER_CALIBRATION_SECONDS": "1"}, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    methods = ("eager", "HF gradient checkpointing", "planner @ 50% of eager", "planner @ uniform's memory")
    rows = {name: (peak, float(loss)) for name, peak, loss in
            re.findall(r"^(" + "|".join(map(re.escape, methods)) + r")\s+([\d.]+ MiB)\s.*\s([\d.]+)$", out, re.M)}
    assert sorted(rows) == sorted(methods) and len({loss for _, loss in rows.values()}) == 1
    predicted, budget = re.search(r"predicted peak ([\d.]+ MiB), budget ([\d.]+ MiB)", out).groups()
    assert rows["planner @ 50% of eager"][0] == predicted
    assert float(predicted.split()[0]) <= float(budget.split()[0])
    trained = [float(x) for x in re.findall(r"^step \d+: loss ([\d.]+)$", out, re.M)]
    assert len(trained) == 2 and trained[1] < trained[0]
