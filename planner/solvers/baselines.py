"""Baseline rules people use by hand, and the explanation given when a budget is out of reach.

Each rule returns a :class:`~planner.problem.Schedule`; :func:`solve_baseline` evaluates it with
:func:`~planner.problem.simulate` and wraps it in a :class:`~planner.plan.Plan` with status ``HEURISTIC``.

* ``store_all``: no recomputation (eager PyTorch).
* ``uniform``: every stage its own checkpoint region, recomputed entirely (option 0), like
  ``gradient_checkpointing_enable()``.
* ``chen_sqrt``: Chen et al. 2016, regions of ``ceil(sqrt(n))`` consecutive stages; the last segment is not
  checkpointed, as ``torch.utils.checkpoint.checkpoint_sequential`` does.
* ``fewest_blocks``: checkpoint stages ``0 .. m-1`` one region each, with the smallest ``m`` whose peak fits.

>>> from planner.problem import Problem, Stage, TensorInfo
>>> stages = tuple(Stage(f"s{i}", forward_seconds=1.0, backward_seconds=2.0) for i in range(4))
>>> tensors = tuple(TensorInfo(f"t{i}", 100, producer=i, consumers=frozenset({i + 1}),
...                            savers=frozenset({i, i + 1})) for i in range(3))
>>> problem = Problem(stages, tensors)
>>> [(r.start, r.stop) for r in chen_sqrt(problem).regions]
[(0, 2)]
>>> plan = solve_baseline(problem, "uniform")
>>> plan.predicted_recompute_seconds, plan.status.value
(4.0, 'heuristic')
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

from ..budget import format_bytes, format_bytes_apart
from ..errors import InfeasibleBudgetError, PlannerError
from ..plan import Plan, SolverStatus
from ..problem import Problem, Schedule, simulate

BASELINES = ("store_all", "uniform", "chen_sqrt", "fewest_blocks", "whole")


def store_all(problem: Problem) -> Schedule:
    """No recomputation.

    >>> from planner.problem import Problem, Stage
    >>> store_all(Problem((Stage("a", 1.0, 2.0),), ())).regions
    ()
    """
    return Schedule.store_all(problem.num_stages)


def uniform(problem: Problem) -> Schedule:
    """Every stage its own region, recomputed entirely (option 0).

    >>> from planner.problem import Problem, Stage
    >>> [(r.start, r.stop) for r in uniform(Problem((Stage("a", 1.0, 2.0), Stage("b", 1.0, 2.0)), ())).regions]
    [(0, 1), (1, 2)]
    """
    return Schedule.uniform(problem.num_stages)


def whole(problem: Problem) -> Schedule:
    """All stages one region, recomputed entirely: ``torch.utils.checkpoint`` around the whole module, which keeps
    only its inputs and outputs from its forward to its backward (how a model planned in parts sheds memory across
    parts: :func:`planner.api.optimize`).

    >>> from planner.problem import Problem, Stage
    >>> [(r.start, r.stop) for r in whole(Problem((Stage("a", 1.0, 2.0), Stage("b", 1.0, 2.0)), ())).regions]
    [(0, 2)]
    """
    return Schedule.from_segments([(0, problem.num_stages)] if problem.num_stages else [])


def chen_sqrt(problem: Problem) -> Schedule:
    """Regions of ``ceil(sqrt(n))`` consecutive stages, recomputed entirely; the last segment runs stored.

    The stored tail holds the remaining ``1 .. ceil(sqrt(n))`` stages, so a model of ``n <= 2`` stages is not
    checkpointed at all.

    >>> from planner.problem import Problem, Stage
    >>> problem = Problem(tuple(Stage(f"s{i}", 1.0, 2.0) for i in range(10)), ())
    >>> [(r.start, r.stop) for r in chen_sqrt(problem).regions]
    [(0, 4), (4, 8)]
    """
    return chen_sqrt_of(problem.num_stages)


def chen_sqrt_of(n: int) -> Schedule:
    """:func:`chen_sqrt` for ``n`` stages.

    >>> chen_sqrt_of(6).regions
    (Region(start=0, stop=3, options=()),)
    """
    if n == 0:
        return Schedule()
    size = math.ceil(math.sqrt(n))
    segments = math.ceil(n / size)
    return Schedule.from_segments((start, start + size) for start in range(0, size * (segments - 1), size))


def block_checkpoints(ranges: Sequence[tuple[int, int]]) -> list[Schedule]:
    """Block checkpoints as users place them, over the finer stages ``ranges`` says make up each block (its
    ``[start, stop)``): the first ``k`` blocks each in its own region (``k = 0 .. n``), and Chen's sqrt(n) segments
    of blocks.

    >>> [[(r.start, r.stop) for r in s.regions] for s in block_checkpoints([(0, 2), (2, 3)])]
    [[], [(0, 2)], [(0, 2), (2, 3)], []]
    """
    prefixes = [Schedule.prefix(count) for count in range(len(ranges) + 1)]
    return [s.refined(ranges) for s in prefixes + [chen_sqrt_of(len(ranges))]]


def checkpoint_prefix(problem: Problem, count: int) -> Schedule:
    """Stages ``0 .. count-1`` each in their own region, recomputed entirely; the rest stored."""
    return Schedule.prefix(min(count, problem.num_stages))


def fewest_blocks(problem: Problem, budget_bytes: int) -> Schedule | None:
    """Checkpoint the fewest leading stages (one region each, option 0) whose peak fits ``budget_bytes``.

    Tries ``m = 0, 1, .., n`` checkpointed stages, earliest stages first, and returns the first schedule within
    budget; None when no prefix fits, not even ``m = n`` (``uniform``).

    >>> from planner.problem import Problem, Stage, TensorInfo
    >>> stages = tuple(Stage(f"s{i}", 1.0, 2.0) for i in range(4))
    >>> inner = tuple(TensorInfo(f"a{i}", 100, i, frozenset({i}), frozenset({i})) for i in range(4))
    >>> edges = tuple(TensorInfo(f"x{i}", 10, i, frozenset({i + 1}), frozenset({i + 1})) for i in range(3))
    >>> problem = Problem(stages, inner + edges)
    >>> simulate(problem, store_all(problem)).peak_bytes
    430
    >>> [(r.start, r.stop) for r in fewest_blocks(problem, 250).regions]
    [(0, 1), (1, 2)]
    >>> fewest_blocks(problem, 100) is None
    True
    """
    for count in range(problem.num_stages + 1):
        schedule = checkpoint_prefix(problem, count)
        if simulate(problem, schedule).peak_bytes <= budget_bytes:
            return schedule
    return None


_RULES: dict[str, Callable[[Problem], Schedule]] = {
    "store_all": store_all, "uniform": uniform, "chen_sqrt": chen_sqrt, "whole": whole,
}


def solve_baseline(problem: Problem, name: str, budget_bytes: int | None = None) -> Plan:
    """Apply the baseline ``name`` and evaluate it.

    Fixed rules (``store_all``, ``uniform``, ``chen_sqrt``, ``whole``) ignore the budget but record it in the plan, so a caller
    can compare ``predicted_peak_bytes`` with it. ``fewest_blocks`` needs the budget and raises
    :class:`~planner.errors.InfeasibleBudgetError` when no prefix fits, with the smallest peak a prefix reaches.

    >>> from planner.problem import Problem, Stage
    >>> solve_baseline(Problem((Stage("a", 1.0, 2.0),), ()), "sqrt")
    Traceback (most recent call last):
    ...
    planner.errors.PlannerError: unknown baseline 'sqrt'. Hint: choose one of store_all, uniform, chen_sqrt, fewest_blocks, whole
    """
    if name == "fewest_blocks":
        schedule = _fewest_blocks_or_raise(problem, budget_bytes)
    elif name in _RULES:
        schedule = _RULES[name](problem)
    else:
        raise PlannerError(f"unknown baseline {name!r}", hint=f"choose one of {', '.join(BASELINES)}")
    return Plan.from_schedule(problem, schedule, solver=name, status=SolverStatus.HEURISTIC, budget_bytes=budget_bytes)


def _fewest_blocks_or_raise(problem: Problem, budget_bytes: int | None) -> Schedule:
    if budget_bytes is None:
        raise PlannerError("the fewest_blocks baseline needs a budget", hint="pass budget_bytes")
    schedule = fewest_blocks(problem, budget_bytes)
    if schedule is None:
        best = min(simulate(problem, checkpoint_prefix(problem, m)).peak_bytes for m in range(problem.num_stages + 1))
        raise InfeasibleBudgetError(
            f"no prefix of checkpointed stages fits the budget {format_bytes(budget_bytes)}; the best reaches "
            f"{format_bytes(best)}", hint="use method='ilp' or 'dp' for selective plans, or raise the budget",
            minimum_budget_bytes=best)
    return schedule


def infeasible_budget_error(problem: Problem, budget_bytes: int, minimum_schedule: Schedule) -> InfeasibleBudgetError:
    """The error exact solvers raise when ``budget_bytes`` is below the smallest peak any plan reaches.

    ``minimum_schedule`` reaches that smallest peak; the message says what its peak moment is made of, so the user
    sees whether recomputation could ever help (it cannot shrink fixed memory, gradients or workspaces).

    >>> from planner.problem import Problem, Stage, TensorInfo
    >>> problem = Problem((Stage("a", 1.0, 2.0, grad_bytes=300), Stage("b", 1.0, 2.0)),
    ...                   (TensorInfo("x", 200, 0, frozenset({1}), frozenset({1})),), fixed_bytes=500)
    >>> error = infeasible_budget_error(problem, 700, Schedule())
    >>> error.minimum_budget_bytes
    800
    >>> print(error.message)  # doctest: +NORMALIZE_WHITESPACE
    budget 700 B is below the smallest peak any plan reaches, 800 B (eager peak 800 B). At that peak (backward of
    stage a), fixed memory (parameters, inputs, optimizer state) is 62%, gradients 38%, workspace 0% and activations
    0%: fixed memory and gradients alone are 100% of it, so no recomputation helps
    """
    minimum = simulate(problem, minimum_schedule)
    eager = simulate(problem, Schedule.store_all(problem.num_stages))
    event = minimum.peak_event
    total = max(event.total_bytes, 1)
    fixed = problem.fixed_bytes
    shares = {"fixed": fixed / total, "gradients": event.gradient_bytes / total,
              "workspace": event.workspace_bytes / total, "activations": event.activation_bytes / total}
    phase = {"forward": "forward", "backward": "backward", "backward_start": "start of the backward",
             "recompute": "recomputation before the backward"}.get(event.phase.value, event.phase.value)
    budget_text, minimum_text = format_bytes_apart(budget_bytes, minimum.peak_bytes)
    message = (f"budget {budget_text} is below the smallest peak any plan reaches, {minimum_text} (eager peak "
               f"{format_bytes(eager.peak_bytes)}). At that peak "
               f"({phase} of stage {problem.stages[event.stage].name}), fixed memory (parameters, inputs,"
               f" optimizer state) is {shares['fixed']:.0%}, gradients {shares['gradients']:.0%}, workspace "
               f"{shares['workspace']:.0%} and activations {shares['activations']:.0%}")
    message += _what_dominates(shares)
    return InfeasibleBudgetError(
        message, minimum_budget_bytes=minimum.peak_bytes,
        hint=f"a budget of at least {format_bytes(minimum.peak_bytes)} works; below it, shrink what dominates")


def _what_dominates(shares: dict[str, float]) -> str:
    unmovable = shares["fixed"] + shares["gradients"]
    if unmovable >= 0.5:
        return (f": fixed memory and gradients alone are {unmovable:.0%} of it, so no recomputation helps"
                if unmovable >= 0.9 else f": fixed memory and gradients are {unmovable:.0%} of it")
    largest = max(shares, key=shares.get)
    return {"fixed": ": fixed memory dominates", "gradients": ": gradients dominate",
            "workspace": ": workspace (temporaries, gradients in flight) dominates",
            "activations": ": activations dominate"}[largest]
