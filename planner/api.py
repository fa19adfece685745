"""The public entry points, and the only module that chains the stages: capture → profile → problem → plan → module.

>>> import torch, planner
>>> model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(),
...                                                   torch.nn.Linear(128, 32)) for _ in range(4)])
>>> x = torch.randn(256, 32)
>>> opt = planner.optimize(model, budget="60%", example_inputs=(x,), profile_repeats=1)
>>> opt.plan.predicted_peak_bytes <= opt.plan.budget_bytes
True
>>> opt(x).pow(2).mean().backward()      # trains model's own parameters
>>> model[0][0].weight.grad is not None
True
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .budget import Budget, format_bytes, parse_budget
from .capture import CapturedGraph, capture, input_signature
from .costmodel import add_checkpoint_overheads, build_problem, calibrate, is_random, partition_stages, spread
from .errors import InfeasibleBudgetError, PlannerError
from .plan import Plan, SolverStatus
from .problem import Problem, Region, Schedule, simulate
from .profile import default_loss, measure_stages, fastest_step_seconds, preserved_training_state, profile_graph
from .rewrite import apply_plan
from . import solvers

__all__ = ["optimize", "plan", "apply", "OptimizedModule", "Planned"]


@dataclass(frozen=True)
class Planned:
    """Everything one planning run produced: the captured graph, the problem it posed (None for a plan loaded from
    JSON, which carries its predictions but not the profile), and the plan."""

    captured: CapturedGraph
    problem: Problem | None
    plan: Plan


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes the optimizer keeps per step: its existing state, or what Adam-like (2 per parameter) or momentum
    SGD (1 per parameter) will allocate on their first step.

    >>> import torch
    >>> w = torch.nn.Parameter(torch.zeros(10))
    >>> optimizer_state_bytes(torch.optim.AdamW([w]))
    80
    """
    if optimizer is None:
        return 0
    existing = sum(v.untyped_storage().nbytes() for state in optimizer.state.values() for v in state.values()
                   if isinstance(v, torch.Tensor) and v.dim() > 0)
    if existing:
        return existing
    name = type(optimizer).__name__.lower()
    copies = 2 if "adam" in name or "lamb" in name else 0
    if name == "sgd":
        copies = 1 if any(g.get("momentum", 0) for g in optimizer.param_groups) else 0
    elif name in ("rmsprop", "adagrad", "adadelta"):
        copies = 1 if name != "adadelta" else 2
    params = {id(p): p for g in optimizer.param_groups for p in g["params"] if p.requires_grad}
    return copies * sum(p.numel() * 4 for p in params.values())


def fingerprint(captured: CapturedGraph) -> str:
    """A short hash of the graph's nodes, the parameters' shapes and the input signature."""
    digest = hashlib.sha256()
    for n in captured.graph_module.graph.nodes:
        digest.update(f"{n.op}|{n.name}|{n.target}\n".encode())
    for name, p in captured.graph_module.named_parameters():
        digest.update(f"{name}|{tuple(p.shape)}|{p.dtype}\n".encode())
    digest.update(repr(captured.input_signature).encode())
    return digest.hexdigest()[:16]


def planned_module(captured: CapturedGraph, plan: Plan,
                   stage_nodes: tuple[tuple[str, ...], ...]) -> torch.fx.GraphModule:
    """The rewritten module running ``plan`` (as a solver returned it, for the stages ``stage_nodes`` lists)."""
    plan = dataclasses.replace(plan, stage_nodes=stage_nodes, fingerprint=fingerprint(captured))
    return apply_plan(captured.graph_module, plan)


def _device_of(model: torch.nn.Module) -> str:
    first = next(model.parameters(), None)
    return first.device.type if first is not None else "cpu"


def pose_problem(captured: CapturedGraph, *, loss_fn: Callable | None = None, optimizer=None,
                 max_stages: int = 64, profile_repeats: int = 3,
                 hold_outputs: bool = True) -> tuple[Problem, tuple[tuple[str, ...], ...]]:
    """Profile ``captured`` and pose the planning problem; also returns the node names of each stage."""
    profile = profile_graph(captured, repeats=profile_repeats)
    stages = partition_stages(profile, max_stages=max_stages)
    random_nodes = {n.name for n in captured.compute_nodes() if is_random(n)}
    problem = build_problem(profile, stages, random_nodes=random_nodes,
                            extra_fixed_bytes=optimizer_state_bytes(optimizer),
                            name=type(captured.graph_module).__name__, hold_outputs=hold_outputs)
    stage_of = {node: i for i, spec in enumerate(stages) for node in spec.nodes}
    try:
        measured = measure_stages(captured, stage_of, len(stages), loss_fn=loss_fn, repeats=profile_repeats,
                                  hold_outputs=hold_outputs)
    except ValueError as exc:
        raise PlannerError(str(exc), hint="pass loss_fn= that turns the model's output into a scalar loss") from exc
    stage_nodes = tuple(spec.nodes for spec in stages)
    problem = calibrate(problem, measured)
    if profile_repeats > 0:
        problem = _calibrate_checkpoint_overheads(captured, problem, stage_nodes, loss_fn, profile_repeats)
    return problem, stage_nodes


