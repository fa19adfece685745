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

import collections
import contextlib
import dataclasses
import hashlib
import inspect
import itertools
import os
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import torch
from torch.utils._pytree import tree_flatten, tree_map_only

from .attention import without_unmasking_mask
from .budget import Budget, format_bytes, parse_budget
from .compiled import CompiledFit, fit_plans
from .capture import (CapturedGraph, OwnCheckpointsWarning, RecaptureWarning, autocast_state, capture, casts_uncached,
                      changed_values, check_initialized, detached_inputs, hooks_signature, input_signature,
                      inputs_restored, is_layout_copy, modules_signature, mutated_nodes, no_larger_than,
                      numbers_signature, outside_autocast, placed_stage_nodes, plan_key, replaced_modules,
                      trained_signature)
from .devices import DeviceSpec, device_spec, spec_for_gpu
from .meta import device_type_of, meta_copy, target_kernels, tensors_of
from .timing import AnalyticStopwatch, Estimate, stopwatch_for
from .costmodel import (Granularity, add_checkpoint_overheads, build_problem, calibrate, created_tensors,
                        granularity_of, never_cached, partition_stages, passes_gradient_through, refinement,
                        scale_seconds, stage_gradient_bytes, with_seconds_of)
from .dropout import is_mask, is_state
from .errors import InfeasibleBudgetError, PlannerError, warn_at_callers_line
from .optimizers import optimizer_state_bytes
from .plan import Plan, SolverStatus, budget_for_usable, usable_bytes
from .problem import Problem, RecomputeOption, Region, Schedule, recompute_seconds, region_caches, simulate
from .meter import device_allocator_peak_bytes, storage_bytes
from .profile import (GraphProfile, StageMeasurement, annotated, default_loss, forget_input_gradients,
                      held_gradients, measure_stages, paired_step_seconds, preserved_training_state, profile_graph,
                      trained_outputs)
from .parts import (PartialCaptureWarning, ReducedBudget, capturable_parts, parts_planned, record_calls,
                    step_peak_bytes)
from .rewrite import apply_plan
from .solvers.baselines import block_checkpoints
from . import fsdp, solvers

__all__ = ["optimize", "plan", "apply", "OptimizedModule", "Planned"]


@dataclass(frozen=True)
class Planned:
    """Everything one planning run produced: the captured graph, the problem it posed (None for a plan loaded from
    JSON, which carries its predictions but not the profile), the plan and, when planned under ``torch.compile``,
    the compiled module whose step was measured to fit."""

    captured: CapturedGraph
    problem: Problem | None
    plan: Plan
    compiled_module: torch.nn.Module | None = None  # the compiled module the plan was measured with (compile=)
    # what making it took (None: not known, as for a plan loaded from JSON); for a reused plan, what planning anew
    # is expected to take
    planning_seconds: float | None = None


def ddp_bucket_bytes(module: torch.nn.Module) -> int:
    """Bytes of ``DistributedDataParallel``'s gradient buckets for ``module``: one flat copy of every gradient,
    resident from the first step on (with ``gradient_as_bucket_view=True`` the buckets are the gradients
    themselves, allocated before the step: never more than this either way).

    >>> ddp_bucket_bytes(torch.nn.Linear(3, 2))  # 6 weights and 2 biases, float32
    32
    """
    trained = {id(p): p for p in module.parameters() if p.requires_grad}
    return sum(p.numel() * p.element_size() for p in trained.values())


def training_state_bytes(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None, ddp: bool) -> int:
    """What training keeps besides the model's own tensors, fixed through the step: the optimizer's state and,
    with ``ddp``, DDP's gradient buckets.

    >>> training_state_bytes(torch.nn.Linear(3, 2), None, ddp=True)
    32
    """
    return optimizer_state_bytes(optimizer) + (ddp_bucket_bytes(module) if ddp else 0)


def fingerprint(captured: CapturedGraph, *, as_device: str | None = None) -> str:
    """A short hash of the graph's nodes, the parameters' shapes and the input signature.

    ``as_device`` hashes the inputs as if they were on that device type: a plan made on the meta device
    (``as_device="meta"``) matches the same model and shapes on a GPU. Layout copies are left out
    (:func:`~planner.capture.is_layout_copy`): which ones a graph makes depends on the strides its device's kernels
    return, and :func:`apply` places them (:func:`~planner.capture.placed_stage_nodes`).
    """
    digest = hashlib.sha256()
    for n in captured.graph_module.graph.nodes:
        if is_layout_copy(n):
            continue
        digest.update(f"{n.op}|{n.name}|{n.target}|{_described_args(n)}\n".encode())
    for name, p in captured.graph_module.named_parameters():
        digest.update(f"{name}|{tuple(p.shape)}|{p.dtype}\n".encode())
    spec, described = captured.input_signature
    if as_device is not None:
        described = tuple((*d[:3], as_device, *d[4:]) if d[0] == "tensor" else d for d in described)
    digest.update(repr((spec, described)).encode())
    return digest.hexdigest()[:16]


def _described_args(node: torch.fx.Node) -> str:
    """``node``'s arguments as :func:`fingerprint` hashes them: other nodes by name (through layout copies, which
    it leaves out), constants (a dropout's probability, a scale, a dimension) by value, devices by nothing (the
    input signature says where the inputs are).

    >>> import torch
    >>> from planner.capture import capture
    >>> class Scaled(torch.nn.Module):
    ...     def forward(self, x, y):
    ...         return x * 0.5 - y
    >>> [_described_args(n) for n in capture(Scaled(), (torch.ones(2), torch.ones(2))).compute_nodes()]
    ['((%x, 0.5), {})', '((%mul, %y), {})']
    """
    def described(value: Any) -> Any:
        if isinstance(value, torch.fx.Node):
            while is_layout_copy(value):
                value = value.args[0]
            return _Named(value.name)
        if isinstance(value, torch.device):
            return _Named("device")
        if isinstance(value, torch.Tensor):
            return _Named(f"tensor{tuple(value.shape)}:{value.dtype}")
        return value
    return repr(torch.fx.node.map_aggregate((node.args, node.kwargs), described))


class _Named(str):
    """Shown by :func:`_described_args` as ``%name``."""

    def __repr__(self) -> str:
        return f"%{self}"


def capture_for(model: torch.nn.Module, args: tuple, kwargs: dict | None,
                device: str | DeviceSpec | None) -> CapturedGraph:
    """:func:`~planner.capture.capture` for a plan made for ``device``: dropout is spelled out so that a
    recomputation can keep its masks only when the plan is for where the tensors are (no analytic ``device``);
    a GPU's fused dropout draws differently (see :mod:`planner.dropout`). The inputs are captured detached
    (:func:`~planner.capture.detached_inputs`): planning's steps run their backward through them."""
    args, kwargs = detached_inputs(args, kwargs or {})
    return capture(model, args, kwargs, replay_dropout=device is None)


def planned_module(captured: CapturedGraph, plan: Plan,
                   stage_nodes: tuple[tuple[str, ...], ...]) -> torch.fx.GraphModule:
    """The rewritten module running ``plan`` (as a solver returned it, for the stages ``stage_nodes`` lists)."""
    plan = dataclasses.replace(plan, stage_nodes=stage_nodes, fingerprint=fingerprint(captured))
    return apply_plan(captured.graph_module, plan)


def _device_of(model: torch.nn.Module) -> str:
    first = next(model.parameters(), None)
    return first.device.type if first is not None else "cpu"


@dataclass(frozen=True)
class Posed:
    """A planning problem and where its numbers came from: ``timing`` names the stopwatch ("wall_clock",
    "cuda_events", "analytic:h100"), ``measured`` the eager step's stage measurements, ``granularity`` where the
    stages were cut, ``block_ranges`` the ``[start, stop)`` of the stages of each whole-block stage (None when the
    finer stages do not nest in the blocks): what maps a schedule of block checkpoints onto these stages,
    ``compiled`` whether its times are for ``torch.compile`` (see :func:`pose`)."""

    problem: Problem
    stage_nodes: tuple[tuple[str, ...], ...]
    timing: str
    measured: StageMeasurement
    granularity: Granularity = Granularity.BLOCK
    block_ranges: tuple[tuple[int, int], ...] | None = None
    compiled: bool = False  # posed for torch.compile: no eager checkpoint machinery charged (see :func:`pose`)
    profile: GraphProfile | None = None  # the graph's profile it was posed from (see ``pose(times_from=)``)


REMEMBERED_POSES = 64  # how many posed problems planning keeps (:func:`remembered_pose`): plain data, a model
# planned in parts poses one per part (until 2026-12-08 it kept 4, and parts were timed afresh each planning)
_remembered: collections.OrderedDict[tuple, Posed] = collections.OrderedDict()


def remembered_pose(captured: CapturedGraph, *, optimizer=None, ddp: bool = False, **options) -> Posed:
    """:func:`pose`, remembered: planning the same graph again (another budget, another solver, the budget an
    :class:`~planner.errors.InfeasibleBudgetError` named) reuses its profile and calibration, which take minutes
    for a large model, and its plans are priced alike. The graph is known by its :func:`fingerprint` (nodes,
    parameter shapes, input signature), which parameters train, the fixed training state, the options, the torch
    threads and the calibration's settings; the last :data:`REMEMBERED_POSES` are kept. :func:`forget_poses` makes
    the next planning measure afresh. Posed with ``grads_held`` where the same graph was posed without, or the
    other way round, it takes that problem's times (``pose(times_from=)``): the step is measured with or without
    the held gradients, the calibration is not redone.

    >>> import torch
    >>> from planner.capture import capture
    >>> forget_poses()
    >>> model, x = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()), torch.randn(4, 8)
    >>> first = remembered_pose(capture(model, (x,)), profile_repeats=0)
    >>> remembered_pose(capture(model, (x,)), profile_repeats=0) is first
    True
    >>> remembered_pose(capture(model, (x,)), profile_repeats=0, hold_outputs=False) is first
    False
    """
    key = _pose_key(captured, optimizer, ddp, options)
    if key is None:
        return pose(captured, optimizer=optimizer, ddp=ddp, **options)
    if key not in _remembered:
        twin = _pose_key(captured, optimizer, ddp, {**options, "grads_held": not options.get("grads_held")})
        times = {"times_from": _remembered[twin]} if twin in _remembered else {}
        _remembered[key] = pose(captured, optimizer=optimizer, ddp=ddp, **options, **times)
        while len(_remembered) > REMEMBERED_POSES:
            _remembered.popitem(last=False)
    _remembered.move_to_end(key)
    return _remembered[key]


def forget_poses() -> None:
    """Forget every remembered posed problem (see :func:`remembered_pose`)."""
    _remembered.clear()


def _pose_key(captured: CapturedGraph, optimizer, ddp: bool, options: dict) -> tuple | None:
    """What a posed problem depends on, or ``None`` where an option cannot be told apart (an unhashable
    ``loss_fn``)."""
    key = (fingerprint(captured), tuple(p.requires_grad for p in captured.graph_module.parameters()),
           training_state_bytes(captured.graph_module, optimizer, ddp), ddp, tuple(sorted(options.items())),
           torch.get_num_threads(), CALIBRATION_TOLERANCE, CALIBRATION_ROUNDS, CALIBRATION_MIN_ROUNDS,
           CALIBRATION_SECONDS)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def pose_problem(captured: CapturedGraph, *, loss_fn: Callable | None = None, optimizer=None, ddp: bool = False,
                 max_stages: int = 64, profile_repeats: int = 3, hold_outputs: bool = True,
                 device: str | DeviceSpec | None = None,
                 granularity: str | Granularity = Granularity.BLOCK) -> tuple[Problem, tuple[tuple[str, ...], ...]]:
    """Profile ``captured`` and pose the planning problem; also returns the node names of each stage."""
    posed = pose(captured, loss_fn=loss_fn, optimizer=optimizer, ddp=ddp, max_stages=max_stages,
                 profile_repeats=profile_repeats, hold_outputs=hold_outputs, device=device, granularity=granularity)
    return posed.problem, posed.stage_nodes


def captured_device_type(captured: CapturedGraph) -> str:
    """The device type ("cpu", "cuda", "meta") of the captured module's tensors and example inputs."""
    return device_type_of(captured.graph_module, (captured.example_args, captured.example_kwargs))


