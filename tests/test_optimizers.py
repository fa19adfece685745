import pytest
import torch

from planner.optimizers import first_step_state_bytes, optimizer_state_bytes, state_bytes


def _params(dtype=torch.float32):
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(48, 16, dtype=dtype)), torch.nn.Parameter(torch.randn(16, dtype=dtype))]


def _stepped(optimizer):
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = torch.ones_like(p)
    optimizer.step() if not isinstance(optimizer, torch.optim.LBFGS) else optimizer.step(lambda: torch.zeros(()))
    return state_bytes(optimizer)


MAKES = {
    "adam": lambda ps: torch.optim.Adam(ps),
    "adam-amsgrad": lambda ps: torch.optim.Adam(ps, amsgrad=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, weight_decay=0.1),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "rmsprop-centered-momentum": lambda ps: torch.optim.RMSprop(ps, momentum=0.9, centered=True),
    "adadelta": lambda ps: torch.optim.Adadelta(ps),
    "adamax": lambda ps: torch.optim.Adamax(ps),
    "nadam": lambda ps: torch.optim.NAdam(ps),
    "radam": lambda ps: torch.optim.RAdam(ps),
    "rprop": lambda ps: torch.optim.Rprop(ps),
    "asgd": lambda ps: torch.optim.ASGD(ps),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("make", MAKES.values(), ids=MAKES.keys())
def test_the_first_steps_state_is_known_before_it(make, dtype):
    optimizer = make(_params(dtype))
    predicted = optimizer_state_bytes(optimizer)
    assert state_bytes(optimizer) == 0 and not optimizer.state  # the caller's optimizer took no step
    assert predicted == _stepped(optimizer)
    assert optimizer_state_bytes(optimizer) == predicted  # now read from its state


def test_state_made_at_construction_is_read():
    optimizer = torch.optim.Adagrad(_params())
    assert state_bytes(optimizer) == (48 * 16 + 16) * 4 == optimizer_state_bytes(optimizer)


def test_groups_keep_their_own_options():
    weights, biases = _params()
    optimizer = torch.optim.SGD([{"params": [weights], "momentum": 0.9}, {"params": [biases]}], lr=0.1)
    assert first_step_state_bytes(optimizer) == 48 * 16 * 4 == _stepped(optimizer)


def test_frozen_parameters_keep_no_state():
    weights, biases = _params()
    biases.requires_grad_(False)
    assert first_step_state_bytes(torch.optim.AdamW([weights, biases])) == 2 * 48 * 16 * 4


class Lion(torch.optim.Optimizer):
    """An optimizer from outside torch, as users bring: one momentum buffer per parameter."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99)):
        super().__init__(params, {"lr": lr, "betas": betas})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                update = state["exp_avg"].lerp(p.grad, 1 - group["betas"][0]).sign_()
                p.add_(update, alpha=-group["lr"])
                state["exp_avg"].lerp_(p.grad, 1 - group["betas"][1])


class ReadsValues(Lion):
    """Lion whose step reads a value on the host, as many optimizers' do: its step cannot run on meta tensors."""

    @torch.no_grad()
    def step(self, closure=None):
        float(self.param_groups[0]["params"][0].sum())
        return super().step(closure)


def test_an_optimizer_from_outside_torch_is_stepped_on_meta():
    assert first_step_state_bytes(Lion(_params())) == (48 * 16 + 16) * 4 == _stepped(Lion(_params()))


def test_an_optimizer_whose_step_cannot_run_on_meta_is_counted_by_its_kind():
    optimizer = ReadsValues(_params(torch.bfloat16))
    assert first_step_state_bytes(optimizer) == (48 * 16 + 16) * 2 == _stepped(optimizer)  # "lion": 1 copy


def test_no_optimizer_keeps_nothing():
    assert optimizer_state_bytes(None) == 0