def _calibrate_checkpoint_overheads(captured: CapturedGraph, problem: Problem, stage_nodes, loss_fn,
                                    repeats: int) -> Problem:
    """Time eager, every stage checkpointed, and every stage checkpointed selectively; what those steps cost
    beyond the recomputation the model predicts is the checkpoint machinery's, charged to the options."""
    n = problem.num_stages
    selective = tuple(1 if len(s.recompute_options) > 1 else 0 for s in problem.stages)
    schedules = {"checkpoint": Schedule.uniform(n),
                 "selective": Schedule(tuple(Region(k, k + 1, (o,)) for k, o in enumerate(selective)))}
    modules = {"eager": captured.graph_module}
    for name, schedule in schedules.items():
        plan = Plan.from_schedule(problem, schedule, solver=name, status=SolverStatus.HEURISTIC)
        modules[name] = planned_module(captured, plan, stage_nodes)
    args, kwargs, loss_of = captured.example_args, captured.example_kwargs, loss_fn or default_loss

    def step(module):
        def run():
            loss_of(module(*args, **kwargs)).backward()
            for p in captured.graph_module.parameters():
                p.grad = None
        return run

    with preserved_training_state(captured.graph_module):
        seconds = fastest_step_seconds({name: step(m) for name, m in modules.items()}, repeats)
    forward = [s.forward_seconds for s in problem.stages]
    hooks_total = max(0.0, seconds["checkpoint"] - seconds["eager"] - sum(forward))
    saved_counts = [sum(1 for t in problem.tensors if k in t.savers) for k in range(n)]
    hooks = spread(hooks_total, saved_counts)
    cached_recompute = sum(s.recompute_options[o].recompute_seconds for s, o in zip(problem.stages, selective))
    selective_total = max(0.0, seconds["selective"] - seconds["eager"] - cached_recompute - hooks_total)
    ops = [len(nodes) if o else 0 for nodes, o in zip(stage_nodes, selective)]
    return add_checkpoint_overheads(problem, hooks, spread(selective_total, ops))


def _in_context(model: torch.nn.Module, budget: Budget, error: InfeasibleBudgetError) -> InfeasibleBudgetError:
    """The solver's error, re-raised with what the user asked for (the model and the budget as written)."""
    minimum = error.minimum_budget_bytes
    return InfeasibleBudgetError(
        f"planning {type(model).__name__} for budget {budget.text!r}: {error.message}",
        hint=f"use a budget of at least {format_bytes(minimum or 0)} ({minimum} bytes)",
        minimum_budget_bytes=minimum)


def _plan_captured(model, captured: CapturedGraph, budget, *, loss_fn, optimizer, solver: str, max_stages: int,
                   profile_repeats: int, solver_options: dict | None, hold_outputs: bool = True) -> Planned:
    parsed = parse_budget(budget)
    problem, stage_nodes = pose_problem(captured, loss_fn=loss_fn, optimizer=optimizer, max_stages=max_stages,
                                        profile_repeats=profile_repeats, hold_outputs=hold_outputs)
    eager = simulate(problem, Schedule.store_all(problem.num_stages)).peak_bytes
    budget_bytes = parsed.resolve(eager)
    try:
        result = solvers.solve(problem, budget_bytes, method=solver, **(solver_options or {}))
    except InfeasibleBudgetError as exc:
        raise _in_context(model, parsed, exc) from None
    result = dataclasses.replace(result, budget_bytes=budget_bytes, budget_text=parsed.text,
                                 stage_nodes=stage_nodes, fingerprint=fingerprint(captured),
                                 torch_version=torch.__version__, device=_device_of(model))
    return Planned(captured, problem, result)


def _as_args(example_inputs: Any) -> tuple:
    if example_inputs is None:
        return ()
    return example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)


def plan(model: torch.nn.Module, budget: int | str, example_inputs: Any = None, *,
         example_kwargs: dict | None = None, optimizer: torch.optim.Optimizer | None = None, solver: str = "auto",
         loss_fn: Callable | None = None, max_stages: int = 64, profile_repeats: int = 3,
         solver_options: dict | None = None, hold_outputs: bool = True) -> Plan:
    """Plan ``model`` under ``budget`` without rewriting it; see :func:`optimize` for the arguments."""
    if example_inputs is None and not example_kwargs:
        raise PlannerError("planner.plan needs example inputs",
                           hint="pass example_inputs=(batch,) with the inputs of one training step")
    captured = capture(model, _as_args(example_inputs), example_kwargs)
    return _plan_captured(model, captured, budget, loss_fn=loss_fn, optimizer=optimizer, solver=solver,
                          max_stages=max_stages, profile_repeats=profile_repeats,
                          solver_options=solver_options, hold_outputs=hold_outputs).plan