def pose(captured: CapturedGraph, *, loss_fn: Callable | None = None, optimizer=None, ddp: bool = False,
         max_stages: int = 64, profile_repeats: int = 3, hold_outputs: bool = True,
         device: str | DeviceSpec | None = None, sharding: fsdp.Sharding | None = None,
         granularity: str | Granularity = Granularity.BLOCK, compiled: bool = False, grads_held: bool = False,
         times_from: Posed | None = None) -> Posed:
    """Profile ``captured`` and pose the planning problem, timed for ``device`` (a name or a
    :class:`~planner.devices.DeviceSpec`: analytic times) or, without it, measured where the tensors are.
    The optimizer's state and, with ``ddp``, DDP's gradient buckets count as fixed memory; with ``sharding`` (the
    model's ``fully_shard`` units, profiled gathered) each sharded parameter and gradient counts at its shard's
    size. ``granularity`` says where stages may be cut (see :class:`~planner.costmodel.Granularity`).

    ``compiled``: the plans will run under ``torch.compile``, which traces each region into the compiled graph, so
    none of eager checkpointing's machinery runs (its hooks, the caching regions' dispatch modes): its costs are
    neither timed nor charged (:func:`_calibrate_checkpoint_overheads` is skipped), and a recomputation costs its
    nodes' own time. Charged them, a test-size ResNet planned under compile at 15.32 MiB recomputed one block
    whole; priced without them, it caches the blocks' convolutions in three regions and recomputes the
    normalisations, which inductor folds into its backward kernels. Planning under compile, which no longer times
    the calibration's steps, took 2-9 times less time for the test-size examples (GPT-2: 31 s against 103 s).

    ``grads_held``: the step begins with every trained parameter holding its gradient (gradient accumulation's
    micro-batches after the first, or ``zero_grad(set_to_none=False)``): the gradients are fixed memory, and the
    eager step is measured with them held, each new gradient a temporary the backward adds into them.

    ``times_from``: the pose of the same graph with the same options but ``grads_held`` the other way (held
    gradients change the step's memory, not what its ops or recomputation cost): its profile and calibrated times
    are taken (:func:`~planner.costmodel.with_seconds_of`), and only the eager step is measured again, with or
    without the gradients held. Calibrating again is most of the time planning a small model takes, and a profile
    timed afresh may rank the nodes to cache otherwise."""
    cut_at = granularity_of(granularity)
    spec = device_spec(device) if device is not None else None
    device_type = captured_device_type(captured)
    stopwatch = stopwatch_for(device_type, spec)
    kernels = target_kernels(device_type, spec)
    if times_from is not None and times_from.profile is not None:
        profile = annotated(captured.graph_module, times_from.profile)
    else:
        profile = profile_graph(captured, repeats=profile_repeats, stopwatch=stopwatch, kernels=kernels)
    profiled = profile
    if sharding is not None:
        profile = fsdp.per_rank_profile(profile, captured.graph_module, sharding)
    stages = partition_stages(profile, max_stages=max_stages, granularity=cut_at)
    blocks = stages if cut_at is Granularity.BLOCK else partition_stages(profile, max_stages=max_stages)
    block_ranges = refinement(blocks, stages)
    # never cached: random ops (the recomputation must draw the same numbers) and outputs later written in place
    nodes = list(captured.compute_nodes())
    random_nodes = never_cached(nodes) | mutated_nodes(captured.graph_module)
    states = {n.name for n in nodes if is_state(n)}
    masks = {n.name for n in nodes if is_mask(n)}
    pass_through = {n.name for n in nodes if passes_gradient_through(n)}
    stage_of = {node: i for i, spec in enumerate(stages) for node in spec.nodes}
    try:
        measured = measure_stages(captured, stage_of, len(stages), loss_fn=loss_fn, repeats=profile_repeats,
                                  hold_outputs=hold_outputs, stopwatch=stopwatch, kernels=kernels,
                                  created=created_tensors(profile), grads_held=grads_held)
    except ValueError as exc:
        raise PlannerError(str(exc), hint="pass loss_fn= that turns the model's output into a scalar loss") from exc
    profile = _sized_gradients(profile, measured)
    held_grad_bytes = sum(profile.param_grad_bytes.values()) if grads_held else 0  # fixed: held from the start
    problem = build_problem(profile, stages, random_nodes=random_nodes, always_kept=states, masks=masks,
                            pass_through=pass_through, gradients_held=grads_held,
                            extra_fixed_bytes=training_state_bytes(captured.graph_module, optimizer, ddp)
                            + held_grad_bytes,
                            name=type(captured.graph_module).__name__, hold_outputs=hold_outputs)
    stage_nodes = tuple(s.nodes for s in stages)
    problem = calibrate(problem, measured)
    if times_from is not None:
        problem = with_seconds_of(problem, times_from.problem)
    elif profile_repeats > 0 and not compiled and not isinstance(stopwatch, AnalyticStopwatch):
        # eager checkpointing's costs: the roofline has no hooks, and compiled regions run none of the machinery
        problem = _calibrate_checkpoint_overheads(captured, problem, stage_nodes, loss_fn, profile_repeats)
    forget_input_gradients(tree_flatten((captured.example_args, captured.example_kwargs))[0])  # the timed steps'
    return Posed(problem, stage_nodes, stopwatch.name, measured, cut_at, block_ranges, compiled, profiled)


# Calibration rounds go on (up to CALIBRATION_ROUNDS times the profile repeats, within CALIBRATION_SECONDS) until
# the standard error of every measured cost is within CALIBRATION_TOLERANCE of the eager step. The costs per step and
# per region are a few percent of a step: at 2% and 16 rounds a repeat, four calibrations of LargeBlock (test size)
# put them at 0-1.25 ms and 0-0.64 ms; at 0.5% and 32, at 0-0.36 ms and 0.38-0.52 ms (planning 4 s -> 10-30 s).
# However long a step, at least CALIBRATION_MIN_ROUNDS rounds: with one torch thread, demo-size GPT-2's 2.3 s steps
# gave 30 s three rounds, checkpointing every other block was timed at 32% +/- 21% of the step over eager, not
# clearly above zero, so the calibration was dropped and every plan was predicted 0.7-3.3% of the step under its
# measurement. With eight rounds it was timed at 26.2% +/- 3.0% (29.1% predicted), and the demo report had 9 of 12
# overheads within 20% (8 of 12 before); planning a demo-size model takes 3-4 minutes with one thread.
CALIBRATION_TOLERANCE = 0.005
CALIBRATION_ROUNDS = 32
CALIBRATION_MIN_ROUNDS = 8
CALIBRATION_SECONDS_VARIABLE = "PLANNER_CALIBRATION_SECONDS"


def calibration_seconds(environ=os.environ) -> float:
    """The most seconds the calibration times each group of schedules (after its first
    ``CALIBRATION_MIN_ROUNDS`` rounds): 30, or ``$PLANNER_CALIBRATION_SECONDS`` (faster planning, costs of
    checkpointing known less precisely; the tests' subprocesses plan with 1).

    >>> calibration_seconds({}), calibration_seconds({"PLANNER_CALIBRATION_SECONDS": "2.5"})
    (30.0, 2.5)
    >>> calibration_seconds({"PLANNER_CALIBRATION_SECONDS": "soon"})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    planner.errors.PlannerError: PLANNER_CALIBRATION_SECONDS='soon' is not a number of seconds. Hint: ...
    """
    text = environ.get(CALIBRATION_SECONDS_VARIABLE)
    if text is None:
        return 30.0
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not seconds >= 0 or seconds == float("inf"):
        raise PlannerError(f"{CALIBRATION_SECONDS_VARIABLE}={text!r} is not a number of seconds",
                           hint="unset it for 30 s a group, or set it to a number such as 5; 0 still times the "
                                "first rounds")
    return seconds


CALIBRATION_SECONDS = calibration_seconds()


