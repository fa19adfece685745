"""Peak memory against step-time overhead: the planner next to uniform checkpointing, Chen's sqrt(n) and
``torch.compile``'s activation memory budget. The data behind :func:`planner.viz.plot_frontier`.

:func:`planner_frontier` is the execution model's prediction for planner plans at several budgets and for the
baselines; :func:`compile_frontier` measures ``torch.compile`` (inductor) under
``torch._functorch.config.activation_memory_budget``, whose setting is a share of the bytes saved for the backward,
not a peak: it compiles a copy of the model per setting and reads the peak the step reaches from the CPU allocator
(:func:`~planner.meter.allocator_peak_bytes`), and its overhead from timed steps against the same compiled model at
budget 1.0. Compiling takes seconds to a minute per setting.

>>> from planner.problem import Problem, Stage, TensorInfo
>>> stages = tuple(Stage(f"s{i}", 1.0, 2.0) for i in range(4))
>>> inner = tuple(TensorInfo(f"a{i}", 100, i, frozenset({i}), frozenset({i})) for i in range(4))
>>> edges = tuple(TensorInfo(f"x{i}", 10, i, frozenset({i + 1}), frozenset({i + 1})) for i in range(3))
>>> points = planner_frontier(Problem(stages, inner + edges), shares=(0.0, 1.0))
>>> [(p.method.value, p.setting, p.peak_bytes, round(p.overhead, 3)) for p in points]  # doctest: +NORMALIZE_WHITESPACE
[('eager', 'store all', 430, 0.0), ('uniform', 'every stage', 130, 0.333),
 ('chen_sqrt', 'sqrt(n) segments', 220, 0.167), ('planner', 'budget 130 B', 130, 0.25),
 ('planner', 'budget 220 B', 220, 0.167), ('planner', 'budget 430 B', 430, 0.0)]
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from .budget import format_bytes
from .errors import InfeasibleBudgetError
from .meter import allocator_peak_bytes, storage_bytes
from .problem import Problem, Schedule, simulate
from . import solvers

__all__ = ["Method", "FrontierPoint", "planner_frontier", "compile_frontier"]

SHARES = (0.0, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0)
COMPILE_RATIOS = (1.0, 0.6, 0.3, 0.1, 0.0)


class Method(enum.Enum):
    EAGER = "eager"
    UNIFORM = "uniform"
    CHEN_SQRT = "chen_sqrt"
    PLANNER = "planner"
    TORCH_COMPILE = "torch.compile"


@dataclass(frozen=True)
class FrontierPoint:
    """One way to run the step: its peak memory and its extra step time over the same method without
    recomputation; ``measured`` says whether both come from running it (else from the execution model);
    ``budget_bytes`` is the budget a planner point was solved for."""

    method: Method
    setting: str
    peak_bytes: int
    overhead: float
    measured: bool = False
    budget_bytes: int | None = None


def _predicted(problem: Problem, schedule: Schedule, method: Method, setting: str) -> FrontierPoint:
    evaluation = simulate(problem, schedule)
    eager_seconds = evaluation.step_seconds - evaluation.recompute_seconds
    overhead = evaluation.recompute_seconds / eager_seconds if eager_seconds > 0 else 0.0
    return FrontierPoint(method, setting, evaluation.peak_bytes, overhead)


def planner_frontier(problem: Problem, shares: Sequence[float] = SHARES, *,
                     solver: str = "auto") -> list[FrontierPoint]:
    """Predicted points: eager, uniform checkpointing, Chen's sqrt(n), and the planner at budgets ``shares`` of
    the way from the smallest feasible peak (0.0) to the eager peak (1.0) and at each baseline's peak."""
    from .solvers.baselines import chen_sqrt, uniform

    n = problem.num_stages
    points = [_predicted(problem, Schedule.store_all(n), Method.EAGER, "store all"),
              _predicted(problem, uniform(problem), Method.UNIFORM, "every stage"),
              _predicted(problem, chen_sqrt(problem), Method.CHEN_SQRT, "sqrt(n) segments")]
    eager, smallest = points[0].peak_bytes, solvers.minimum_peak(problem)
    budgets = {int(smallest + share * (eager - smallest)) for share in shares}
    budgets |= {p.peak_bytes for p in points[1:] if smallest <= p.peak_bytes < eager}  # at each baseline's memory
    for budget in sorted(budgets):
        try:
            plan = solvers.solve(problem, budget, method=solver)
        except InfeasibleBudgetError:
            continue  # the DP's rounding can miss the exact minimum; the next share is feasible
        point = _predicted(problem, plan.schedule, Method.PLANNER, f"budget {format_bytes(budget)}")
        points.append(dataclasses.replace(point, budget_bytes=budget))
    return points


def _compiled_step(model: torch.nn.Module, args: tuple, kwargs: dict,
                   loss_fn: Callable[[Any], torch.Tensor]) -> Callable[[], None]:
    compiled = torch.compile(model, backend="inductor")

    def step() -> None:
        loss_fn(compiled(*args, **kwargs)).backward()
        model.zero_grad(set_to_none=True)
    return step


def _fastest(step: Callable[[], None], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        samples.append(time.perf_counter() - start)
    return min(samples) if repeats < 5 else statistics.median(sorted(samples)[: repeats // 2 + 1])


def compile_frontier(model: torch.nn.Module, example_inputs: tuple, example_kwargs: dict | None = None, *,
                     loss_fn: Callable[[Any], torch.Tensor] | None = None,
                     ratios: Sequence[float] = COMPILE_RATIOS, repeats: int = 5) -> list[FrontierPoint]:
    """Measured points of ``torch.compile(copy of model)`` at each ``activation_memory_budget`` in ``ratios``.

    Peaks count the parameters, buffers and inputs plus what the CPU allocator holds during one step; overheads
    are against the fastest step at ratio 1.0 (measured first, whether or not ``ratios`` lists it). ``model``
    itself is not touched.
    """
    from .profile import default_loss

    loss_fn = loss_fn or default_loss
    kwargs = example_kwargs or {}
    model = copy.deepcopy(model)
    fixed = storage_bytes(list(model.parameters()) + list(model.buffers())
                          + [t for t in example_inputs if isinstance(t, torch.Tensor)])
    points, base_seconds = [], None
    for ratio in [1.0, *[r for r in ratios if r != 1.0]]:
        torch._dynamo.reset()
        with torch._functorch.config.patch(activation_memory_budget=ratio):
            step = _compiled_step(model, example_inputs, kwargs, loss_fn)
            step()  # compiles forward and backward under this budget
        peak = fixed + allocator_peak_bytes(step)
        seconds = _fastest(step, repeats)
        base_seconds = base_seconds or seconds
        if ratio in ratios:
            points.append(FrontierPoint(Method.TORCH_COMPILE, f"activation_memory_budget={ratio:g}", peak,
                                        seconds / base_seconds - 1, measured=True))
    torch._dynamo.reset()
    return points
