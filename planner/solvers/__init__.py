"""Solvers: from a :class:`~planner.problem.Problem` and a budget in bytes to a :class:`~planner.plan.Plan`.

* ``"ilp"``: exact mixed-integer program (:mod:`.ilp`), any problem;
* ``"dp"``: dynamic program (:mod:`.dp`), exact on chains, conservative elsewhere;
* ``"store_all"``, ``"uniform"``, ``"chen_sqrt"``, ``"fewest_blocks"``: baselines (:mod:`.baselines`);
* ``"auto"``: the DP, whose plan carries a proven gap (against the optimum of a relaxation); when that gap is
  open and the problem is small enough (``ILP_STAGES`` stages, ``ILP_SIZE`` stages x tensors), the ILP starts
  from the DP's plan to close it, with half of the time limit.

Every plan reports ``gap`` and ``lower_bound_seconds``: no plan within the budget recomputes less than the bound.

>>> from planner.problem import Problem, Stage, TensorInfo
>>> stages = tuple(Stage(f"s{i}", 1.0, 2.0) for i in range(4))
>>> inner = tuple(TensorInfo(f"a{i}", 100, i, frozenset({i}), frozenset({i})) for i in range(4))
>>> edges = tuple(TensorInfo(f"x{i}", 10, i, frozenset({i + 1}), frozenset({i + 1})) for i in range(3))
>>> problem = Problem(stages, inner + edges)
>>> solve(problem, 250).solver, solve(problem, 250, method="ilp").predicted_recompute_seconds
('dp', 2.0)
>>> minimum_peak(problem)
130
>>> solve(problem, 250, method="magic")
Traceback (most recent call last):
...
planner.errors.PlannerError: unknown solver method 'magic'. Hint: choose one of auto, ilp, dp, store_all, uniform, chen_sqrt, fewest_blocks, whole
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

from ..errors import InfeasibleBudgetError, PlannerError
from ..plan import Plan, SolverStatus
from ..problem import Problem, Region, Schedule, Stage, held_after_forward_bytes, simulate, without_empty_regions
from .baselines import BASELINES, solve_baseline
from .dp import GAP_TOLERANCE, lower_bound, minimum_peak, relative_gap, solve_dp
from .ilp import min_peak_ilp, solve_ilp

METHODS = ("auto", "ilp", "dp", *BASELINES)

__all__ = ["METHODS", "lower_bound", "minimum_peak", "min_peak_ilp", "solve", "solve_baseline", "solve_dp",
           "buffered_gradients", "peak_with_calls", "solve_for_calls", "solve_ilp"]


def solve(problem: Problem, budget_bytes: int, method: str = "auto", *, known: Sequence[Schedule] = (),
          **options) -> Plan:
    """Plan ``problem`` under ``budget_bytes`` with ``method``; ``options`` go to the solver (``time_limit``,
    ``gap`` for the ILP; ``buckets``, ``front_limit``, ``time_limit``, ``progress``, ``target_gap`` for the DP;
    ``time_limit``, ``progress``, ``ilp_stages`` for auto). ``known``: schedules the caller already has (block
    checkpoints over finer stages); a time-limited search returns none that recomputes more than one that fits."""
    if method in ("auto", "ilp", "dp"):
        solver = {"auto": _solve_auto, "ilp": solve_ilp, "dp": solve_dp}[method]
        return _without_empty_regions(problem,
                                      _no_worse_than(problem, budget_bytes, solver(problem, budget_bytes, **options),
                                                     known))
    if method in BASELINES:
        if options:
            raise PlannerError(f"baseline {method!r} takes no options, got {sorted(options)}")
        return _without_empty_regions(problem, solve_baseline(problem, method, budget_bytes))
    raise PlannerError(f"unknown solver method {method!r}", hint=f"choose one of {', '.join(METHODS)}")


def solve_for_calls(problem: Problem, budget_bytes: int, calls: int,
                    solve_within: Callable[[Problem, int], Plan], *, input_bytes: int = 0,
                    last_call: Problem | None = None) -> Plan:
    """A plan for steps that call the model ``calls`` times before one backward (``solve_within(problem, target)``
    plans one call of ``problem`` within ``target`` bytes): each call before the last holds what its forward keeps
    for its backward (:func:`~planner.problem.held_after_forward_bytes`) and its ``input_bytes`` while the last
    one steps, so a plan needs its own peak plus that much per other call. Autograd runs the last call's backward
    first, and the gradients it makes (see :func:`peak_with_calls`, and its ``last_call``) wait in its buffers,
    to be summed with the earlier calls', while those run their backwards (:func:`buffered_gradients`): a plan
    needs that peak too, with the calls before held (where the gradients outweigh what a call holds, as for a
    large model on small batches, this is the peak). The solver is run for targets across the range of peaks
    (:func:`_scanned`) on the problem as it is, on one whose tensors weigh ``calls`` times their bytes (so that it
    prefers plans that hold less) and on an earlier call's (:func:`buffered_gradients`, or with ``last_call``
    :func:`summed_into_held`); eager's schedule and those that hold least (every stage a region, all stages one
    region) are tried too, and of the plans that fit with the other calls the one that recomputes least is kept.
    Its ``predicted_peak_bytes`` and ``eager_peak_bytes`` count the other calls; it is not proven optimal for them
    (no gap). Raises :class:`~planner.errors.InfeasibleBudgetError` naming the least peak of the plans tried when
    none fits.

    >>> from planner.problem import Problem, Stage, TensorInfo
    >>> stages = tuple(Stage(f"s{i}", 1.0, 2.0) for i in range(4))
    >>> inner = tuple(TensorInfo(f"a{i}", 100, i, frozenset({i}), frozenset({i})) for i in range(4))
    >>> edges = tuple(TensorInfo(f"x{i}", 10, i, frozenset({i + 1}), frozenset({i + 1})) for i in range(3))
    >>> problem = Problem(stages, inner + edges)
    >>> single = solve(problem, 400)  # holds 330 bytes for its backward: twice, 660
    >>> twice = solve_for_calls(problem, 400, 2, solve)
    >>> single.predicted_peak_bytes, single.predicted_recompute_seconds
    (330, 1.0)
    >>> twice.predicted_peak_bytes, twice.predicted_recompute_seconds, twice.eager_peak_bytes, twice.extra
    (260, 3.0, 860, (('calls_per_step', 2),))
    >>> solve_for_calls(problem, 150, 2, solve)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    planner.errors.InfeasibleBudgetError: budget 150 bytes does not fit 2 calls ... peak at 160 bytes ...
    """
    if calls <= 1:
        return solve_within(problem, budget_bytes)

    grads = [s.grad_bytes for s in (problem if last_call is None else last_call).stages]
    buffered = buffered_gradients(problem, sum(grads)) if last_call is None else summed_into_held(problem, grads)

    def evaluated(plan: Plan, searched: Problem) -> Plan:  # priced on the problem, beside the other calls
        if searched is not problem:
            plan = Plan.from_schedule(problem, plan.schedule, solver=plan.solver, status=SolverStatus.FEASIBLE,
                                      solve_seconds=plan.solve_seconds)
        return dataclasses.replace(plan, predicted_peak_bytes=peak_with_calls(
            problem, plan.schedule, calls, input_bytes=input_bytes, last_call=last_call))
    n = problem.num_stages
    tried = [evaluated(Plan.from_schedule(problem, schedule, solver="calls", status=SolverStatus.FEASIBLE), problem)
             for schedule in (Schedule.store_all(n), Schedule.uniform(n), Schedule((Region(0, n),)))]
    for searched in (problem, _weighted(problem, calls), *((buffered,) if sum(grads) else ())):
        tried += _scanned(searched, budget_bytes, lambda target: evaluated(solve_within(searched, target), searched))
    fitting = [plan for plan in tried if plan.predicted_peak_bytes <= budget_bytes]
    if not fitting:
        smallest = min(plan.predicted_peak_bytes for plan in tried)
        raise InfeasibleBudgetError(
            f"budget {budget_bytes} bytes does not fit {calls} calls of the model before one backward: the plans "
            f"for the least memory peak at {smallest} bytes with the other calls' held tensors and inputs",
            hint=f"use a budget of at least {smallest} bytes, or call the model once a step (one batch of all the "
                 f"views)", minimum_budget_bytes=smallest)
    best = min(fitting, key=lambda plan: (plan.predicted_recompute_seconds, plan.predicted_peak_bytes))
    eager = tried[0]  # eager's schedule
    return dataclasses.replace(best, eager_peak_bytes=eager.predicted_peak_bytes, gap=None, lower_bound_seconds=None,
                               status=SolverStatus.FEASIBLE, extra=(*best.extra, ("calls_per_step", calls)))


def peak_with_calls(problem: Problem, schedule: Schedule, calls: int, *, input_bytes: int = 0,
                    last_call: Problem | None = None) -> int:
    """The peak of a step that runs ``schedule`` for ``calls`` calls of the model before one backward (see
    :func:`solve_for_calls`): the last call's step with the others' held tensors and inputs, its gradients waiting
    in autograd's buffers as its stages make them, or an earlier call's backward with all of them waiting
    (:func:`buffered_gradients`).

    ``last_call``: for a ``problem`` posed with the gradients held from before the step (gradient accumulation:
    its stages make none that stay), the same step posed with a backward that keeps the gradients it makes and the
    held ones among its fixed bytes, as the last call's backward keeps them in autograd's buffers; the first
    call's then sums each stage's into the held ones and frees them (:func:`summed_into_held`), and those between
    sum into the buffers.

    >>> from planner.problem import Problem, Stage, TensorInfo
    >>> stages = tuple(Stage(f"s{i}", 1.0, 2.0, grad_bytes=150) for i in range(2))
    >>> problem = Problem(stages, tuple(TensorInfo(f"a{i}", 100, i, frozenset({i}), frozenset({i})) for i in range(2)))
    >>> eager = Schedule.store_all(2)
    >>> simulate(problem, eager).peak_bytes, held_after_forward_bytes(problem, eager)  # 300: activations gone
    (300, 200)
    >>> peak_with_calls(problem, eager, 2)  # the second call's 300 with the first's 200 held
    500
    >>> peak_with_calls(problem, eager, 3)  # and the first call's backward: 300 buffered, its 200, the other 200
    700
    >>> held = dataclasses.replace(problem, stages=tuple(dataclasses.replace(s, grad_bytes=0) for s in stages),
    ...                            fixed_bytes=300)  # gradient accumulation: 300 of gradients held from the start
    >>> peak_with_calls(held, eager, 2, last_call=dataclasses.replace(problem, fixed_bytes=300))
    800
    """
    if calls <= 1:
        return simulate(problem, schedule).peak_bytes
    making = problem if last_call is None else last_call
    grads = [s.grad_bytes for s in making.stages]
    held = held_after_forward_bytes(problem, schedule)
    peaks = [simulate(making, schedule).peak_bytes + (calls - 1) * held]  # the last call's, the others holding
    if last_call is None or calls > 2:  # a call between the first and the last: its sums wait for the first's
        middle = buffered_gradients(problem, sum(grads), gradients_held=last_call is not None)
        peaks.append(simulate(middle, schedule).peak_bytes + (calls - 2) * held)
    if last_call is not None:  # the first call's backward, the others' done: its sums go into the held gradients
        peaks.append(simulate(summed_into_held(problem, grads), schedule).peak_bytes)
    return max(peaks) + (calls - 1) * input_bytes


def buffered_gradients(problem: Problem, gradient_bytes: int, *, gradients_held: bool = False) -> Problem:
    """``problem`` for the backward of a call made before others in one step: the ``gradient_bytes`` the later
    calls' backwards made (autograd runs them first) wait in its buffers from the start, fixed, and this call's
    gradients are summed into them, so none of its stages makes gradients that stay. Autograd sums out of place:
    while a stage's backward sums its largest parameter's gradient, it holds this call's (which a single call's
    backward keeps as the gradient, so its measured workspace leaves it out) and the sum beside the waiting one.
    ``gradients_held``: ``problem`` was posed with the gradients held from before the step, and its measured
    workspace holds each gradient made while it was summed into the held one: only the sum is more (for the calls
    between the first and the last, whose sums wait in the buffers for the first's: :func:`summed_into_held`).

    >>> from planner.problem import Stage
    >>> problem = Problem((Stage("s", 1.0, 2.0, grad_bytes=40, largest_grad_bytes=30),), (), fixed_bytes=100)
    >>> buffered = buffered_gradients(problem, 40)
    >>> buffered.fixed_bytes, buffered.stages[0].grad_bytes, buffered.stages[0].backward_workspace_bytes
    (140, 0, 60)
    """
    return dataclasses.replace(problem, fixed_bytes=problem.fixed_bytes + gradient_bytes,
                               stages=tuple(_with_backward(s, grad_bytes=0, more_bytes=(1 if gradients_held else 2)
                                                           * s.largest_grad_bytes) for s in problem.stages))


def summed_into_held(problem: Problem, stage_gradient_bytes: Sequence[int]) -> Problem:
    """``problem`` (posed with gradients held from before the step: gradient accumulation) for the backward of the
    first call of several in one step: the later calls' gradients (``stage_gradient_bytes`` per stage) wait in
    autograd's buffers from the start, and once this call's backward has passed a stage, that stage's are summed
    in place into the held gradients and freed (where none is held, the sum becomes the gradient and stays:
    :func:`buffered_gradients`). A stage's own are counted through its backward, beside its workspace and the
    out-of-place sum of its largest (this call's own gradient is in the workspace, measured with gradients held:
    a single call sums each into the held one in place).

    >>> from planner.problem import Stage
    >>> problem = Problem((Stage("s0", 1.0, 2.0), Stage("s1", 1.0, 2.0, largest_grad_bytes=20)), (), fixed_bytes=100)
    >>> summed = summed_into_held(problem, [40, 60])
    >>> summed.fixed_bytes, [s.grad_bytes for s in summed.stages], [s.backward_workspace_bytes for s in summed.stages]
    (200, [-40, -60], [40, 80])
    >>> [e.total_bytes for e in simulate(summed, Schedule.store_all(2)).events][2:]  # s1's backward, then s0's
    [200, 220, 140, 140]
    """
    return dataclasses.replace(problem, fixed_bytes=problem.fixed_bytes + sum(stage_gradient_bytes), stages=tuple(
        _with_backward(s, grad_bytes=-g, more_bytes=g + s.largest_grad_bytes)
        for s, g in zip(problem.stages, stage_gradient_bytes)))


def _with_backward(stage: Stage, *, grad_bytes: int, more_bytes: int) -> Stage:
    """``stage`` making ``grad_bytes`` of gradients that stay, its backward holding ``more_bytes`` more."""
    return dataclasses.replace(stage, grad_bytes=grad_bytes,
                               backward_workspace_bytes=stage.backward_workspace_bytes + more_bytes)


def _weighted(problem: Problem, factor: int) -> Problem:
    """``problem`` with every tensor ``factor`` times its bytes."""
    return dataclasses.replace(problem, tensors=tuple(dataclasses.replace(t, nbytes=t.nbytes * factor)
                                                      for t in problem.tensors))


def _scanned(problem: Problem, budget_bytes: int, planned: Callable[[int], Plan], points: int = 16) -> list[Plan]:
    """The plans ``planned(target)`` makes for ``points`` targets spread from ``problem``'s least peak to eager's,
    then bisecting between the largest target whose plan's ``predicted_peak_bytes`` is within ``budget_bytes`` and
    the next (what a plan needs beside the other calls does not always grow with its target: a plan for less
    memory may hold more after its forward)."""
    low, high = minimum_peak(problem), simulate(problem, Schedule.store_all(problem.num_stages)).peak_bytes
    targets = sorted({low + (high - low) * i // (points - 1) for i in range(points)})
    plans = [planned(target) for target in targets]
    fits = [i for i, plan in enumerate(plans) if plan.predicted_peak_bytes <= budget_bytes]
    if not fits or fits[-1] == len(targets) - 1:
        return plans
    fitting, failing = targets[fits[-1]], targets[fits[-1] + 1]
    while failing - fitting > max(1, budget_bytes // 1000):
        middle = (fitting + failing) // 2
        plans.append(planned(middle))
        if plans[-1].predicted_peak_bytes <= budget_bytes:
            fitting = middle
        else:
            failing = middle
    return plans


def _without_empty_regions(problem: Problem, plan: Plan) -> Plan:
    """``plan`` without the regions that keep and re-run nothing (:func:`~planner.problem.without_empty_regions`),
    re-evaluated: a solver ties one at no recompute time (it stops before any op), and the model would hold its
    inputs, which the checkpoint does not (a residual add alone in a region put a prediction 7% over the measured
    peak). Its bound and gap stay: the plan recomputes no more than before."""
    schedule = without_empty_regions(problem, plan.schedule)
    if schedule == plan.schedule:
        return plan
    evaluated = Plan.from_schedule(problem, schedule, solver=plan.solver, status=plan.status,
                                   solve_seconds=plan.solve_seconds, budget_bytes=plan.budget_bytes)
    if evaluated.predicted_peak_bytes > plan.predicted_peak_bytes:  # never, by the rules of simulate
        return plan
    return dataclasses.replace(evaluated, gap=plan.gap, lower_bound_seconds=plan.lower_bound_seconds,
                               extra=plan.extra)


def _no_worse_than(problem: Problem, budget_bytes: int, plan: Plan, known: Sequence[Schedule]) -> Plan:
    """``plan``, or the fitting schedule of ``known`` that recomputes least when it recomputes less, with the
    solver's bound and a gap against it.

    >>> from planner.problem import Problem, Region, Stage, TensorInfo
    >>> stages = tuple(Stage(f"s{i}", 1.0, 2.0) for i in range(3))
    >>> problem = Problem(stages, tuple(TensorInfo(f"a{i}", 100, i, frozenset({i}), frozenset({i})) for i in range(3)))
    >>> slow = Plan.from_schedule(problem, Schedule.uniform(3), solver="dp", status=SolverStatus.FEASIBLE)
    >>> better = _no_worse_than(problem, 1000, slow, [Schedule((Region(0, 1),))])
    >>> better.solver, better.predicted_recompute_seconds
    ('dp+known', 1.0)
    """
    started = time.perf_counter()
    fitting = [p for p in (Plan.from_schedule(problem, s, solver=f"{plan.solver}+known", status=SolverStatus.FEASIBLE)
                           for s in known) if p.predicted_peak_bytes <= budget_bytes]
    best = min(fitting, key=lambda p: p.predicted_recompute_seconds, default=None)
    if best is None or best.predicted_recompute_seconds >= plan.predicted_recompute_seconds:
        return plan
    gap = relative_gap(best.predicted_recompute_seconds, plan.lower_bound_seconds)
    return dataclasses.replace(best, gap=gap, lower_bound_seconds=plan.lower_bound_seconds,
                               status=SolverStatus.OPTIMAL if gap is not None and gap <= GAP_TOLERANCE
                               else SolverStatus.FEASIBLE,
                               solve_seconds=plan.solve_seconds + time.perf_counter() - started)


ILP_STAGES = 64  # the exact ILP closes the DP's gap on problems up to this many stages (see benchmarks)
ILP_SIZE = 40_000  # and up to this many stages x tensors: beyond, building it takes too long to share the time
AUTO_TIME_LIMIT = 60.0  # seconds auto spends at most by default: then the best plan, with its proven gap


def _solve_auto(problem: Problem, budget_bytes: int, *, time_limit: float | None = AUTO_TIME_LIMIT,
                progress: Callable[[str], None] | None = None, ilp_stages: int = ILP_STAGES,
                target_gap: float = 0.01, **dp_options) -> Plan:
    """The DP with its proven gap; when the gap is above ``target_gap`` (non-chains, coarse rounding) and the
    problem is small enough, the ILP starts from the DP's plan, and the plan keeps the better schedule and the
    better bound; the DP then gets half of ``time_limit``, so that the ILP has the rest."""
    started = time.perf_counter()
    ilp_may_follow = problem.num_stages <= ilp_stages and problem.num_stages * len(problem.tensors) <= ILP_SIZE
    dp_limit = time_limit / 2 if time_limit is not None and ilp_may_follow else time_limit  # leave the ILP time
    plan = solve_dp(problem, budget_bytes, time_limit=dp_limit, progress=progress, target_gap=target_gap,
                    **dp_options)
    if plan.gap is not None and plan.gap <= target_gap or not ilp_may_follow:
        return plan
    remaining = 60.0 if time_limit is None else time_limit - (time.perf_counter() - started)
    if remaining < 1.0:
        return plan
    if progress is not None:
        progress(f"ilp: closing a gap of {plan.gap:.2%}" if plan.gap is not None else "ilp: bounding the DP's plan")
    exact = solve_ilp(problem, budget_bytes, time_limit=remaining, warm=plan.schedule)
    best = exact if exact.predicted_recompute_seconds < plan.predicted_recompute_seconds else plan
    bounds = [b for b in (plan.lower_bound_seconds, exact.lower_bound_seconds) if b is not None]
    lower = max(bounds) if bounds else None
    gap = relative_gap(best.predicted_recompute_seconds, lower)
    status = SolverStatus.OPTIMAL if gap is not None and gap <= GAP_TOLERANCE else SolverStatus.FEASIBLE
    return dataclasses.replace(best, solver=f"{best.solver}+{'ilp' if best is plan else 'dp'}", status=status,
                               gap=gap, lower_bound_seconds=lower, solve_seconds=time.perf_counter() - started)
