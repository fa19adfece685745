"""Custom autograd.Functions kept whole in the captured graph (planner.functions)."""

from __future__ import annotations

import warnings

import pytest
import torch

import planner
from planner.capture import OwnCheckpointsWarning, capture
from planner.costmodel import never_cached
from planner.errors import PlannerError
from planner.functions import calls_function
from tests.helpers import assert_same_training, training_step

WIDTH = 32


class StraightThrough(torch.autograd.Function):
    """Rounds to quarters; passes the gradient through unchanged."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, grad):
        return grad


class Swish(torch.autograd.Function):
    """Saves its input and a float on ``ctx``; its backward recomputes the sigmoid."""

    @staticmethod
    def forward(ctx, x, beta):
        ctx.save_for_backward(x)
        ctx.beta = beta
        return x * torch.sigmoid(beta * x)

    @staticmethod
    def backward(ctx, grad):
        x, = ctx.saved_tensors
        s = torch.sigmoid(ctx.beta * x)
        return grad * (s + ctx.beta * x * s * (1 - s)), None


class ProductAndSum(torch.autograd.Function):
    """Two inputs, two outputs; a once-differentiable backward."""

    @staticmethod
    def forward(ctx, x, y):
        ctx.save_for_backward(x, y)
        return x * y, x + y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_product, grad_sum):
        x, y = ctx.saved_tensors
        return grad_product * y + grad_sum, grad_product * x + grad_sum


class Scaled(torch.autograd.Function):
    """The new style: forward without ``ctx``, a ``setup_context``."""

    @staticmethod
    def forward(x, scale):
        return x * scale

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.scale = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale * 2, None  # not the forward's derivative: a traced forward would train otherwise


class Returning(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


swish = Swish.apply  # an alias bound before any capture, as modules often write it


class Blocks(torch.nn.Module):
    def __init__(self, layers: int = 4):
        super().__init__()
        self.up = torch.nn.ModuleList(torch.nn.Linear(WIDTH, 4 * WIDTH) for _ in range(layers))
        self.down = torch.nn.ModuleList(torch.nn.Linear(4 * WIDTH, WIDTH) for _ in range(layers))
        self.side = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers))

    def forward(self, x):
        for up, down, side in zip(self.up, self.down, self.side):
            product, total = ProductAndSum.apply(side(x), x)
            x = x + StraightThrough.apply(down(swish(up(x), 1.5))) + Scaled.apply(product - total, 0.1)
        return x


def _square_mean(out):
    return out.pow(2).mean()


X = torch.randn(128, 16, WIDTH)


def test_every_way_of_calling_a_function_is_one_node():
    graph = capture(Blocks(layers=1), (X,)).graph_module
    called = [n.target.name().split("::")[1].rsplit("_", 1)[0] for n in graph.graph.nodes if calls_function(n)]
    assert called == ["ProductAndSum", "Swish", "StraightThrough", "Scaled"]
    assert "forward" in vars(Swish) and "kept_whole" not in Swish.forward.__qualname__  # restored
    assert set(never_cached(list(graph.graph.nodes))) == {n.name for n in graph.graph.nodes if calls_function(n)}


class Applying(torch.nn.Module):
    """A linear layer, then ``function``."""

    def __init__(self, function: type):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.function = function

    def forward(self, x):
        return self.function.apply(self.lin(x))


def test_the_captured_graph_trains_through_the_functions_own_backward():
    model, x = Applying(StraightThrough), torch.randn(2, 4)
    graph = capture(model, (x,)).graph_module
    assert "round" not in graph.code  # not traced: one call of the Function
    graph(x).sum().backward()
    assert torch.equal(model.lin.bias.grad, torch.full((4,), 2.0))  # straight through; a traced round gives 0


def test_the_same_call_captured_again_is_the_same_operator():
    model = Blocks(layers=1)
    first, again = (capture(model, (X,)).graph_module for _ in range(2))
    assert [n.target for n in first.graph.nodes if calls_function(n)] == \
        [n.target for n in again.graph.nodes if calls_function(n)]


@pytest.mark.parametrize("granularity, budget", [("block", "100%"), ("block", "60%"), ("sublayer", "60%")])
def test_functions_train_through_their_own_backward_within_the_prediction(granularity, budget):
    torch.manual_seed(0)
    model = Blocks()
    run = lambda m: _square_mean(m(X))  # noqa: E731
    eager = training_step(model, run, (X,))
    opt = planner.optimize(model, budget, example_inputs=(X,), loss_fn=_square_mean, profile_repeats=1,
                           granularity=granularity, hold_outputs=False)  # run() drops the outputs for the loss
    planned = training_step(opt, run, (X,), owner=model)
    assert_same_training(eager, planned, atol=0)
    assert bool(opt.plan.regions) == (budget != "100%")
    assert planned.peak_bytes <= opt.plan.predicted_peak_bytes <= opt.plan.budget_bytes
    assert opt.plan.predicted_peak_bytes - planned.peak_bytes <= 1024  # exact, or a few bytes over


def test_a_function_returning_its_input_is_named():
    with pytest.raises(PlannerError, match="Returning returns an input"):
        capture(Applying(Returning), (torch.randn(2, 4),))
    assert "kept_whole" not in Returning.forward.__qualname__


def test_a_function_given_no_tensor_runs_as_written():
    class Constant(torch.autograd.Function):
        @staticmethod
        def forward(ctx, value):
            return torch.full((4,), float(value))

        @staticmethod
        def backward(ctx, grad):
            return None

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x) + Constant.apply(3)

    graph = capture(Model(), (torch.randn(2, 4),)).graph_module
    assert not any(calls_function(n) for n in graph.graph.nodes)


def test_a_compiled_plan_calls_the_functions_too():
    torch.manual_seed(0)
    model = Blocks(layers=2)
    run = lambda m: _square_mean(m(X))  # noqa: E731
    eager = training_step(model, run, (X,))
    opt = planner.optimize(model, "80%", example_inputs=(X,), loss_fn=_square_mean, profile_repeats=1, compile=True)
    compiled = training_step(opt, run, (X,), owner=model)
    assert_same_training(eager, compiled, atol=1e-5)
    assert dict(opt.plan.extra)["compiled_peak_bytes"] <= opt.plan.budget_bytes


class NoisyDrop(torch.autograd.Function):
    """Dropout written as a Function: draws its own mask, which a recomputation must draw again alike."""

    @staticmethod
    def forward(ctx, x, p):
        keep = (torch.rand_like(x) > p).to(x.dtype) / (1 - p)
        ctx.save_for_backward(keep)
        return x * keep

    @staticmethod
    def backward(ctx, grad):
        keep, = ctx.saved_tensors
        return grad * keep, None


class Dropping(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.GELU(), torch.nn.Linear(4 * WIDTH, WIDTH),
                                torch.nn.Dropout(0.1)) for _ in range(6))

    def forward(self, x):
        for block in self.blocks:
            x = x + NoisyDrop.apply(block(x), 0.2)
        return x


@pytest.mark.parametrize("granularity", ["block", "sublayer"])
def test_a_function_drawing_random_numbers_draws_them_again_alike_when_recomputed(granularity):
    torch.manual_seed(0)
    model = Dropping()
    run = lambda m: _square_mean(m(X))  # noqa: E731
    eager = training_step(model, run, (X,), seed=5)
    opt = planner.optimize(model, "45%", example_inputs=(X,), loss_fn=_square_mean, profile_repeats=1,
                           granularity=granularity, hold_outputs=False)
    assert opt.plan.regions
    planned = training_step(opt, run, (X,), owner=model, seed=5)
    assert_same_training(eager, planned, atol=0)
    assert planned.peak_bytes <= opt.plan.predicted_peak_bytes <= opt.plan.budget_bytes
    assert opt.plan.predicted_peak_bytes - planned.peak_bytes <= 1024  # exact, or a few bytes over


class CheckpointedByHand(torch.nn.Module):
    """Every other block under ``torch.utils.checkpoint``, reentrant or not."""

    def __init__(self, use_reentrant: bool):
        super().__init__()
        self.use_reentrant = use_reentrant
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.GELU(), torch.nn.Linear(4 * WIDTH, WIDTH))
            for _ in range(6))

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            y = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=self.use_reentrant) if i % 2 else block(x)
            x = x + y
        return x


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpoints_the_model_makes_itself_are_traced_through_and_planned_anew(use_reentrant):
    torch.manual_seed(0)
    model = CheckpointedByHand(use_reentrant)
    x = X.clone().requires_grad_()  # reentrant checkpoint needs an input that requires grad
    run = lambda m: _square_mean(m(x))  # noqa: E731
    eager = training_step(model, run, (x,))
    with pytest.warns(OwnCheckpointsWarning, match=r"checkpoints itself \(3 torch.utils.checkpoint calls a step"
                      r".*'60%' is a share of its step without them"):
        opt = planner.optimize(model, "60%", example_inputs=(x,), loss_fn=_square_mean, profile_repeats=1,
                               hold_outputs=False)
    assert opt.planned.captured.own_checkpoints == 3
    assert torch.utils.checkpoint.CheckpointFunction.__name__ == "CheckpointFunction"  # put back
    assert torch.utils.checkpoint._checkpoint_without_reentrant_generator.__name__ == (
        "_checkpoint_without_reentrant_generator")
    assert not any(calls_function(n) for n in opt.planned.captured.graph_module.graph.nodes)
    planned = training_step(opt, run, (x,), owner=model)
    assert_same_training(eager, planned, atol=0)
    assert planned.peak_bytes <= opt.plan.predicted_peak_bytes <= opt.plan.budget_bytes
    assert opt.plan.predicted_peak_bytes - planned.peak_bytes <= 1024  # exact, or a few bytes over


def test_a_budget_in_bytes_for_a_model_that_checkpoints_itself_does_not_warn():
    """A share of the eager peak is of the step without the model's own checkpoints, which the plan replaces, so it
    may allow more than they took (:class:`OwnCheckpointsWarning`); a budget in bytes means what it says. The
    planner's own regions, run inside another capture, are not the model's."""
    torch.manual_seed(0)
    model = CheckpointedByHand(use_reentrant=False)
    with pytest.warns(OwnCheckpointsWarning, match="'90%' is a share"):
        first = planner.plan(model, "90%", (X,), loss_fn=_square_mean, profile_repeats=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", OwnCheckpointsWarning)
        planner.plan(model, first.budget_bytes, (X,), loss_fn=_square_mean, profile_repeats=1)
        plain = torch.nn.Sequential(*CheckpointedByHand(use_reentrant=False).blocks)  # checkpoints nothing itself
        inner = planner.optimize(plain, "60%", example_inputs=(X,), profile_repeats=1)
        assert inner.plan.regions
        assert capture(torch.nn.Sequential(inner, torch.nn.Linear(WIDTH, 1)), (X,)).own_checkpoints == 0