def _calibrate_checkpoint_overheads(captured: CapturedGraph, problem: Problem, stage_nodes, loss_fn,
                                    repeats: int) -> Problem:
    """Time eager, every other stage checkpointed (:func:`_apart`), the middle half of the stages checkpointed as
    one region (:func:`_long_region`) and one stage checkpointed alone, then the middle half of the stages that have
    caching options checkpointed as one region with the options that cache the most nodes and with those that cache
    the fewest, and every other caching stage as a region of its own with the one caching the fewest; what those
    steps cost beyond the recomputation the model predicts (each region stopping early: ``Stage.stopped_seconds``)
    is the checkpoint machinery's (and the error of summing the nodes' own times): a cost per step and one per
    region (``Problem.per_step_seconds``, ``Problem.region_seconds``: :func:`_fixed_costs`), a rate per saved tensor
    charged to every option of every stage, and a cost per caching region (``Problem.caching_region_seconds``), per
    caching stage and per cached node (:func:`_caching_costs`). A measured shortfall shrinks the costs only as far
    as the measurement clearly shows (:func:`_correction`, :func:`_cached_node_charges`), and an excess counts only
    as far as its noise lets it (:func:`_evident_share`).

    Plain checkpointing is timed against eager on its own, as a training loop runs it: interleaved with the
    caching options (the cache's allocations), Llama's checkpoint overhead measured 52% on the CPU, against 61-64%
    in rounds of eager and checkpoint alone. One caching option per stage is then timed against eager, its excess
    scaled to the first eager median, the option that caches the most (timed one by one, five options took six
    steps a round, and at BERT's demo size 30 s gave 4 rounds whose medians were off by up to 170 ms a step,
    enough to make caching look free). The caching options are timed in one long region, as the plans between the
    extremes use them: timed in regions of one stage each, LargeBlock's (test size) plans at half and three
    quarters of the way from the smallest peak to eager's, one region of three or four stages caching two matmuls
    each, measured 1.2-2.8% of the step above their prediction in each of nine fidelity runs; timed in one long
    region, from 1.2% below to 0.8% above it in three. Timed in one long region alone, what a caching stage costs
    became a cost per caching region, and plans of several short caching regions were over-predicted (Llama at
    ``sublayer`` granularity, a quarter of the way from the smallest peak: 36.8% against 28.9% and 36.7% against
    30.4%), hence the regions of one stage beside it.

    Each caching schedule is timed against its plain twin (the same regions, caching nothing) in the same rounds,
    and counts what the model predicts for the twin plus what it measured beyond it: what the plain costs fitted
    above get wrong for those stages (GPT-2's last block recomputed 1.9 ms, 18%, over its prediction) and how fast
    the machine ran while they were timed (eager's median moved by up to 12% between groups) are then not taken for
    the cost of caching. Timed six times in a row against eager alone, GPT-2's (test size) long region caching the
    fewest nodes measured 0.0 to 2.5 ms over its prediction; against its twin, 0.7 to 1.4 ms."""
    n = problem.num_stages
    caching = [k for k, s in enumerate(problem.stages) if len(s.recompute_options) > 1]
    most_cached = [_most_cached(problem.stages[k]) for k in caching]  # the options timed, per caching stage
    least_cached = [_least_cached(problem.stages[k]) for k in caching]
    timed_stages = _apart(range(n))  # regions apart from each other, as a plan's usually are
    schedules = {"checkpoint": Schedule(tuple(Region(k, k + 1) for k in timed_stages))}
    if n > 1:  # one region of half the stages: what each stage of a long region costs, apart from the region's own
        schedules["long"] = Schedule((_long_region(0, n),))
    if len(timed_stages) > 1:  # one region alone: what checkpointing costs once a step
        middle = timed_stages[len(timed_stages) // 2]
        schedules["single"] = Schedule((Region(middle, middle + 1),))
    plain = [name for name in ("checkpoint", "long", "single") if name in schedules]  # timed together, fitted
    timed_caching: list[int] = []
    if caching:  # a long region with the options that cache the most nodes, and with those caching the fewest
        span = _long_region(caching[0], caching[-1] + 1)
        timed_caching = [k for k in caching if k in span.stages]
        for name, chosen in (("caching", most_cached), ("caching_least", least_cached)):
            option = dict(zip(caching, chosen))  # a stage without caching options has only its first
            schedules[name] = Schedule((Region(span.start, span.stop, tuple(option.get(k, 0) for k in span.stages)),))
        if _cached_count(problem, schedules["caching_least"]) == _cached_count(problem, schedules["caching"]):
            del schedules["caching_least"]  # one option a stage: the two costs cannot be told apart
        apart = _apart(caching)
        if len(apart) > 1:  # regions of one stage each: the cost per caching region apart from that per stage
            option = dict(zip(caching, least_cached))
            schedules["caching_apart"] = Schedule(tuple(Region(k, k + 1, (option[k],)) for k in apart))
    caching_names = [name for name in ("caching", "caching_least", "caching_apart") if name in schedules]
    caching_shapes = [_caching_shape(problem, schedules[name]) for name in caching_names]
    twin_of = {}  # each caching schedule's plain twin (its regions without caching), timed in the same rounds
    for name in caching_names:
        twin = Schedule(tuple(Region(r.start, r.stop) for r in schedules[name].regions))
        twin_of[name] = next((t for t in twin_of.values() if schedules[t] == twin), f"{name}_plain")
        schedules[twin_of[name]] = twin
    twin_names = list(dict.fromkeys(twin_of.values()))
    modules = {"eager": captured.graph_module}
    for name, schedule in schedules.items():
        plan = Plan.from_schedule(problem, schedule, solver=name, status=SolverStatus.HEURISTIC)
        modules[name] = planned_module(captured, plan, stage_nodes)
    args, kwargs, loss_of = captured.example_args, captured.example_kwargs, loss_fn or default_loss

    on_cuda = captured_device_type(captured) == "cuda"

    def step(module):
        def run():
            with casts_uncached():  # as the planned modules run (the eager one runs no hooks that say so)
                outputs = module(*args, **kwargs)
            loss = loss_of(outputs)
            del outputs
            with outside_autocast():
                loss.backward()
            for p in captured.graph_module.parameters():
                p.grad = None
            if on_cuda:
                torch.cuda.synchronize()  # time the kernels, not their launches
        return run

    def timed(names, paired_with=None):
        return paired_step_seconds({name: step(modules[name]) for name in names},
                                   max(repeats, CALIBRATION_MIN_ROUNDS), "eager", paired_with=paired_with,
                                   tolerance=CALIBRATION_TOLERANCE, max_rounds=CALIBRATION_ROUNDS * repeats,
                                   max_seconds=CALIBRATION_SECONDS)

    with preserved_training_state(captured.graph_module):
        extra = timed(["eager", *plain])
        if caching:
            with_caching = timed(["eager", *caching_names, *twin_names], paired_with=twin_of)
            to_first_eager = extra["eager"].median / with_caching["eager"].median
    if not extra["checkpoint"].clearly_above(0):  # recomputing every stage is lost in the noise: keep the profile's
        return problem
    eager = sum(s.forward_seconds + s.backward_seconds for s in problem.stages)
    if eager > 0:  # the profile's fastest-of-a-few times, scaled to the typical eager step
        problem = scale_seconds(problem, extra["eager"].median / eager)
    saved_counts = [sum(1 for t in problem.tensors if k in t.savers) for k in range(n)]
    alone = [s.stopped_seconds(0) for s in problem.stages]  # each stage re-run as a region of its own (stops early)
    per_step, per_region = _fixed_costs([extra[name] for name in plain], [schedules[name] for name in plain],
                                        [recompute_seconds(problem, schedules[name]) for name in plain], saved_counts)
    problem = dataclasses.replace(problem, region_seconds=per_region, per_step_seconds=per_step)
    hooks = _correction(extra["checkpoint"].less(per_step + len(timed_stages) * per_region), alone, saved_counts,
                        timed=timed_stages)
    problem = add_checkpoint_overheads(problem, [_charges([o.recompute_seconds for o in s.recompute_options],
                                                          hook, timed_cost)
                                                 for s, hook, timed_cost in zip(problem.stages, hooks, alone)],
                                       [0.0] * n)
    if not caching:
        return problem
    regions = [len(schedules[name].regions) for name in caching_names]
    # what each caching schedule costs beyond eager, its regions' own costs and the step's: what it measured beyond
    # its plain twin, plus what the model now predicts for the twin's stages
    beyond = [Estimate(with_caching[name].median * to_first_eager
                       + recompute_seconds(problem, schedules[twin_of[name]]) - r * per_region,
                       with_caching[name].standard_error * to_first_eager) for name, r in zip(caching_names, regions)]
    predicted = [recompute_seconds(problem, schedules[name]) - r * per_region
                 for name, r in zip(caching_names, regions)]
    selective: list[float | list[float]] = [0.0] * n
    if beyond[0].median > predicted[0]:  # the cache costs more than its stages' nodes: per region, stage and node
        per_caching_region, per_stage, per_node = _caching_costs(beyond, predicted, caching_shapes)
        problem = dataclasses.replace(problem, caching_region_seconds=per_caching_region)
        for k in caching:
            selective[k] = [(per_stage + per_node * len(o.cached_nodes)) if o.cached_nodes else 0.0
                            for o in problem.stages[k].recompute_options]
        return add_checkpoint_overheads(problem, [0.0] * n, selective)
    most_cached_options = [problem.stages[k].recompute_options[i] for k, i in zip(caching, most_cached)]
    cached = [o.recompute_seconds for o in most_cached_options]  # a shortfall: the nodes' times over-count
    for k, timed, share in zip(caching, most_cached_options,
                               _correction(beyond[0], cached, [len(o.cached_nodes) for o in most_cached_options],
                                           timed=[j for j, k in enumerate(caching) if k in timed_caching])):
        selective[k] = _cached_node_charges(problem.stages[k].recompute_options, share, timed)
    return add_checkpoint_overheads(problem, [0.0] * n, selective)


def _most_cached(stage) -> int:
    """The index of ``stage``'s option that caches the most nodes."""
    options = stage.recompute_options
    return max(range(len(options)), key=lambda i: len(options[i].cached_nodes))


def _least_cached(stage) -> int:
    """The index of ``stage``'s option that caches the fewest nodes, of those that cache any."""
    options = stage.recompute_options
    return min((i for i in range(len(options)) if options[i].cached_nodes), key=lambda i: len(options[i].cached_nodes))


def _cached_count(problem: Problem, schedule: Schedule) -> int:
    """How many nodes ``schedule``'s options cache, over all its regions."""
    return sum(len(problem.stages[k].recompute_options[r.option_of(k)].cached_nodes)
               for r in schedule.regions for k in r.stages)


@dataclass(frozen=True)
class CachingShape:
    """What a schedule's caching amounts to: how many regions cache, how many stages cache in them, and how many
    nodes they cache in all."""

    regions: int
    stages: int
    nodes: int


def _caching_shape(problem: Problem, schedule: Schedule) -> CachingShape:
    """``schedule``'s caching regions, caching stages and cached nodes (:class:`CachingShape`)."""
    cached = [len(problem.stages[k].recompute_options[r.option_of(k)].cached_nodes)
              for r in schedule.regions for k in r.stages]
    regions = sum(1 for r in schedule.regions if region_caches(problem, r))
    return CachingShape(regions, sum(1 for c in cached if c), sum(cached))


def _caching_costs(measured: Sequence[Estimate], predicted: Sequence[float],
                   shapes: Sequence[CachingShape]) -> tuple[float, float, float]:
    """What a region that caches costs (``Problem.caching_region_seconds``: its cache, set up in the forward and
    handed to the re-run), each stage that caches in it (set apart from the region by the regions of one stage) and
    each node it caches (its op called through a dispatch mode in the forward and the re-run, its output stored and
    handed back: :mod:`planner.rewrite`), from schedules of the given ``shapes`` that ``measured`` so much over
    eager beyond the recomputation ``predicted`` (their options): the least-squares fit with none below zero, scaled
    so that the first schedule (one long region, the options caching the most) keeps what it measured; with that
    schedule alone, or no fit above zero, all of it is per node. Each excess counts as far as its noise lets it
    (:func:`_evident_share`). Where no schedule has regions apart from its stages, it is per stage, not region.

    At ``sublayer`` granularity (test size), Llama's long region of 17 stages caching 18 nodes measured 2.27 ms
    over its recomputation, caching 94 nodes 5.88 ms: fitted as a cost per region and per node alone, a caching
    region cost 1.25 ms, and the plan at a quarter of the way from the smallest peak to eager's (three caching
    regions of one caching stage each) was predicted at 35.8% overhead against 30.6% measured; with its caching
    stages also timed as regions of one stage each (17 regions, 20 nodes: 2.91 ms), the fit was 0 ms a region,
    0.10 ms a caching stage and 0.056 ms a node, and that plan was predicted at 28.1% against 30.3%.

    >>> from planner.timing import Estimate
    >>> shapes = [CachingShape(1, 4, 20), CachingShape(1, 4, 8), CachingShape(4, 4, 8)]
    >>> costs = lambda shape: shape.regions * 0.5 + shape.stages * 0.25 + shape.nodes * 0.1
    >>> [round(c, 9) for c in _caching_costs([Estimate(3.0 + costs(s), 0.0) for s in shapes], [3.0] * 3, shapes)]
    [0.5, 0.25, 0.1]
    >>> [round(c, 9) for c in _caching_costs([Estimate(5.0, 0.0)], [3.0], shapes[:1])]  # one schedule: per node
    [0.0, 0.0, 0.1]
    >>> two = [Estimate(5.0, 0.0), Estimate(9.0, 0.0)]  # caching fewer costs more: no slope, and no region apart
    >>> [round(c, 9) for c in _caching_costs(two, [3.0] * 2, shapes[:2])]  # all per caching stage
    [0.0, 0.5, 0.0]
    """
    excess = np.array([(m.median - p) * _evident_share(m.median - p, m.standard_error)
                       for m, p in zip(measured, predicted)])
    if len(excess) > 1:
        columns = np.array([[s.regions, s.stages, s.nodes] for s in shapes], dtype=float)
        free = [0, 1, 2] if np.linalg.matrix_rank(columns) == 3 else [1, 2]  # regions told from stages, or per stage
        fit = _nonnegative_fit(columns, excess, free)
        total = float(columns[0] @ fit)
        if total > 0:  # scaled so that the first keeps what it measured
            return tuple(round(float(c) * float(excess[0]) / total, 12) for c in fit)
    return 0.0, 0.0, round(float(excess[0]) / max(1, shapes[0].nodes), 12)


def _cached_node_charges(options: Sequence[RecomputeOption], share: float, timed: RecomputeOption) -> list[float]:
    """What each caching option is charged for the cache machinery, from the ``share`` a measurement charged to
    the ``timed`` option: an excess is a cost per cached node (its op runs through a dispatch mode in the forward
    and again in the recomputation), so each option pays for the nodes it caches; a shortfall means the nodes' own
    times over-count, and shrinks each option in proportion (:func:`_charges`).

    >>> from planner.problem import RecomputeOption
    >>> options = [RecomputeOption("all", frozenset(), 4.0), RecomputeOption("some", frozenset("a"), 3.0),
    ...            RecomputeOption("most", frozenset("abcd"), 1.0)]
    >>> _cached_node_charges(options, 2.0, options[2])
    [0.0, 0.5, 2.0]
    >>> _cached_node_charges(options, -0.25, options[2])
    [-1.0, -0.75, -0.25]
    """
    if share < 0:
        return _charges([o.recompute_seconds for o in options], share, timed.recompute_seconds)
    count = max(1, len(timed.cached_nodes))
    return [share * len(o.cached_nodes) / count for o in options]


def _charges(costs: Sequence[float], share: float, timed_cost: float) -> list[float]:
    """What each of a stage's options (now costing ``costs``) is charged, from the ``share`` that a measurement
    charged to the one timed (costing ``timed_cost``): an excess is the checkpoint machinery's, the same for every
    option (hooks per saved tensor); a shortfall means the nodes' own times over-count, and shrinks each option in
    proportion. Charged flat, a noisy low measurement would make the options that recompute little free, and push
    the others' share onto them.

    >>> _charges([4.0, 3.0, 1.0], 1.0, 3.0)
    [1.0, 1.0, 1.0]
    >>> _charges([4.0, 3.0, 1.0], -1.5, 3.0)
    [-2.0, -1.5, -0.5]
    """
    if share >= 0 or timed_cost <= 0:
        return [share] * len(costs)
    return [cost * share / timed_cost for cost in costs]


def _long_region(start: int, stop: int) -> Region:
    """The region timed to tell a cost per region from one per stage: the middle half of stages ``start`` to
    ``stop - 1`` (at least two where there are two), as a plan between the extremes checkpoints a run of stages.

    Timed with every other stage checkpointed and one stage alone (the same number of stages as the first, the
    same number of regions as the second), the two costs separate; timed instead with three regions of two stages,
    they hardly did (regions and stages rose together): calibrations of LargeBlock (test size) put a region at
    0.07-0.57 ms and the rate per saved tensor at 0-0.08 ms, and plans of one to three regions of three or four
    stages measured 0.2-0.5 ms (1-2% of the step) above their prediction; with the long region, three
    calibrations in a row put them at 0.32-0.40 ms and 0.031-0.035 ms.

    >>> _long_region(0, 8), _long_region(0, 3), _long_region(4, 5)
    (Region(start=2, stop=6, options=()), Region(start=0, stop=2, options=()), Region(start=4, stop=5, options=()))
    """
    length = min(stop - start, max(2, (stop - start) // 2))
    first = start + (stop - start - length) // 2
    return Region(first, first + length)


def _apart(stages: Iterable[int]) -> list[int]:
    """The stages to time checkpointed: of ``stages`` (ascending), each one whose predecessor was not taken, so no
    two regions are next to each other.

    Timed all at once, adjacent regions each cost less than one on its own: at test size, LargeBlock's eight blocks
    checkpointed cost 1.5 ms a block over eager, every other block 1.7 ms, one block 2.0 ms (the checkpoint's own
    code runs after the backward of the stage behind it, and runs faster when it has just run for that stage).
    Plans mostly checkpoint a few stages apart, and were under-predicted by up to 43% with every stage timed.

    >>> _apart(range(5)), _apart([1, 2, 3, 6, 7])
    ([0, 2, 4], [1, 3, 6])
    """
    taken: list[int] = []
    for k in stages:
        if not taken or taken[-1] != k - 1:
            taken.append(k)
    return taken


def _fixed_costs(measured: Sequence[Estimate], schedules: Sequence[Schedule], predicted: Sequence[float],
                 counts: Sequence[int]) -> tuple[float, float]:
    """What checkpointing costs once a step (``Problem.per_step_seconds``) and once per region
    (``Problem.region_seconds``: the checkpoint call, its recomputation's setup), from the ``schedules``' measured
    excess over eager (``measured``) beyond the recomputation predicted for each (``predicted``: the forwards of
    their stages, stopping early). Each excess is taken as the cost per step (when there are three schedules), a
    cost per region and a rate per saved tensor (``counts``, per stage): the least-squares fit with none below
    zero, and no more of the first schedule's excess than it measured (the rest is its rate per saved tensor).
    Both are 0 when the first schedule shows no excess. A cost is kept where the measurements' noise hides it (below
    two standard errors): left out, the cost per step came out 0 in most calibrations of ResNet at sublayer
    granularity, where plans of two to four regions measured 0.6 to 1.6 ms (1-3% of the step) above prediction and
    the plan of 21 regions 0.8 ms below; a noisy cost per step moves every plan's prediction alike, not the choice
    of plan. Both are scaled by the share of the first schedule's excess that its noise lets through
    (:func:`_evident_share`).

    At sublayer granularity, LargeBlock's smallest-peak plan (five regions of three to six stages, recomputing
    every stage) was predicted at 11.0 ms over eager and measured 8.7 ms with the machinery charged per stage;
    with a cost per region, 8.0 ms against 7.5 ms. One region alone cost more than a region among many: on ResNet
    at sublayer granularity (test size, 28 ms a step), 1.2 ms beyond its recomputation, against 0.75 ms a region
    for two, 0.33 ms for eight and 0.20 ms for 21, so plans of a few regions were under-predicted by up to 1 ms.

    >>> from planner.timing import Estimate
    >>> singles = Estimate(2 * (1.0 + 0.5 + 2 * 0.25), 0.0)  # stages 0 and 2: forward, region, two saved tensors
    >>> pairs = Estimate(2 * 1.0 + 0.5 + 4 * 0.25, 0.0)  # stages 0 .. 1 in one region
    >>> timed = (Schedule.from_segments([(0, 1), (2, 3)]), Schedule.from_segments([(0, 2)]))
    >>> _fixed_costs((singles, pairs), timed, [2.0, 2.0], [2, 2, 2])
    (0.0, 0.5)
    >>> _fixed_costs((singles, Estimate(5.0, 0.0)), timed, [2.0, 2.0], [2, 2, 2])
    (0.0, 0.0)
    >>> _fixed_costs((singles, Estimate(1.0, 0.0)), timed, [2.0, 2.0], [2, 2, 2])  # pairs short: least squares
    (0.0, 0.6)
    >>> alone = Estimate(1.0 + 0.75 + 0.5 + 2 * 0.25, 0.0)  # and once a step: 0.75
    >>> _fixed_costs((singles.less(-0.75), pairs.less(-0.75), alone), (*timed, Schedule.from_segments([(2, 3)])),
    ...              [2.0, 2.0, 1.0], [2, 2, 2])
    (0.75, 0.5)
    >>> noisy = [Estimate(e.median, 0.5) for e in (singles.less(-0.75), pairs.less(-0.75), alone)]
    >>> _fixed_costs(noisy, (*timed, Schedule.from_segments([(2, 3)])), [2.0, 2.0, 1.0], [2, 2, 2])  # 2.75 +/- 0.5
    (0.72520661157, 0.48347107438)
    """
    excess = np.array([m.median - p for m, p in zip(measured, predicted)])
    if len(excess) < 2 or excess[0] <= 0:
        return 0.0, 0.0
    evident = _evident_share(float(excess[0]), measured[0].standard_error)
    columns = np.array([[1.0, len(s.regions), sum(counts[k] for r in s.regions for k in r.stages)]
                        for s in schedules])
    fit = _nonnegative_fit(columns, excess, [0, 1, 2] if len(excess) > 2 else [1, 2])
    per_step, per_region = float(fit[0]), float(fit[1])
    first = excess[0]
    if per_step + per_region * columns[0, 1] > first:  # the first schedule's total stays what it measured
        shrink = first / (per_step + per_region * columns[0, 1])
        per_step, per_region = per_step * shrink, per_region * shrink
    return round(per_step * evident, 12), round(per_region * evident, 12)  # (least squares leave bits to chance)


def _evident_share(excess: float, standard_error: float) -> float:
    """How much of a measured ``excess`` (above zero) to believe, given its ``standard_error``: all of it when it
    stands far out of the noise, less as the noise nears it, none within one standard error
    (``1 - (standard error / excess)**2``, at least 0): ``excess * share`` is ``(excess**2 - standard error**2) /
    excess``, and ``excess**2 - standard error**2`` is the unbiased estimate of the true excess squared.

    Demo-size BERT's steps (0.86 s) varied by 10-15% from one step to the next on the CPU, so a 30 s calibration
    timed its schedules to +/-40-55 ms; four calibrations in a row measured checkpointing every other block 204,
    268, 309 and 288 ms over eager against 224 ms predicted, and taken at their medians put the plan that
    checkpoints everything at 40-58% overhead (measured: 41-44%). Shrunk by this share, four calibrations in a row
    put it at 41.0, 42.2, 41.7 and 41.2%; shrunk to none within two standard errors (the rule before), at 39.5-41.4%,
    with the lighter plans further under (the demo report had 8 of 12 overheads within 20% with either rule, and
    every plan under-predicted; with ``CALIBRATION_MIN_ROUNDS`` too, 9 of 12). At test size, where an excess stands
    ten standard errors clear, this keeps 99% of it.

    >>> _evident_share(10.0, 0.5), _evident_share(105.0, 45.0), _evident_share(44.0, 54.0)
    (0.9975, 0.816326530612, 0.0)
    """
    if excess <= 0:
        return 0.0
    return round(max(0.0, 1.0 - (standard_error / excess) ** 2), 12)


def _nonnegative_fit(columns: np.ndarray, values: np.ndarray, free: Sequence[int]) -> np.ndarray:
    """The least-squares fit of ``values`` by the ``free`` ``columns`` with no term below zero (the best over
    every set of free terms).

    >>> _nonnegative_fit(np.array([[1.0, 1.0], [1.0, 2.0]]), np.array([1.0, 0.5]), [0, 1]).round(6).tolist()
    [0.75, 0.0]
    """
    best, fit = np.inf, np.zeros(columns.shape[1])
    for size in range(1, len(free) + 1):
        for terms in itertools.combinations(free, size):
            solution = np.zeros(columns.shape[1])
            solution[list(terms)] = np.linalg.pinv(columns[:, terms]) @ values
            residual = float(np.sum((columns @ solution - values) ** 2))
            if solution.min() >= -1e-12 and residual < best - 1e-15:
                best, fit = residual, np.maximum(solution, 0.0)
    return fit


def _correction(measured: Estimate, predicted: Sequence[float], counts: Sequence[int],
                timed: Sequence[int] | None = None) -> list[float]:
    """Per stage, what to add to the ``predicted`` seconds so that they become costs of at least zero whose sum over the
    ``timed`` stages (default: all) is what ``measured`` shows: an excess (its median above their sum) is the
    machinery's, a rate per count that every stage pays for its ``counts`` (saved tensors for the hooks, nodes for a
    dispatch mode), in the share its noise lets through (:func:`_evident_share`); a shortfall means the nodes' own
    times over-count, and shrinks every stage in the same proportion, but only as far as the measurement clearly
    shows: to its median plus two standard errors. At the demo size, GPT-2's caching steps were timed at 47 +/- 48
    ms over eager against 47 ms predicted; taken at its median, one such measurement below zero priced every caching
    option at 0 ms, where the one caching the masks measured 77 +/- 30 ms.

    >>> _correction(Estimate(7.0, 0.0), [2.0, 2.0], [1, 2])
    [1.0, 2.0]
    >>> [round(c, 6) for c in _correction(Estimate(7.0, 1.0), [2.0, 2.0], [1, 2])]  # 3 +/- 1: 1 - (1/3)**2 of it
    [0.888889, 1.777778]
    >>> _correction(Estimate(2.0, 0.0), [3.0, 1.0], [0, 5])
    [-1.5, -0.5]
    >>> _correction(Estimate(-2.0, 1.0), [3.0, 1.0], [0, 5])  # shrunk to a sum of -2 + 2 * 1
    [-3.0, -1.0]
    >>> _correction(Estimate(2.0, 5.0), [3.0, 1.0], [0, 5])  # a shortfall the noise hides shrinks nothing
    [0.0, 0.0]
    >>> _correction(Estimate(1.0, 0.0), [-1.0, 1.0], [1, 1])  # a stage predicted below zero is raised to zero first
    [1.0, 0.0]
    >>> _correction(Estimate(4.0, 0.0), [2.0, 9.0, 2.0], [1, 3, 1], timed=[0, 2])  # the rate the timed ones show
    [0.0, 0.0, 0.0]
    >>> _correction(Estimate(5.0, 0.0), [2.0, 9.0, 2.0], [1, 3, 1], timed=[0, 2])
    [0.5, 1.5, 0.5]
    """
    timed = range(len(predicted)) if timed is None else timed
    floor = [max(0.0, p) for p in predicted]
    timed_floor = sum(floor[k] for k in timed)
    total = measured.median - timed_floor
    if total < 0:
        total = min(0.0, total + 2 * measured.standard_error)
    else:
        total *= _evident_share(total, measured.standard_error)
    if total >= 0:
        timed_counts = sum(counts[k] for k in timed)
        shares = [total * c / timed_counts for c in counts] if timed_counts else [total / len(timed)] * len(counts)
    else:
        shares = [f * total / timed_floor for f in floor] if timed_floor else [total / len(timed)] * len(floor)
    return [f - p + share for f, p, share in zip(floor, predicted, shares)]


def _in_context(model: torch.nn.Module, budget: Budget, error: InfeasibleBudgetError,
                margin: float = 0.0) -> InfeasibleBudgetError:
    """The solver's error, re-raised with what the user asked for (the model and the budget as written)."""
    minimum = error.minimum_budget_bytes
    if minimum is not None and margin:
        minimum = budget_for_usable(minimum, margin)  # the budget whose usable part is the minimum
    left = f" with {margin:.0%} left to the allocator" if margin else ""
    return InfeasibleBudgetError(
        f"planning {type(model).__name__} for budget {budget.text!r}{left}: {error.message}",
        hint=f"use a budget of at least {format_bytes(minimum or 0)} ({minimum} bytes)"
             + (" or a smaller allocator_margin" if margin else ""),
        minimum_budget_bytes=minimum)


DEFAULT_CUDA_MARGIN = 0.05


def allocator_margin_for(margin: float | None, device: DeviceSpec | None, device_type: str) -> float:
    """The allocator margin to plan with: ``margin`` when given, else 5% when planning for a GPU (``device`` given
    or tensors on CUDA: the caching allocator rounds and fragments, and the CUDA context takes its share) and 0 for
    the CPU, where the live-storage meter is the measure.

    >>> [allocator_margin_for(None, None, "cpu"), allocator_margin_for(None, None, "cuda")]
    [0.0, 0.05]
    """
    if margin is None:
        return DEFAULT_CUDA_MARGIN if device is not None or device_type == "cuda" else 0.0
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
        raise PlannerError(f"allocator_margin {margin!r} is not a share in [0, 1)",
                           hint="write e.g. allocator_margin=0.05 to plan for 95% of the budget, or 0 for all of it")
    return float(margin)


def device_budget(budget: int | str | Budget | None, device: DeviceSpec | None, device_type: str) -> Budget:
    """``budget`` parsed; ``None`` means the whole memory of the device planned for (or of the current GPU).

    >>> from planner.devices import device_spec
    >>> device_budget(None, device_spec("a100"), "meta")
    Budget(text='a100 memory', absolute_bytes=85899345920, fraction_of_eager=None)
    """
    if budget is not None:
        return parse_budget(budget)
    if device is not None:
        return Budget(text=f"{device.name} memory", absolute_bytes=device.memory_bytes)
    if device_type == "cuda":
        return Budget(text="GPU memory", absolute_bytes=torch.cuda.get_device_properties(
            torch.cuda.current_device()).total_memory)
    raise PlannerError(f"budget=None means all of the device's memory, but a {device_type} model has no fixed amount",
                       hint="pass a budget such as '8GB' or '60%', or device='h100' to plan for that GPU's memory")


def _check_fits(budget: Budget, budget_bytes: int, device: DeviceSpec | None) -> None:
    if device is not None and budget_bytes > device.memory_bytes:
        raise PlannerError(f"budget {budget.text!r} ({format_bytes(budget_bytes)}) is more than {device.name} holds "
                           f"({format_bytes(device.memory_bytes)})",
                           hint=f"use at most {device.memory_bytes} bytes, or budget=None for all of it")


def _pose_within_memory(captured: CapturedGraph, spec: DeviceSpec | None, **options: Any) -> Posed:
    """:func:`remembered_pose` of ``captured``, profiled where its tensors are; when that runs out of GPU memory
    (profiling runs the eager step, which a budget below it may not fit), posed again from a meta copy of the
    graph, timed by the roofline of ``spec`` or of the GPU it is on (:func:`_analytic_spec`): nothing of it runs
    or allocates, as when planning for a GPU you don't have. A ``UserWarning`` says so."""
    try:
        return remembered_pose(captured, device=spec, **options)
    except torch.OutOfMemoryError as exc:
        fallback = spec or _analytic_spec(captured)
        if fallback is None:
            raise PlannerError(f"profiling ran out of memory ({str(exc).strip().splitlines()[0]})",
                               hint="plan on the meta device with device='h100' (or a planner.devices.DeviceSpec "
                                    "of your GPU): nothing then runs") from exc
    if captured_device_type(captured) == "cuda":  # outside the handler: its traceback no longer holds the step
        torch.cuda.empty_cache()
    warn_at_callers_line(UserWarning(
        f"the eager step ran out of memory while being profiled; planned from a meta copy of the graph with "
        f"{fallback.name}'s figures ({fallback.description or fallback.name}, {format_bytes(fallback.memory_bytes)}) "
        f"instead: memory from the tensors' sizes, times from the roofline model"))
    module, (args, kwargs) = meta_copy(captured.graph_module, (captured.example_args, captured.example_kwargs))
    twin = dataclasses.replace(captured, graph_module=module, example_args=args, example_kwargs=kwargs)
    return remembered_pose(twin, device=fallback, **options)


def _analytic_spec(captured: CapturedGraph) -> DeviceSpec | None:
    """The figures of the GPU ``captured`` runs on (:func:`~planner.devices.spec_for_gpu`), or None: for a CPU,
    or a GPU the registry does not know."""
    if captured_device_type(captured) != "cuda":
        return None
    index = tensors_of(captured.graph_module, (captured.example_args, captured.example_kwargs))[0].device.index
    return spec_for_gpu(torch.cuda.get_device_name(index), torch.cuda.get_device_properties(index).total_memory)


def _plan_captured(model, captured: CapturedGraph, budget, *, loss_fn, optimizer, solver: str, max_stages: int,
                   ddp: bool = False,
                   profile_repeats: int, solver_options: dict | None, hold_outputs: bool = True,
                   device: str | DeviceSpec | None = None, allocator_margin: float | None = None,
                   posed: Posed | None = None, granularity: str | Granularity = Granularity.BLOCK,
                   compile: dict | None = None, grads_held: bool | None = False,
                   calls_per_step: int | None = 1) -> Planned:
    spec = device_spec(device) if device is not None else None
    device_type = captured_device_type(captured)
    parsed = device_budget(budget, spec, device_type)
    margin = allocator_margin_for(allocator_margin, spec, device_type)
    pose_options = dict(loss_fn=loss_fn, optimizer=optimizer, ddp=ddp, max_stages=max_stages,
                        profile_repeats=profile_repeats, hold_outputs=hold_outputs,
                        granularity=granularity_of(granularity), compiled=compile is not None)
    posed_here = posed is None
    posed = posed or _pose_within_memory(captured, spec, **pose_options, grads_held=bool(grads_held))
    problem = posed.problem
    calls, input_bytes = max(1, calls_per_step or 1), _input_bytes(captured)
    last_call = None
    if grads_held and calls > 1:
        last_call = _keeping_gradients(posed, _pose_within_memory(captured, spec, **pose_options, grads_held=False)
                                       if posed_here else None)
    eager = solvers.peak_with_calls(problem, Schedule.store_all(problem.num_stages), calls, input_bytes=input_bytes,
                                    last_call=last_call)
    budget_bytes = parsed.resolve(eager)
    _check_fits(parsed, budget_bytes, spec)
    if parsed.fraction_of_eager is not None and captured.own_checkpoints:
        _warn_own_checkpoints(model, captured.own_checkpoints, parsed, budget_bytes, eager)
    known = block_checkpoints(posed.block_ranges) if posed.block_ranges is not None else ()

    def solve_once(searched: Problem, target: int) -> Plan:
        if calls > 1 and solver == "auto":  # solve_for_calls solves 30-40 times: the DP, not the ILP after it
            return solvers.solve(searched, target, method="dp", known=known)
        return solvers.solve(searched, target, method=solver, known=known, **(solver_options or {}))

    def solve(target: int) -> Plan:  # with the other calls of a step held while one steps (see solve_for_calls)
        return solvers.solve_for_calls(problem, target, calls, solve_once, input_bytes=input_bytes,
                                       last_call=last_call)

    compiled_module, compiled_extra = None, ()
    try:
        if compile is not None:
            fit = _fit_compiled(captured, posed, solve, usable_bytes(budget_bytes, margin),
                                compile_options=compile, loss_fn=loss_fn, hold_outputs=hold_outputs,
                                grads_held=bool(grads_held), others_held=lambda plan: solvers.peak_with_calls(
                                    problem, plan.schedule, calls, input_bytes=input_bytes,
                                    last_call=last_call) - simulate(problem, plan.schedule).peak_bytes)
            result, compiled_module = fit.kept.plan, fit.kept.payload
            compiled_extra = (("compiled_peak_bytes", fit.kept.peak_bytes),
                              ("compiled_plans_measured", len(fit.tried)),
                              ("compiled_solved_for_bytes", fit.kept.target_bytes),
                              ("compiled_with", ", ".join(f"{k}={v!r}" for k, v in sorted(compile.items()))))
        else:
            result = solve(usable_bytes(budget_bytes, margin))
    except InfeasibleBudgetError as exc:
        raise _in_context(model, parsed, exc, margin) from None
    measured = posed.measured
    extra = tuple((k, v) for k, v in (("measured_device_peak_bytes", measured.device_peak_bytes),
                                      ("measured_device_reserved_bytes", measured.device_reserved_bytes),
                                      ("ddp_bucket_bytes", ddp_bucket_bytes(captured.graph_module) if ddp else None),
                                      ("grads_held", True if grads_held else None))
                  if v is not None) + posed.granularity.plan_extra + compiled_extra
    result = dataclasses.replace(result, budget_bytes=budget_bytes, budget_text=parsed.text,
                                 stage_nodes=posed.stage_nodes, fingerprint=fingerprint(captured),
                                 torch_version=torch.__version__, device=_device_of(model), timing=posed.timing,
                                 allocator_margin=margin, extra=result.extra + extra)
    return Planned(captured, problem, result, compiled_module)


def _warn_own_checkpoints(model: torch.nn.Module, count: int, budget: Budget, budget_bytes: int,
                          eager_bytes: int) -> None:
    """Say that ``budget``, a share, is of the step without the ``count`` checkpoints ``model`` makes itself (see
    :class:`~planner.capture.OwnCheckpointsWarning`)."""
    warn_at_callers_line(OwnCheckpointsWarning(
        f"{type(model).__name__} checkpoints itself ({count} torch.utils.checkpoint call{'s' * (count > 1)} a "
        f"step: Hugging Face's gradient_checkpointing_enable, for one). The plan replaces those checkpoints and "
        f"decides anew what to recompute, and the budget {budget.text!r} is a share of its step without them "
        f"({format_bytes(eager_bytes)}): {format_bytes(budget_bytes)}, which may be more than its own checkpoints "
        f"took. Give the budget in bytes (what its checkpointed step peaks at, measured with "
        f"planner.meter.measure_step_peak, say), or turn its checkpointing off"))


def _sized_gradients(profile: GraphProfile, measured: StageMeasurement) -> GraphProfile:
    """``profile`` with each sparse gradient at the size the eager step ``measured`` made it (what a sparse
    gradient holds is known only once it is made)."""
    if not measured.sparse_grad_bytes:
        return profile
    return dataclasses.replace(profile, param_grad_bytes={**profile.param_grad_bytes, **measured.sparse_grad_bytes})


def _keeping_gradients(held: Posed, keeping: Posed | None) -> Problem:
    """For a step posed with the gradients held from before it (``held``, whose backward sums what it makes into
    them), the same step with a backward that keeps the gradients it makes, the held ones among its fixed bytes:
    the last of several calls a step keeps its gradients so, in autograd's buffers (``last_call`` of
    :func:`~planner.solvers.peak_with_calls`). From ``keeping``, the step posed without held gradients (its eager
    step measured: the gradients made stay where a held step frees each once summed); without it (a part, posed
    apart), ``held``'s own problem with each stage making its gradients (sparse ones at their measured size),
    which also counts each of them in the workspace where it was measured while summed in (up to the stage's
    largest, over)."""
    if keeping is not None and keeping.stage_nodes == held.stage_nodes:
        return dataclasses.replace(keeping.problem, fixed_bytes=held.problem.fixed_bytes)
    grads = [0] * held.problem.num_stages
    if held.profile is not None:
        stage_of = {node: k for k, nodes in enumerate(held.stage_nodes) for node in nodes}
        grads = stage_gradient_bytes(_sized_gradients(held.profile, held.measured), stage_of, len(held.stage_nodes))
    return dataclasses.replace(held.problem, stages=tuple(dataclasses.replace(s, grad_bytes=g)
                                                          for s, g in zip(held.problem.stages, grads)))


def _input_bytes(captured: CapturedGraph) -> int:
    """The bytes of the captured call's tensor inputs (another call of the model holds inputs of its own)."""
    tensors = [x for x in tree_flatten((captured.example_args, captured.example_kwargs))[0]
               if isinstance(x, torch.Tensor)]
    return storage_bytes(tensors)


def _compiled_training_step(module: torch.nn.Module, captured: CapturedGraph, loss_fn: Callable | None,
                            hold_outputs: bool, grads_held: bool = False) -> Callable[[], None]:
    """One forward and backward of ``module`` on the captured inputs, the way the plan was made for (the outputs
    held through the backward when ``hold_outputs``); the gradients it makes are dropped afterwards, or with
    ``grads_held`` the trained parameters hold gradients from before it, as it leaves them (allocated now)."""
    args, kwargs, loss_of = captured.example_args, captured.example_kwargs, loss_fn or default_loss
    parameters = list(captured.graph_module.parameters())
    held = held_gradients(parameters) if grads_held else {}

    def step() -> None:
        outputs = module(*args, **kwargs)
        loss = loss_of(outputs)
        if not hold_outputs:
            del outputs
        with outside_autocast():
            loss.backward()
        for p in parameters:
            p.grad = held.get(p)
    return step


def _fit_compiled(captured: CapturedGraph, posed: Posed, solve: Callable[[int], Plan], usable: int, *,
                  compile_options: dict, loss_fn: Callable | None, hold_outputs: bool,
                  grads_held: bool = False, others_held: Callable[[Plan], int] = lambda plan: 0) -> CompiledFit:
    """Plan for ``usable`` bytes under ``torch.compile(**compile_options)``: each plan is compiled and one training
    step measured through the device's allocator (:func:`~planner.compiled.fit_plans`), on top of what the problem
    holds fixed (parameters, buffers, inputs, optimizer state) and what ``others_held`` says a step of several
    calls needs beyond one (:func:`~planner.solvers.peak_with_calls` less the plan's own peak); raises
    :class:`InfeasibleBudgetError` naming the lowest compiled peak when no compiled plan fits."""
    gm = captured.graph_module
    fixed = posed.problem.fixed_bytes
    device_type = captured_device_type(captured)

    def measure(plan: Plan) -> tuple[int, torch.nn.Module]:
        module = torch.compile(planned_module(captured, plan, posed.stage_nodes), **compile_options)
        step = _compiled_training_step(module, captured, loss_fn, hold_outputs, grads_held)
        with preserved_training_state(gm):
            step()  # compiles, and leaves the gradients held (when they are) before the step measured
            return fixed + device_allocator_peak_bytes(step, device_type) + others_held(plan), module

    fit = fit_plans(solve, measure, usable)
    if fit.kept is None:
        peaks = ", ".join(format_bytes(m.peak_bytes) for m in fit.tried)
        raise InfeasibleBudgetError(
            f"under torch.compile no plan fits: the {len(fit.tried)} plans compiled peaked at {peaks}, "
            f"the budget leaves {format_bytes(usable)}", minimum_budget_bytes=fit.smallest_peak_bytes)
    return fit


def _compile_options(compile: bool | dict, device: str | DeviceSpec | None) -> dict | None:
    """The keyword arguments of ``torch.compile`` to plan under (``True``: the defaults), or None for eager.

    >>> _compile_options(True, None), _compile_options({"mode": "max-autotune"}, None), _compile_options(False, None)
    ({}, {'mode': 'max-autotune'}, None)
    """
    if compile is False or compile is None:
        return None
    if compile is not True and not isinstance(compile, dict):
        raise PlannerError(f"compile={compile!r} is neither a bool nor a dict of torch.compile's arguments",
                           hint="write compile=True, or e.g. compile={'mode': 'max-autotune'}")
    if device is not None:
        raise PlannerError(f"compile= measures compiled steps where the tensors are, and device={device!r} plans "
                           "from the roofline model without running anything",
                           hint="plan for the device without compile=, or drop device= and plan on the GPU itself")
    return {} if compile is True else dict(compile)


def _as_args(example_inputs: Any) -> tuple:
    if example_inputs is None:
        return ()
    return example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)


def plan(model: torch.nn.Module, budget: int | str | None, example_inputs: Any = None, *,
         example_kwargs: dict | None = None, optimizer: torch.optim.Optimizer | None = None, solver: str = "auto",
         loss_fn: Callable | None = None, max_stages: int = 64, profile_repeats: int = 3,
         solver_options: dict | None = None, hold_outputs: bool = True, device: str | DeviceSpec | None = None,
         allocator_margin: float | None = None, ddp: bool = False,
         granularity: str | Granularity = Granularity.BLOCK, compile: bool | dict = False,
         grads_held: bool = False, calls_per_step: int = 1) -> Plan:
    """Plan ``model`` under ``budget`` without rewriting it; see :func:`optimize` for the arguments.

    A model built under ``with torch.device("meta"):`` (inputs made with ``device="meta"``) is planned without
    allocating anything; give ``device=`` the GPU to plan for. The plan applies to the real model with
    :func:`apply`. ``grads_held=True`` plans the steps of gradient accumulation after the first,
    ``calls_per_step=2`` steps that call the model twice before one backward.
    """
    if example_inputs is None and not example_kwargs:
        raise PlannerError("planner.plan needs example inputs",
                           hint="pass example_inputs=(batch,) with the inputs of one training step")
    device_type_of(model, (example_inputs, example_kwargs))  # one device, or say how to get there
    options = dict(loss_fn=loss_fn, optimizer=optimizer, solver=solver, max_stages=max_stages,
                   profile_repeats=profile_repeats, solver_options=solver_options, hold_outputs=hold_outputs,
                   device=device, allocator_margin=allocator_margin, ddp=ddp,
                   granularity=granularity_of(granularity), compile=_compile_options(compile, device),
                   grads_held=grads_held, calls_per_step=_calls_option(calls_per_step))
    args, example_kwargs = _as_args(example_inputs), without_unmasking_mask(model, dict(example_kwargs or {}))
    with inputs_restored(args, example_kwargs):
        sharding = fsdp.sharding_of(model)
        if sharding is not None:
            return _plan_sharded(model, args, example_kwargs, sharding, budget, options).plan
        return _plan_captured(model, capture_for(model, args, example_kwargs, device), budget, **options).plan


_POSE_OPTIONS = ("loss_fn", "optimizer", "ddp", "max_stages", "profile_repeats", "hold_outputs", "device",
                 "granularity")


def _plan_sharded(model: torch.nn.Module, args: tuple, kwargs: dict, sharding: fsdp.Sharding, budget,
                  options: dict, wrapper: torch.nn.Module | None = None) -> Planned:
    """Plan a model sharded with ``fully_shard`` (see :mod:`planner.fsdp`; every rank calls this together): it is
    captured and profiled with every unit gathered, each rank's memory is measured in a step that runs FSDP, and
    every rank takes rank 0's plan. ``wrapper``: the optimized module, when it is sharded too."""
    if options.get("compile") is not None:
        raise PlannerError("compile= does not plan models sharded with fully_shard",
                           hint="drop compile= and torch.compile the module optimize() returns")
    if options.get("grads_held"):
        raise PlannerError("grads_held=True is not modelled for models sharded with fully_shard",
                           hint="leave grads_held unset: under FSDP steps are planned without held gradients")
    if (options.get("calls_per_step") or 1) > 1:
        raise PlannerError("calls_per_step above 1 is not modelled for models sharded with fully_shard",
                           hint="call the sharded model once a step (one batch of all the views)")
    options = {**options, "grads_held": False, "calls_per_step": 1}
    fsdp.check_same_inputs_on_all_ranks(input_signature(args, kwargs))
    with fsdp.unsharded_for_capture(model, wrapper):
        captured = dataclasses.replace(capture_for(model, args, kwargs, options.get("device")), sharding=sharding)
        fsdp.check_units_run_in_one_piece(captured.graph_module, sharding)
        posed = pose(captured, sharding=sharding, **{k: options[k] for k in _POSE_OPTIONS if k in options})
    problem = fsdp.per_rank_problem(posed.problem, posed.stage_nodes, captured, model, sharding,
                                    loss_fn=options.get("loss_fn"), hold_outputs=options.get("hold_outputs", True),
                                    wrapper=wrapper)
    posed = dataclasses.replace(posed, problem=problem)
    world = max(u.world_size for u in sharding.units)

    def solve() -> Plan:
        plan = _plan_captured(model, captured, budget, posed=posed, **options).plan
        return dataclasses.replace(plan, extra=plan.extra + (("fsdp_world_size", world),))

    return Planned(captured, problem, fsdp.rank_zero_plan(solve))


def _swapped_tensors(model: torch.nn.Module, planned: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters and buffers by name when any is no longer the tensor the plan captured (as when
    ``fully_shard`` swaps in all-gathered parameters for the forward); empty when all are the same."""
    live = dict(model.named_parameters(remove_duplicate=False))
    live.update(model.named_buffers(remove_duplicate=False))
    captured = dict(planned.named_parameters(remove_duplicate=False))
    captured.update(planned.named_buffers(remove_duplicate=False))
    if all(live.get(name) is tensor for name, tensor in captured.items()):
        return {}
    return {name: live[name] for name in captured if name in live}


def _reused(larger: Planned, captured: CapturedGraph) -> Planned:
    """``larger``'s plan run on ``captured``, the same graph on inputs no larger: the same regions and options, its
    predictions upper bounds (``Plan.reused_from`` names the plan they were made for), no profile. On inputs of
    the same shapes (a number on the model changed: see :func:`~planner.capture.numbers_signature`), it is the plan
    they would get, so it is never replaced by one of their own (``planning_seconds`` None)."""
    source = larger.plan.reused_from or larger.plan.fingerprint
    plan = dataclasses.replace(larger.plan, fingerprint=fingerprint(captured), solve_seconds=0.0,
                               extra=tuple({**dict(larger.plan.extra), "reused_from": source}.items()))
    # kept without the call's own inputs (meta tensors of their shapes in their place): a batch held for each
    # shape would be memory outside the budget
    args, kwargs = tree_map_only(torch.Tensor, _shell, (captured.example_args, captured.example_kwargs))
    same_shapes = no_larger_than(larger.captured.graph_module.graph, captured.graph_module.graph)
    captured = dataclasses.replace(captured, example_args=args, example_kwargs=kwargs)
    # on inputs of the same shapes (a number changed), a plan of its own would be this one: planning never pays
    return Planned(captured, None, plan, planning_seconds=None if same_shapes else larger.planning_seconds)


def _shell(tensor: torch.Tensor) -> torch.Tensor:
    """A meta tensor of ``tensor``'s shape, strides and dtype."""
    return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")


def _saved_as_the_models(module: "OptimizedModule", state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """``state_dict`` hook: the planned module saves under the model's own keys (``blocks.0.weight``, not
    ``model.blocks.0.weight``), so a checkpoint saved from either loads into the other, and ``Trainer.save_model``
    writes one that ``from_pretrained`` reads. Module versions are kept under both names."""
    inner = prefix + "model."
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner):]] = state_dict.pop(key)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        for key in [k for k in metadata if k == inner[:-1] or k.startswith(inner)]:
            metadata[(prefix + key[len(inner):]).rstrip(".")] = metadata[key]


def _loaded_into_the_model(module: "OptimizedModule", state_dict: dict, prefix: str, *_: Any) -> None:
    """``load_state_dict`` pre-hook: keys in the model's own form (see :func:`_saved_as_the_models`) load into
    the model; keys that name it (``model.blocks.0.weight``, as ``named_parameters`` does) load as they are. Which
    form a state dict is in is read from its keys, as a model may have a submodule of its own named ``model``
    (Hugging Face's ``LlamaForCausalLM.model``)."""
    ours = [k[len(prefix):] for k in state_dict if k.startswith(prefix)]
    models = set(module.model.state_dict(keep_vars=True))
    as_model = sum(k in models for k in ours)
    if as_model and as_model >= sum(k.startswith("model.") and k[6:] in models for k in ours):
        for key in ours:
            state_dict[prefix + "model." + key] = state_dict.pop(prefix + key)


def _placements(model: torch.nn.Module) -> list[tuple]:
    """Which tensor each parameter and buffer of ``model`` is, and its device and dtype (a move that changes
    neither keeps a parameter's data, and replaces a buffer only by a new tensor)."""
    return [(id(t), t.dtype, t.device) for t in itertools.chain(model.parameters(), model.buffers())]


@contextlib.contextmanager
def _own_forward(model: torch.nn.Module) -> Iterator[None]:
    """While planning, a model that runs a plan installed in it (``in_place=True``) has its own forward back:
    capture and profiling run that one."""
    installed = model.__dict__.get("forward")
    if not isinstance(installed, _PlannedForward):
        yield
        return
    del model.forward
    if installed.own is not None:
        model.forward = installed.own
    try:
        yield
    finally:
        model.forward = installed


class OptimizedModule(torch.nn.Module):
    """Runs ``model`` under a plan; holds the caller's own module (and so its ``Parameter`` objects).

    Plans are cached per input signature (shapes, dtypes, non-tensor arguments) and autocast state; a new one is
    planned on first use, like ``torch.compile``: called under ``torch.autocast``, the model is profiled and
    planned in that precision. Outside training (``eval()`` or ``torch.no_grad()``) the model runs as is.
    """

    def __init__(self, model: torch.nn.Module, budget: int | str, *, planner_options: dict,
                 reuse_plans: bool = True):
        super().__init__()
        self.model = model
        self.budget = budget
        self.reuse_plans = reuse_plans
        self._options = planner_options
        # plans by key (see _key), reused ones in the order of their last use (see _forget_least_used_reused)
        self._planned: collections.OrderedDict[tuple, tuple[Planned, torch.nn.Module]] = collections.OrderedDict()
        self._recaptures: list[tuple[tuple[str, ...], float]] = []  # see _note_recapture
        self._open_calls: list[weakref.ref] = []  # training calls whose backward has not begun (see _watch)
        self._calls_seen: dict[tuple, int] = {}  # by key, the most calls seen before one backward, where above 1
        self._double_backward_warned = False  # see _note_double_backward
        # what the planned calls have told (see _note_stand_in_loss): a set, not a flag, as a number changed in
        # forward would be a counter of the model's to a capture of a model this module is part of
        self._told: set[str] = set()
        self._reused_calls: dict[tuple, int] = {}  # calls run under each reused plan (see _planning_pays)
        self._modules_listed: tuple[torch.nn.Module, ...] | None = None  # the model's modules, for hooks_signature
        self._modules_held: tuple = ()  # their children when listed (modules_signature): a change lists them anew
        self._parameters_listed: tuple[torch.nn.Parameter, ...] | None = None  # its parameters, for grads_held
        self._last: Planned | None = None
        self._parts: dict[str, OptimizedModule] | None = None  # set when the model captures only in parts
        self._parts_hooks: tuple = ()  # the model's hooks when it was planned in parts
        self.register_state_dict_post_hook(_saved_as_the_models)
        self.register_load_state_dict_pre_hook(_loaded_into_the_model)

    @property
    def parts(self) -> dict[str, "OptimizedModule"]:
        """When the model does not capture as a whole: its planned submodules by path (else empty)."""
        return dict(self._parts or {})

    @property
    def plan(self) -> Plan:
        """The plan used by the most recent call (or made from the example inputs)."""
        if self._last is None and self._parts:
            raise PlannerError(f"{type(self.model).__name__} was planned in parts, one plan each",
                               hint=f"see .parts[path].plan for {', '.join(self._parts)}")
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
        return self._planned[_stored_key(self._last)][1].code if self._last else ""

    def add_plan(self, planned: Planned) -> None:
        captured, plan = planned.captured, planned.plan
        graph_module = captured.graph_module
        if captured.sharding is not None:  # the graph runs the units' FSDP hooks itself
            graph_module, stage_nodes = fsdp.with_unit_hooks(graph_module, plan.stage_nodes, self.model,
                                                             captured.sharding, wrapper=self)
            plan = dataclasses.replace(plan, stage_nodes=stage_nodes)
        module = planned.compiled_module if planned.compiled_module is not None else apply_plan(graph_module, plan)
        key = _stored_key(planned)
        self._planned[key] = (planned, module)
        self._last = planned
        if plan.reused_from is not None:
            self._forget_least_used_reused(keep=key)

    def _forget_least_used_reused(self, keep: tuple) -> None:
        """Keep at most :data:`REUSED_PLANS_KEPT` reused plans (each holds its graph, about 3 MB of host memory
        for test-size GPT-2) and plans kept under a second key (numbers changed that the graph does not read), the
        most recently used: a forgotten one costs a capture when its inputs come again. Plans of their own cost a
        profile and a solve to make again, and are all kept."""
        reused = [k for k, (planned, _) in self._planned.items()
                  if planned.plan.reused_from is not None or k != _stored_key(planned)]  # or kept under another
        for key in reused[:max(0, len(reused) - REUSED_PLANS_KEPT)]:
            if key != keep:
                del self._planned[key]
                self._reused_calls.pop(key, None)

    def _plan_for(self, args: tuple, kwargs: dict, *, replacing: Planned | None = None) -> bool:
        """Plan for these inputs: a plan for larger ones reused, or a new one (``replacing`` a reused plan: for
        the budget it fit, so that the new one recomputes no more). Whether it profiled and solved (not when a
        plan was reused or the graph was one planned before)."""
        with _own_forward(self.model), inputs_restored(args, kwargs):
            return self._plan_now(args, kwargs, replacing)

    def _plan_now(self, args: tuple, kwargs: dict, replacing: Planned | None) -> bool:
        started = time.perf_counter()
        args, kwargs = detached_inputs(args, kwargs)  # planning's steps run their backward through them
        device_type_of(self.model, (args, kwargs))  # one device, or say how to get there
        check_initialized(self.model)  # else no part would capture either, and planning's steps would initialize
        sharding = fsdp.sharding_of(self.model, self)
        if sharding is not None:
            self._forget_other_shardings(sharding)
            self.add_plan(_plan_sharded(self.model, args, kwargs, sharding, self.budget, self._options, self))
            return True
        try:
            captured = capture_for(self.model, args, kwargs, self._options.get("device"))
        except PlannerError as error:
            self._parts = self._plan_parts(args, kwargs, error)
            self._parts_hooks = self._hooks_now()
            return True
        held, calls = self._grads_held_now(), self._calls_per_step(captured.key)
        same = self._same_graph_planned(captured, held, calls) if replacing is None else None
        if same is not None:  # numbers changed that the graph does not read: the same plan, under this key too
            key = _with_step(captured.key, held, calls)
            self._planned[key] = self._planned[_stored_key(same)]
            self._last = same
            self._forget_least_used_reused(keep=key)
            return False
        larger = self._larger_plan(captured, held, calls) if self.reuse_plans and replacing is None else None
        if larger is not None:
            self.add_plan(_reused(larger, captured))
            return False
        budget = self.budget if replacing is None else replacing.plan.budget_bytes
        planned = _plan_captured(self.model, captured, budget,
                                 **{**self._options, "grads_held": held, "calls_per_step": calls})
        self.add_plan(dataclasses.replace(planned, planning_seconds=time.perf_counter() - started))
        return True

    def _same_graph_planned(self, captured: CapturedGraph, grads_held: bool, calls: int) -> Planned | None:
        """The plan made for this very graph (the same code, constants included, on inputs of the same shapes, in
        the same autocast state, with the same hooks, parameters trained, gradients held alike and ``calls`` per
        step), if any: numbers changed since that the graph does not read (Accelerate marks the model it prepares
        with ``_is_accelerate_prepared``)."""
        code = captured.graph_module.code
        return next((planned for planned, _ in self._planned.values()
                     if planned.captured.input_signature == captured.input_signature
                     and planned.captured.autocast == captured.autocast and planned.captured.hooks == captured.hooks
                     and planned.captured.sharding is None and planned.plan.grads_held == grads_held
                     and planned.plan.calls_per_step == calls and planned.captured.trained == captured.trained
                     and planned.captured.graph_module.code == code),
                    None)

    def _plan_new(self, args: tuple, kwargs: dict) -> None:
        """:meth:`_plan_for` a call whose key is new, noting when only values the graph holds as constants changed
        since the last call (see :meth:`_note_recapture`)."""
        last = self._last
        started = time.perf_counter()
        if self._plan_for(args, kwargs) or last is None:
            return
        modules = self._listed_modules()
        changed = replaced_modules(self.model, self._modules_held, last.captured.modules) + changed_values(
            numbers_signature(self.model, modules), last.captured.numbers, input_signature(args, kwargs),
            last.captured.input_signature, self.model, args, kwargs)
        if changed:
            self._note_recapture(changed, time.perf_counter() - started)

    def _note_recapture(self, changed: list[str], seconds: float) -> None:
        """Count a capture made because numbers the graph holds as constants changed (a temperature annealed, a
        dropout probability scheduled, a float passed to forward), and warn once, at the
        :data:`RECAPTURES_WARNED_AT`-th, with what changed and what each capture took."""
        self._recaptures.append((tuple(changed), seconds))
        if len(self._recaptures) != RECAPTURES_WARNED_AT:
            return
        names = list(dict.fromkeys(name for names, _ in self._recaptures for name in names))
        each = sum(seconds for _, seconds in self._recaptures) / len(self._recaptures)
        warn_at_callers_line(RecaptureWarning(
            f"{', '.join(names[:4])}{' and more' if len(names) > 4 else ''} changed on {len(self._recaptures)} "
            f"calls of {type(self.model).__name__}, and each change captured the model again ({each:.2f} s each, "
            f"then its plan ran): its graph holds them as constants. Keep a number that changes often in a buffer "
            f"(register_buffer, updated in place with fill_) or pass it to forward as a tensor: the graph reads "
            f"those each call"))

    def _planning_pays(self, key: tuple, planned: Planned) -> bool:
        """Whether a reused plan has been run often enough that planning its inputs anew pays: once its calls have
        spent on recomputation (at most its predicted recompute time each) what planning takes, as a rent-or-buy
        rule does, so that a shape met a few times never waits for a plan and one met all the time gets its own
        (at most twice the time of knowing in advance which it would be)."""
        if planned.planning_seconds is None:
            return False
        self._reused_calls[key] = calls = self._reused_calls.get(key, 0) + 1
        return calls * planned.plan.predicted_recompute_seconds >= planned.planning_seconds

    def _larger_plan(self, captured: CapturedGraph, grads_held: bool, calls: int) -> Planned | None:
        """Of the plans made for the same graph on inputs at least as large, in the same autocast state, with the
        same parameters trained, gradients held alike and ``calls`` per step, the one for the smallest
        (:func:`~planner.capture.no_larger_than`); None without any, or with ``compile=`` (a compiled plan is
        measured for its shapes)."""
        if self._options.get("compile") is not None:
            return None
        graph = captured.graph_module.graph
        larger = [planned for planned, _ in self._planned.values()
                  if planned.captured.autocast == captured.autocast and planned.captured.sharding is None
                  and planned.plan.grads_held == grads_held and planned.captured.trained == captured.trained
                  and planned.plan.calls_per_step == calls
                  and no_larger_than(graph, planned.captured.graph_module.graph)]
        return min(larger, key=lambda planned: planned.plan.eager_peak_bytes, default=None)

    def _forget_other_shardings(self, sharding: fsdp.Sharding) -> None:
        """Drop plans made before the model was sharded this way: they hold the parameters as they were then (the
        whole unsharded tensors, when the model was sharded after planning)."""
        for key in [k for k in self._planned if len(k) < 3 or k[2] != sharding.signature]:
            if self._last is self._planned.pop(key)[0]:
                self._last = None

    def _plan_parts(self, args: tuple, kwargs: dict, error: PlannerError) -> dict[str, "OptimizedModule"]:
        """Plan the largest submodules that capture (see :mod:`planner.parts`); re-raise ``error`` when none does."""
        options = self._options
        if options.get("compile") is not None:
            raise PlannerError(f"compile= plans the compiled step of a model that captures as a whole, and "
                               f"{type(self.model).__name__} does not ({error.message})",
                               hint="drop compile= and torch.compile the module optimize() returns") from None
        training_state = training_state_bytes(self.model, options["optimizer"], options["ddp"])
        try:
            recorded = record_calls(self.model, args, kwargs, loss_fn=options["loss_fn"],
                                    extra_fixed_bytes=training_state)
        except Exception:
            raise error from None  # the inputs do not fit the model at all
        found = capturable_parts(self.model, recorded.calls)
        if not found:
            raise error
        whole = parse_budget(self.budget)
        budget_bytes = whole.resolve(recorded.eager_peak_bytes)
        shed = max(0, recorded.eager_peak_bytes - budget_bytes)
        part_options = {**options, "loss_fn": None, "hold_outputs": True}  # the rest of the model holds outputs
        pose_options = {k: part_options[k] for k in ("loss_fn", "optimizer", "ddp", "max_stages",
                                                     "profile_repeats", "hold_outputs", "granularity")}
        pose_options["grads_held"] = self._grads_held_now()
        # remembered, as a whole model's are: planning again (the smallest budget an error named) prices alike
        posed = {path: remembered_pose(captured, **pose_options) for path, captured in found.items()}

        def planned_parts(budgets: dict[str, Budget], solvers_used: dict[str, str]) -> dict[str, OptimizedModule]:
            made = {}
            for path, captured in found.items():
                module = self.model.get_submodule(path)
                part = OptimizedModule(module, budgets[path], planner_options=part_options)
                chosen = {"solver": solvers_used.get(path, part_options["solver"]),
                          "grads_held": pose_options["grads_held"]}
                part.add_plan(_plan_captured(module, captured, part.budget, posed=posed[path],
                                             **{**part_options, **chosen}))
                made[path] = part
            return made

        def measured_peak(parts: dict[str, OptimizedModule]) -> int:
            return step_peak_bytes(self.model, args, kwargs, loss_fn=options["loss_fn"], parts=parts,
                                   extra_fixed_bytes=training_state)

        can_shed = {path: simulate(p.problem, Schedule.store_all(p.problem.num_stages)).peak_bytes
                    - solvers.minimum_peak(p.problem) for path, p in posed.items()}  # what each lowers its own peak
        # each part lowers its own peak by a share of what the step must shed (all it can, where that is too
        # little: the step's peak need not be where the parts' are), and the step is measured
        def shared(scale: float) -> tuple[int, dict[str, OptimizedModule]]:
            shares = {path: round(can_shed[path] * scale) for path in found}
            made = planned_parts({path: ReducedBudget(f"{whole.text}, shedding {share} bytes here",
                                                      reduce_bytes=share) for path, share in shares.items()}, {})
            return (measured_peak(made) if shed else 0), made
        scale = min(1.0, shed / max(1, sum(can_shed.values())))
        shared_peak, parts = shared(scale)
        if shared_peak > budget_bytes and scale < 1:  # the parts' own peaks need not be the step's: all they can
            shared_peak, parts = min(shared(1.0), (shared_peak, parts), key=lambda found_peak: found_peak[0])
        if shared_peak > budget_bytes:  # what the parts hold from their forward to their backward, while others run
            parts = self._parts_checkpointed_whole(found, posed, planned_parts, measured_peak, budget_bytes, whole,
                                                   recorded.eager_peak_bytes, shared_peak)
        warn_at_callers_line(PartialCaptureWarning(
            f"{type(self.model).__name__} does not capture as a whole ({error.message}); planned its parts "
            f"{', '.join(parts)} to shed {format_bytes(shed)} together, and runs the rest eagerly"))
        return parts

    def _parts_checkpointed_whole(self, found: dict[str, CapturedGraph], posed: dict[str, Posed], planned_parts,
                                  measured_peak, budget_bytes: int, whole: Budget, eager_peak_bytes: int,
                                  shared_peak_bytes: int) -> dict[str, "OptimizedModule"]:
        """Parts each checkpointed whole (the ``"whole"`` baseline: only their inputs and outputs kept from their
        forward to their backward), the fewest that bring the measured step within ``budget_bytes``, cheapest
        first (the least forward time per byte they save for their backward), the rest stored: a part that is one
        block lowers its own peak by nothing, as its backward begins with its activations made again, but not
        holding them while the other parts run lowers the step's. A binary search over how many, one measured
        eager step each. Raises :class:`InfeasibleBudgetError` with the lower measured peak of all checkpointed
        whole and of each part at its own least (``shared_peak_bytes``) when neither fits."""
        def cost_per_byte(path: str) -> float:
            problem = posed[path].problem
            held = sum(t.nbytes for t in problem.tensors if t.savers and not t.returned)
            return sum(s.forward_seconds for s in problem.stages) / held if held else float("inf")
        order = sorted(found, key=cost_per_byte)

        def with_first(count: int) -> tuple[int, dict[str, OptimizedModule]]:
            chosen = {path: "whole" if i < count else "store_all" for i, path in enumerate(order)}
            fates = {"whole": "checkpointed whole", "store_all": "stored"}
            parts = planned_parts({path: ReducedBudget(f"{whole.text}, {fates[chosen[path]]} here")
                                   for path in found}, chosen)
            return measured_peak(parts), parts
        low, high = 0, len(order)  # with the first ``high`` checkpointed the step fits, or nothing does
        all_whole, fitting = with_first(high)
        if all_whole > budget_bytes:
            smallest = min(all_whole, shared_peak_bytes)
            raise InfeasibleBudgetError(
                f"planning {type(self.model).__name__} in parts ({', '.join(found)}) for budget {whole.text!r}: "
                f"its step measured {format_bytes(all_whole)} with every part checkpointed whole and "
                f"{format_bytes(shared_peak_bytes)} with each at its own least peak, of "
                f"{format_bytes(eager_peak_bytes)} eager, over the {format_bytes(budget_bytes)} budget",
                hint=f"use a budget of at least {format_bytes(smallest)} ({smallest} bytes)",
                minimum_budget_bytes=smallest)
        while high - low > 1:
            middle = (low + high) // 2
            peak, parts = with_first(middle)
            if peak <= budget_bytes:
                high, fitting = middle, parts
            else:
                low = middle
        return fitting

    def _key(self, args: tuple, kwargs: dict, sharded: tuple | None) -> tuple:
        return self._keys(args, kwargs, sharded)[1]

    def _keys(self, args: tuple, kwargs: dict, sharded: tuple | None) -> tuple[tuple, tuple]:
        """The key of the plan for these inputs without the step's part (:func:`_with_step`), and with it."""
        modules = self._listed_modules()
        key = plan_key(input_signature(args, kwargs), autocast_state(), sharded, hooks_signature(self.model, modules),
                       numbers_signature(self.model, modules), trained_signature(self.model, modules),
                       self._modules_held)
        if sharded is not None:
            return key, key
        return key, _with_step(key, self._grads_held_now(), self._calls_per_step(key))

    def _calls_per_step(self, key: tuple) -> int:
        """How many calls of the model a step makes before its backward, for a call under ``key`` (the plan's,
        without the step's): ``calls_per_step``, or by default the most seen so far in a step with such a call
        (this call and those whose backward has not begun: :meth:`_watch`; each of those learns the number too).
        A call with other inputs learns its own: a GAN's generator step, calling the discriminator once on a fake
        batch that requires gradients, runs a plan for one call where its discriminator step calls it twice on
        batches that do not. A step that calls once, with the inputs of calls made two a step before, keeps the
        plan for two (it fits, recomputing more than it needs). Traced by ``torch.compile(optimized)``, it learns
        nothing (pass the number)."""
        chosen = self._options.get("calls_per_step") or 1
        if torch.compiler.is_compiling():
            return max(chosen, self._calls_seen.get(key, 1))
        self._open_calls = [ref for ref in self._open_calls if (call := ref()) is not None and not call.done]
        calls = len(self._open_calls) + 1
        if calls > 1:
            for seen in {key, *(call.key for ref in self._open_calls if (call := ref()) is not None)}:
                self._calls_seen[seen] = max(self._calls_seen.pop(seen, 1), calls)  # the most recent last
            while len(self._calls_seen) > REUSED_PLANS_KEPT:  # keys that change every step do not pile up
                del self._calls_seen[next(iter(self._calls_seen))]
        return max(chosen, self._calls_seen.get(key, 1))

    def _watch(self, outputs: Any, key: tuple) -> None:
        """Note a training call under ``key`` (see :meth:`_calls_per_step`) until its backward begins (a gradient
        reaches one of its ``outputs``) or its graph is freed without one: another call meanwhile runs while this
        one's saved tensors are held."""
        if torch.compiler.is_compiling():
            return
        tensors = [x for x in tree_flatten(outputs)[0] if isinstance(x, torch.Tensor) and x.requires_grad]
        if not tensors:
            return
        call = _OpenCall(key)  # held by the hook alone, which the graph holds: it dies with the graph
        owner = weakref.ref(self)

        def begun(grads: Sequence[torch.Tensor | None]) -> None:
            call.done = True
            if torch.is_grad_enabled() and (module := owner()) is not None:  # a backward with create_graph=True
                module._note_double_backward()
        torch.autograd.graph.register_multi_grad_hook(tensors, begun, mode="any")
        self._open_calls.append(weakref.ref(call))

    def _note_stand_in_loss(self, outputs: Any) -> None:
        """Warn, once, that the plan was made for a stand-in loss (see :class:`StandInLossWarning`)."""
        if "stand-in loss" in self._told or self._options.get("loss_fn") is not None:
            return
        self._told.add("stand-in loss")  # looked at once: a model's outputs keep their kind
        nbytes = stand_in_loss_bytes(outputs)
        if not nbytes:
            return
        warn_at_callers_line(StandInLossWarning(
            f"{type(self.model).__name__} returns no scalar loss, and was planned without loss_fn: for a stand-in, "
            f"the mean of its outputs' squares ({format_bytes(nbytes)} of outputs), which keeps an output-sized "
            f"tensor from forward to backward and makes the outputs' gradients whole, as mean squared error does. "
            f"Pass your loss as loss_fn (a function of the outputs) to plan for it exactly: one that frees more "
            f"(cross-entropy frees one output-sized tensor more) then fits more"))

    def _note_double_backward(self) -> None:
        """Warn, once, that a backward building a graph of its own ran through the plan (see
        :class:`DoubleBackwardWarning`)."""
        if self._double_backward_warned:
            return
        self._double_backward_warned = True
        warn_at_callers_line(DoubleBackwardWarning(
            f"a backward with create_graph=True (a gradient penalty, higher-order gradients) ran through the plan "
            f"of {type(self.model).__name__}, which was made for steps of one backward: the step holds the graph "
            f"of the first backward, recomputed tensors included, until the second, and the budget of "
            f"{format_bytes(self.plan.budget_bytes)} does not cover it. Its gradients are exact; measure the step "
            f"(planner.meter.measure_step_peak) and plan with a budget that leaves room for that graph"))

    def _grads_held_now(self) -> bool:
        """Whether this step begins with gradients held (``grads_held``, or by default whether any trained
        parameter holds one now: a micro-batch after the first, or after ``zero_grad(set_to_none=False)``)."""
        chosen = self._options.get("grads_held")
        if chosen is not None:
            return chosen
        if self._parameters_listed is None:
            self._parameters_listed = tuple(self.model.parameters())
        return any(p.grad is not None and p.requires_grad for p in self._parameters_listed)

    def _listed_modules(self) -> tuple[torch.nn.Module, ...]:
        """The model's modules, listed again (and its parameters) when one of them holds another child than when
        they were listed: a module replaced after planning (see :func:`~planner.capture.modules_signature`)."""
        if self._modules_listed is None or modules_signature(self.model, self._modules_listed) != self._modules_held:
            self._modules_listed = tuple(self.model.modules())
            self._modules_held = modules_signature(self.model, self._modules_listed)
            self._parameters_listed = None
        return self._modules_listed

    def _hooks_now(self) -> tuple:
        return hooks_signature(self.model, self._listed_modules())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """When ``fully_shard`` was applied to this module, a missing plan is made before FSDP's own forward hooks
        run (they gather parameters and begin a step planning must not be inside of)."""
        if fsdp.is_sharded(self) and self.training and torch.is_grad_enabled() and self._parts is None:
            planned_kwargs = without_unmasking_mask(self.model, kwargs)
            if self._key(args, planned_kwargs, fsdp.units_signature(self.model, self)) not in self._planned:
                self._plan_for(args, planned_kwargs)
        return super().__call__(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not (self.training and torch.is_grad_enabled()) or self._installed():
            return self.model(*args, **kwargs)  # installed (in_place=True): the model's forward runs the plan
        return self._run_planned(self.model, args, kwargs)

    def _installed(self) -> bool:
        installed = self.model.__dict__.get("forward")
        return isinstance(installed, _PlannedForward) and installed.optimized is self

    def _run_planned(self, run_model: Callable, args: tuple, kwargs: dict) -> Any:
        """One training call under the plan for these inputs (planned now if new); ``run_model`` runs the model
        itself where its parts are planned apart (the model, or its own forward once installed in it)."""
        if self._parts is not None and self._parts_hooks != self._hooks_now():
            self._parts = None  # the hooks it was planned in parts with have changed: capture it whole again
        if self._parts is not None:
            with parts_planned(self.model, self._parts):
                outputs = run_model(*args, **kwargs)
            self._note_stand_in_loss(outputs)
            return outputs
        planned_kwargs = without_unmasking_mask(self.model, kwargs)
        sharded = fsdp.units_signature(self.model, self)
        base_key, key = self._keys(args, planned_kwargs, sharded)
        if key not in self._planned:
            self._plan_new(args, planned_kwargs)
            if self._parts is not None:  # it captures only in parts now (a backward hook registered since)
                return self._run_planned(run_model, args, kwargs)
            # the model's first forward may have changed what keys its plans (transformers installs its
            # output-capturing hooks then): the plan is under the key of the model as captured
            base_key, key = self._keys(args, planned_kwargs, sharded)
        kwargs = planned_kwargs
        planned, module = self._planned[key]
        self._planned.move_to_end(key)  # the most recently used (what _forget_least_used_reused keeps)
        if planned.plan.reused_from is not None and self._planning_pays(key, planned):
            self._plan_for(args, kwargs, replacing=planned)
            planned, module = self._planned[key]
        self._last = planned
        if sharded is not None:  # the graph gathers the units' parameters through FSDP's own hooks
            return module(*args, **kwargs)
        swapped = _swapped_tensors(self.model, module)
        if swapped:  # FSDP2 and the like put other tensors in the model's parameters: run on those
            outputs = torch.func.functional_call(module, swapped, args, kwargs, strict=False)
        else:
            outputs = module(*args, **kwargs)
        self._watch(outputs, base_key)
        self._note_stand_in_loss(outputs)
        return outputs

    def _forget_plans(self) -> None:
        for optimized in (self, *(self._parts or {}).values()):
            optimized._planned.clear()
            optimized._reused_calls.clear()
            optimized._recaptures.clear()
            optimized._modules_listed = None
            optimized._parameters_listed = None
            optimized._last = None

    def uninstall(self) -> None:
        """Undo ``optimize(..., in_place=True)``: the model runs its own forward again."""
        if not self._installed():
            raise PlannerError(f"no plan of this module is installed in {type(self.model).__name__}",
                               hint="uninstall() undoes optimize(..., in_place=True)")
        planned = self.model.__dict__["forward"]
        del self.model.forward, self.model._apply
        if planned.own is not None:
            self.model.forward = planned.own

    def _apply(self, fn, recurse=True):
        return self._moved(lambda: super(OptimizedModule, self)._apply(fn, recurse))

    def _moved(self, move: Callable[[], Any]) -> Any:
        """``move()`` (``.to()``, ``.double()``), dropping the plans when it moved a parameter or buffer: they were
        profiled for the old device or dtype, and their graphs hold the old tensors. A move to where the tensors
        are already (``Trainer`` moving the model to its device) keeps them."""
        before = _placements(self.model)
        moved = move()
        if _placements(self.model) != before:
            self._forget_plans()
        return moved

    def __getstate__(self) -> dict:
        """Pickled (``torch.save`` of the module, ``copy.deepcopy``) without its planned graphs, which hold code
        made at run time: the copy plans again on its first training call."""
        return {**super().__getstate__(), "_planned": collections.OrderedDict(), "_reused_calls": {},
                "_recaptures": [], "_open_calls": [], "_calls_seen": {}, "_modules_listed": None,
                "_modules_held": (),
                "_last": None}

    def __getattr__(self, name: str):
        """Attributes this wrapper lacks read through to the model (``config``, ``loss_type``, ...), as through
        ``torch.compile``'s wrapper: code that inspects the model, such as ``transformers.Trainer`` deciding how
        to count a causal LM's tokens, sees the model it trains."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            modules = self.__dict__.get("_modules", {})
            if name.startswith("__") or "model" not in modules:
                raise
            return getattr(modules["model"], name)

    def extra_repr(self) -> str:
        compiled = self._options.get("compile")
        return f"budget={self.budget!r}, plans={len(self._planned)}" + (
            "" if compiled is None else f", compile={compiled or True!r}")


class _PlannedForward:
    """The ``forward`` that ``optimize(..., in_place=True)`` gives the model itself: a training call with gradients
    on runs the plan, any other call the model's own forward (as do the parts of a model planned in parts, and
    planning: see :func:`_own_forward`)."""

    def __init__(self, optimized: OptimizedModule) -> None:
        self.optimized = optimized
        self.own = optimized.model.__dict__.get("forward")  # a forward the instance had already, else None

    @property
    def own_forward(self) -> Callable:
        """The model's own forward, bound: the instance's, or its class's."""
        model = self.optimized.model
        return self.own or type(model).forward.__get__(model)

    @property
    def __signature__(self) -> inspect.Signature:  # the model's (Trainer and export read it)
        return inspect.signature(self.own_forward)

    def run_own(self, *args: Any, **kwargs: Any) -> Any:
        return self.own_forward(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model = self.optimized.model
        if not (model.training and torch.is_grad_enabled()):
            return self.run_own(*args, **kwargs)
        return self.optimized._run_planned(self.run_own, args, kwargs)


class _ForgettingApply:
    """The model's ``_apply`` (what ``.to()``, ``.double()``, ``.cuda()`` call) once a plan is installed in it:
    see :meth:`OptimizedModule._moved`."""

    def __init__(self, optimized: OptimizedModule) -> None:
        self.optimized = optimized

    def __call__(self, fn: Callable, recurse: bool = True) -> torch.nn.Module:
        model = self.optimized.model
        return self.optimized._moved(lambda: type(model)._apply(model, fn, recurse))


def _install(optimized: OptimizedModule) -> None:
    model = optimized.model
    if isinstance(model.__dict__.get("forward"), _PlannedForward):
        raise PlannerError(f"{type(model).__name__} already runs a plan installed in place",
                           hint="call .uninstall() on the module optimize returned then, or plan that one again")
    if fsdp.sharding_of(model) is not None:
        raise PlannerError(f"in_place=True with FSDP: {type(model).__name__} is sharded with fully_shard, whose "
                           f"hooks the planned module runs itself",
                           hint="train the module optimize returns (in_place=False)")
    model.forward = _PlannedForward(optimized)
    model._apply = _ForgettingApply(optimized)


def optimize(model: torch.nn.Module, budget: int | str | None, example_inputs: Any = None, *,
             example_kwargs: dict | None = None, optimizer: torch.optim.Optimizer | None = None,
             solver: str = "auto", loss_fn: Callable | None = None, max_stages: int = 64,
             profile_repeats: int = 3, solver_options: dict | None = None,
             hold_outputs: bool = True, device: str | DeviceSpec | None = None,
             allocator_margin: float | None = None, ddp: bool = False,
             granularity: str | Granularity = Granularity.BLOCK, compile: bool | dict = False,
             in_place: bool = False, reuse_plans: bool = True, grads_held: bool | None = None,
             calls_per_step: int | None = None) -> OptimizedModule:
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
        ``"fewest_blocks"``, ``"whole"``).
    loss_fn : turns the model's output into the loss for profiling; by default the first scalar output (the
        ``loss`` of Hugging Face models given ``labels``), else a stand-in, the mean of the outputs' squares, which
        common losses fit (:func:`~planner.profile.default_loss`; a :class:`StandInLossWarning` says so).
    max_stages, profile_repeats, solver_options : how finely to cut the model, how many timed profiling runs,
        and options for the solver (``time_limit``, ``gap``).
    hold_outputs : whether your loop keeps the model's output alive through the backward
        (``out = model(x); out.loss.backward()`` does, ``loss_fn(model(x)).backward()`` does not).
    device : the GPU to plan for, by name (``"h100"``, ``"h200"``, ``"a100"``, ``"l4"``, ``"rtx4090"``) or a
        :class:`~planner.devices.DeviceSpec`: times then come from its roofline model instead of measurement, which
        is how a model on the meta device is planned. ``budget=None`` then means all of its memory.
    allocator_margin : the share of the budget left free for the CUDA caching allocator's rounding and
        fragmentation: the plan fits ``budget * (1 - allocator_margin)``. Default 0.05 when planning for a GPU
        (``device`` given or the model on CUDA), 0 on the CPU. Recorded in the plan.
    ddp : the module will train under ``DistributedDataParallel``: its gradient buckets (one more copy of the
        gradients) count into the per-rank budget. Recorded in the plan's ``extra``.
    granularity : where checkpoints may go: around whole repeated blocks (``"block"``, the default, as
        ``gradient_checkpointing_enable`` places them), around the blocks' layers (``"layer"``: attention, MLP,
        norms) or around the layers' modules (``"sublayer"``). Finer cuts let a tight budget recompute only the
        parts of a block that free the most memory per second; they make more stages, so solving takes longer.
    compile : ``True`` (or a dict of ``torch.compile``'s arguments, e.g. ``{"mode": "max-autotune"}``): the module
        runs the plan compiled, and the budget holds for the compiled step. Inductor fuses and reorders the planned
        forward and backward, so a compiled plan does not peak where the plan predicts for eager execution (mostly
        lower, sometimes higher); each plan is therefore compiled and one training step on the example inputs
        measured through the allocator (CUDA's ``max_memory_allocated``, the CPU allocator's profiler events), and
        planned again for a budget scaled by the miss (:mod:`planner.compiled`, at most 5 compilations) until a
        compiled step fits within 3% under the budget. The plan records the measured peak
        (``Plan.compiled_peak_bytes``); ``"60%"`` still means 60% of the eager peak. Dropout matches eager only with
        ``torch._inductor.config.fallback_random = True``. Outside training the model runs as is, uncompiled. Not
        with ``device=``, FSDP or a model that captures only in parts: ``torch.compile`` the module this returns
        instead.
    in_place : also make ``model`` itself run the plan: its ``forward`` (an attribute of the instance) calls the
        returned module in training with gradients on, and is its own otherwise; ``.to()`` and ``.double()`` on
        the model drop the plans made for the old device or dtype. Code that holds the model or checks its class
        then trains under the plan: ``transformers.Trainer`` saves it with ``save_pretrained``, as
        ``accelerate.unwrap_model`` finds the model itself. ``.uninstall()`` on the returned module undoes it.
        Not with FSDP.
    reuse_plans : a call on inputs no larger than those of a plan already made (a shorter sequence, a smaller last
        batch) runs that plan, captured for its shapes, without profiling or solving: the same graph with no
        tensor larger keeps and recomputes the same nodes within the same memory. Its ``Plan.reused_from`` names
        the plan, whose predictions it keeps as upper bounds. A dynamically padded dataset then plans once for its
        longest batch (pass it as ``example_inputs``), not once per length. A shape run under a reused plan gets
        its own, for the same budget, once its calls have spent on recomputation what planning took.
        ``False``: plan each new shape anew (the least recomputation for each; each takes a profile). Not with
        ``compile=``.
    grads_held : whether a step begins with the parameters holding gradients, as every micro-batch of gradient
        accumulation after the first does (and every step after ``zero_grad(set_to_none=False)``): the gradients
        are then fixed memory through the step (a GPT-2's 0.5 GB of them in fp32), and each new one a temporary
        that the backward adds into them. ``None`` (the default) looks at each call: a call that begins with a
        trained parameter holding a gradient runs a plan made for that (planned on first need, as for a new input
        shape), the others the plan made without. ``True`` or ``False`` plans every call one way. Not modelled
        under FSDP, whose plans are made without.
    calls_per_step : how many times a step calls the model before its backward (two augmented views through one
        encoder, a discriminator on real and on fake samples, ``loss(opt(a)) + loss(opt(b))``): each call before
        the last holds what its forward keeps for the backward, and its inputs, while the others run, so the plan
        is made to fit the budget with them (:func:`~planner.solvers.solve_for_calls`), and a percentage budget is
        of the eager step that calls it so. ``None`` (the default) learns it: a call made while another call's
        backward has not begun is planned for one more call a step, and so are the calls after it (the first step
        that does so may run its first calls under the plan for fewer: pass the number to plan for it from the
        start). Not modelled under FSDP.

    Under FSDP2, ``fully_shard`` the blocks and then the model (or the module this returns), before or after this
    call: the plan is made for this rank's share (a sharded model plans again on its first call; without
    ``example_inputs`` the first plan is the sharded one), every rank runs rank 0's plan, and the planned graph runs
    the blocks' FSDP hooks itself (see :mod:`planner.fsdp`).
    """
    options = dict(loss_fn=loss_fn, optimizer=optimizer, solver=solver, max_stages=max_stages,
                   profile_repeats=profile_repeats, solver_options=solver_options, hold_outputs=hold_outputs,
                   device=device, allocator_margin=allocator_margin, ddp=ddp,
                   granularity=granularity_of(granularity), compile=_compile_options(compile, device),
                   grads_held=grads_held,
                   calls_per_step=None if calls_per_step is None else _calls_option(calls_per_step))
    if budget is not None:
        parse_budget(budget)  # fail early on a malformed budget
    optimized = OptimizedModule(model, budget, planner_options=options, reuse_plans=reuse_plans)
    if example_inputs is not None or example_kwargs:
        optimized._plan_for(_as_args(example_inputs), without_unmasking_mask(model, dict(example_kwargs or {})))
    if in_place:
        _install(optimized)
    return optimized


REUSED_PLANS_KEPT = 32  # reused plans an OptimizedModule keeps (see OptimizedModule._forget_least_used_reused)
RECAPTURES_WARNED_AT = 8  # captures for changed constants before a RecaptureWarning (torch.compile's recompile limit)
GRADS_HELD = "grads held"  # the last item of the key of a plan made for steps that begin with gradients held


def _calls_option(calls_per_step: Any) -> int:
    """``calls_per_step`` checked: a whole number of at least 1.

    >>> _calls_option(2)
    2
    >>> _calls_option(0)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    planner.errors.PlannerError: calls_per_step=0 is not a number of calls. Hint: ...
    """
    if isinstance(calls_per_step, bool) or not isinstance(calls_per_step, int) or calls_per_step < 1:
        raise PlannerError(f"calls_per_step={calls_per_step!r} is not a number of calls",
                           hint="pass how many times a step calls the model before its backward, e.g. 2, or "
                                "leave it None to learn it")
    return calls_per_step


def _stored_key(planned: Planned) -> tuple:
    """The key an :class:`OptimizedModule` keeps ``planned`` under (see ``OptimizedModule._key``)."""
    if planned.captured.sharding is not None:
        return planned.captured.key
    return _with_step(planned.captured.key, planned.plan.grads_held, planned.plan.calls_per_step)


def _with_step(key: tuple, grads_held: bool, calls_per_step: int) -> tuple:
    """``key`` (:func:`~planner.capture.plan_key`) for steps that begin with gradients held or that call the
    model more than once before their backward."""
    return (*key, *((GRADS_HELD,) if grads_held else ()),
            *((("calls", calls_per_step),) if calls_per_step > 1 else ()))


class DoubleBackwardWarning(UserWarning):
    """A backward with ``create_graph=True`` ran through a plan made for steps of one backward (until 2026-12-07
    silently: a gradient penalty's step of a 4-block MLP planned at 70% peaked at 3.1 times its budget)."""


class StandInLossWarning(UserWarning):
    """A model whose outputs hold no scalar loss was planned without ``loss_fn``: for a stand-in loss (the mean of
    the outputs' squares, :func:`~planner.profile.default_loss`), which keeps an output-sized tensor and makes the
    outputs' gradients whole, as mean squared error does; a loss that frees more (cross-entropy frees one
    output-sized tensor more) is planned for exactly, and fits more, when passed as ``loss_fn``."""


def stand_in_loss_bytes(outputs: Any) -> int:
    """Bytes of the outputs a stand-in loss was planned for: those that require grad, where none is a scalar (a
    loss); 0 where one is (:func:`~planner.profile.default_loss` takes it).

    >>> import torch
    >>> stand_in_loss_bytes(torch.ones(4, 8, requires_grad=True))
    128
    >>> stand_in_loss_bytes({"loss": torch.ones((), requires_grad=True), "logits": torch.ones(4, 8)})
    0
    """
    scalar, leaves = trained_outputs(outputs)
    return 0 if scalar is not None else sum(t.numel() * t.element_size() for t in leaves)


class _OpenCall:
    """A training call whose backward has not begun (see ``OptimizedModule._watch``)."""

    __slots__ = ("key", "done", "__weakref__")

    def __init__(self, key: tuple):
        self.key = key  # the plan's key, without the step's (see OptimizedModule._calls_per_step)
        self.done = False


def _replannable_budget(plan: Plan) -> int | str:
    """The budget to plan new input shapes under: as the plan's user wrote it, else its bytes."""
    if plan.budget_text:
        try:
            parse_budget(plan.budget_text)
            return plan.budget_text
        except PlannerError:
            pass
    return plan.budget_bytes or "100%"


def apply(model: torch.nn.Module, plan: Plan, example_inputs: Any = None, *,
          example_kwargs: dict | None = None) -> OptimizedModule:
    """Turn a saved ``plan`` into a module for ``model``; the model and input shapes must match the plan's.

    The module runs eagerly; a plan made with ``compile=`` (its ``compiled_peak_bytes`` set) peaks where it was
    measured once the module is passed to ``torch.compile`` with the same arguments."""
    sharding = fsdp.sharding_of(model)
    example_kwargs = without_unmasking_mask(model, dict(example_kwargs or {}))
    with fsdp.unsharded_for_capture(model) if sharding is not None else contextlib.nullcontext():
        captured = dataclasses.replace(capture(model, _as_args(example_inputs), example_kwargs,
                                               replay_dropout=not plan.timing.startswith("analytic")),
                                       sharding=sharding)
    found = fingerprint(captured, as_device="meta" if plan.device == "meta" else None)  # meta plans fit any device
    if plan.fingerprint and found != plan.fingerprint:
        raise PlannerError(f"the plan was made for fingerprint {plan.fingerprint}, but this model with these "
                           f"inputs has {found}: the model's graph, parameter shapes or input shapes differ",
                           hint="re-plan with planner.plan(model, budget, example_inputs)")
    if plan.stage_nodes:  # the plan's stages, with the layout copies this graph makes where its device put them
        plan = dataclasses.replace(plan, stage_nodes=placed_stage_nodes(captured.graph_module.graph,
                                                                        plan.stage_nodes))
    optimized = OptimizedModule(model, _replannable_budget(plan),
                                planner_options=dict(loss_fn=None, optimizer=None, solver=plan.solver,
                                                     max_stages=64, profile_repeats=3, solver_options=None,
                                                     ddp=dict(plan.extra).get("ddp_bucket_bytes") is not None,
                                                     granularity=granularity_of(
                                                         dict(plan.extra).get("granularity", "block"))))
    optimized.add_plan(Planned(captured, None, plan))
    return optimized