class OptimizedModule(torch.nn.Module):
    """Runs ``model`` under a plan; holds the caller's own module (and so its ``Parameter`` objects).

    Plans are cached per input signature (shapes, dtypes, non-tensor arguments); a new signature is planned on
    first use, like ``torch.compile``. Outside training (``eval()`` or ``torch.no_grad()``) the model runs as is.
    """

    def __init__(self, model: torch.nn.Module, budget: int | str, *, planner_options: dict):
        super().__init__()
        self.model = model
        self.budget = budget
        self._options = planner_options
        self._planned: dict[tuple, tuple[Planned, torch.nn.Module]] = {}
        self._last: Planned | None = None

    @property
    def plan(self) -> Plan:
        """The plan used by the most recent call (or made from the example inputs)."""
        if self._last is None:
            raise PlannerError("no plan yet: this module plans on its first training call",
                               hint="call it once with real inputs, or pass example_inputs to optimize()")
        return self._last.plan

    @property
    def planned(self) -> Planned:
        self.plan  # raises when there is none
        assert self._last is not None
        return self._last

    @property
    def code(self) -> str:
        """The generated code of the current plan's module: where each checkpoint region starts and ends."""
        return self._planned[self._last.captured.input_signature][1].code if self._last else ""

    def add_plan(self, planned: Planned) -> None:
        module = apply_plan(planned.captured.graph_module, planned.plan)
        self._planned[planned.captured.input_signature] = (planned, module)
        self._last = planned

    def _plan_for(self, args: tuple, kwargs: dict) -> None:
        captured = capture(self.model, args, kwargs)
        self.add_plan(_plan_captured(self.model, captured, self.budget, **self._options))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not (self.training and torch.is_grad_enabled()):
            return self.model(*args, **kwargs)
        signature = input_signature(args, kwargs)
        if signature not in self._planned:
            self._plan_for(args, kwargs)
        planned, module = self._planned[signature]
        self._last = planned
        return module(*args, **kwargs)

    def _apply(self, fn, recurse=True):
        self._planned.clear()  # plans were profiled for the old device or dtype
        self._last = None
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        return f"budget={self.budget!r}, plans={len(self._planned)}"


def optimize(model: torch.nn.Module, budget: int | str, example_inputs: Any = None, *,
             example_kwargs: dict | None = None, optimizer: torch.optim.Optimizer | None = None,
             solver: str = "auto", loss_fn: Callable | None = None, max_stages: int = 64,
             profile_repeats: int = 3, solver_options: dict | None = None,
             hold_outputs: bool = True) -> OptimizedModule:
    """Return a module that trains ``model``'s own parameters within ``budget`` with the least recomputation.

    Parameters
    ----------
    model : the module to train (in train mode).
    budget : peak bytes of one forward + backward: an int of bytes, ``"8GB"``, ``"512MiB"`` or ``"60%"`` of the
        eager peak. It covers parameters, buffers, inputs, gradients, activations and temporaries, plus the
        optimizer's state when ``optimizer`` is given.
    example_inputs, example_kwargs : the positional and keyword inputs of one training step. Without them the
        module plans on its first call and again whenever the input signature changes.
    optimizer : counted into the budget (AdamW keeps two fp32 tensors per parameter).
    solver : ``"auto"``, ``"ilp"``, ``"dp"`` or a baseline (``"uniform"``, ``"chen_sqrt"``, ``"store_all"``,
        ``"fewest_blocks"``).
    loss_fn : turns the model's output into the loss for profiling; by default the first scalar output (the
        ``loss`` of Hugging Face models given ``labels``), else the sum of the outputs.
    max_stages, profile_repeats, solver_options : how finely to cut the model, how many timed profiling runs,
        and options for the solver (``time_limit``, ``gap``).
    hold_outputs : whether your loop keeps the model's output alive through the backward
        (``out = model(x); out.loss.backward()`` does, ``loss_fn(model(x)).backward()`` does not).
    """
    options = dict(loss_fn=loss_fn, optimizer=optimizer, solver=solver, max_stages=max_stages,
                   profile_repeats=profile_repeats, solver_options=solver_options, hold_outputs=hold_outputs)
    parse_budget(budget)  # fail early on a malformed budget
    optimized = OptimizedModule(model, budget, planner_options=options)
    if example_inputs is not None or example_kwargs:
        captured = capture(model, _as_args(example_inputs), example_kwargs)
        optimized.add_plan(_plan_captured(model, captured, budget, **options))
    return optimized


def apply(model: torch.nn.Module, plan: Plan, example_inputs: Any = None, *,
          example_kwargs: dict | None = None) -> OptimizedModule:
    """Turn a saved ``plan`` into a module for ``model``; the model and input shapes must match the plan's."""
    captured = capture(model, _as_args(example_inputs), example_kwargs)
    found = fingerprint(captured)
    if plan.fingerprint and found != plan.fingerprint:
        raise PlannerError(f"the plan was made for fingerprint {plan.fingerprint}, but this model with these "
                           f"inputs has {found}: the model's graph, parameter shapes or input shapes differ",
                           hint="re-plan with planner.plan(model, budget, example_inputs)")
    optimized = OptimizedModule(model, plan.budget_text or plan.budget_bytes or "100%",
                                planner_options=dict(loss_fn=None, optimizer=None, solver=plan.solver,
                                                     max_stages=64, profile_repeats=3, solver_options=None))
    optimized.add_plan(Planned(captured, None, plan))
    return optimized
