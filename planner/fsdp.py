"""FSDP2 (``fully_shard``) units inside a planned model: found, captured, driven and counted per rank.

The planned module is one ``fx.GraphModule``: the model's blocks are no longer called as modules, so the forward
hooks ``fully_shard`` put on each block (all-gather before, reshard after, gradient hooks) would never fire. This
module puts them back as nodes of the graph, at the same places the block's ``forward`` began and ended:

* ``enter`` before the first node of a unit: FSDP's pre-forward (all-gather the unit's parameters, register the
  post-backward hook that reduce-scatters its gradients) on the tensors flowing into the unit;
* ``exit`` after its last node: FSDP's post-forward (reshard, register the pre-backward hook that all-gathers the
  parameters again for the backward) on the tensors flowing out;
* ``ensure`` at the start of every stage that reads a unit's parameters: nothing in the forward; when a checkpoint
  region is recomputed during the backward, the unit's parameters are all-gathered if they were resharded (a region
  may span blocks: the earlier block's backward has not begun, so FSDP has not gathered it yet), and the unit's
  ``exit`` reshards them again once the recomputation leaves a unit whose backward has not begun.

The captured graph holds FSDP's unsharded parameter objects, whose storage FSDP frees and refills in place, so
the graph reads whatever FSDP gathered. Units are found on the model and its submodules (the model itself may be
the root) and on the wrapper :func:`planner.optimize` returns (``fully_shard(optimized)``, path ``None``): the
wrapper's own hooks still fire around its ``forward``, so the graph drives it only in the step planning measures.

Planning a sharded model (:func:`planner.api._plan_sharded`; every rank plans together): the model is captured and
profiled with every unit gathered (the whole model, on every rank, for that while), each sharded parameter and
gradient then counts at the size of this rank's shard (:func:`per_rank_profile`), and one eager step runs with the
units' hooks under a meter that sees FSDP's gathered parameters (:func:`per_rank_problem`): its per-stage peaks,
gathered blocks, unsharded gradients and reduce-scatter buffers included, set the workspaces, so a percentage
budget is of that per-rank step. Every rank then runs rank 0's plan (:func:`rank_zero_plan`), as a recomputed
region's all-gathers must meet the same collectives on every rank; for the same reason every rank must see inputs
of one shape (:func:`check_same_inputs_on_all_ranks`).

All of this uses FSDP2's private state (``_get_fsdp_state``, ``_pre_forward``, parameter groups): the public API has
no way to run a module's FSDP hooks without calling the module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx as fx

from .capture import CapturedGraph
from .costmodel import calibrate
from .errors import PlannerError
from .meter import storage_bytes
from .problem import Problem
from .profile import GraphProfile, measure_stages
from .timing import Stopwatch

_HINT = "shard each block with fully_shard(block) and then the model with fully_shard(model), then plan"


def _fsdp_module_type():
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a build without distributed
        return None
    return FSDPModule


@dataclass(frozen=True)
class ShardedUnit:
    """One ``fully_shard`` unit: the module at ``path`` in the model ("" for the model itself, None for the wrapper
    around it), the parameters it shards (names in the model, tied ones under each name) with the bytes of this
    rank's shard of each, and over how many ranks."""

    path: str
    param_names: tuple[str, ...]
    param_shard_bytes: tuple[int, ...]
    world_size: int
    shard_bytes: int  # this rank's bytes of all the unit's parameters (a tied one once)


@dataclass(frozen=True)
class Sharding:
    """The model's ``fully_shard`` units, outermost first."""

    units: tuple[ShardedUnit, ...]

    @property
    def signature(self) -> tuple:
        """What a plan is cached under: the units' paths and world sizes."""
        return tuple((u.path, u.world_size) for u in self.units)

    def unit_of_param(self) -> dict[str, ShardedUnit]:
        return {name: u for u in self.units for name in u.param_names}


def _state(module: torch.nn.Module):
    return module._get_fsdp_state()


def _groups(module: torch.nn.Module) -> list:
    """The FSDP parameter groups of ``module``'s ``fully_shard``: a list in torch 2.13, at most one before (the
    GPU machines' torch 2.11)."""
    state = _state(module)
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [group] if group is not None else []


def _fsdp_params(module: torch.nn.Module) -> list:
    return [fp for group in _groups(module) for fp in group.fsdp_params]


def is_sharded(module: torch.nn.Module | None) -> bool:
    fsdp_module = _fsdp_module_type()
    return fsdp_module is not None and isinstance(module, fsdp_module)


def fsdp_units(model: torch.nn.Module,
               wrapper: torch.nn.Module | None = None) -> list[tuple[str | None, torch.nn.Module]]:
    """``(path, module)`` of every module ``fully_shard`` was applied to, outermost first: ``wrapper`` (path None)
    when it is sharded, then ``model`` and its submodules."""
    outer = [(None, wrapper)] if is_sharded(wrapper) else []
    if _fsdp_module_type() is None:
        return outer
    return outer + [(path, m) for path, m in model.named_modules() if is_sharded(m)]


def _unit_module(model: torch.nn.Module, wrapper: torch.nn.Module | None, path: str | None) -> torch.nn.Module:
    return wrapper if path is None else model.get_submodule(path)


def _world_size(module: torch.nn.Module) -> int:
    return max((g.mesh_info.shard_mesh_size for g in _groups(module)), default=1)


def units_signature(model: torch.nn.Module, wrapper: torch.nn.Module | None = None) -> tuple | None:
    """``(path, world size)`` of each ``fully_shard`` unit (see :func:`fsdp_units`): what plans are cached under;
    None when there are none."""
    units = fsdp_units(model, wrapper)
    return tuple((path, _world_size(module)) for path, module in units) if units else None


def sharding_of(model: torch.nn.Module, wrapper: torch.nn.Module | None = None) -> Sharding | None:
    """The ``fully_shard`` units of ``model`` and ``wrapper`` (see :func:`fsdp_units`), or None without any."""
    units = fsdp_units(model, wrapper)
    if not units:
        return None
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    for path, module in units:
        _check_unit(path, module)
    return Sharding(tuple(_describe_unit(path, module, names) for path, module in units))


def _unit_name(path: str | None) -> str:
    return "the optimized module" if path is None else repr(path) if path else "the model"


def _check_unit(path: str | None, module: torch.nn.Module) -> None:
    """Raise for the ``fully_shard`` uses planner cannot drive."""
    if len(_state(module)._modules) != 1:
        raise PlannerError(f"fully_shard was applied to a list of modules including {_unit_name(path)}; planner "
                           "runs the hooks of units of one module each", hint=_HINT)
    if any(group.mp_policy.param_dtype is not None for group in _groups(module)):
        raise PlannerError(f"{_unit_name(path)} is sharded with a MixedPrecisionPolicy's param_dtype; planner "
                           "captures and profiles the model in its parameters' own dtype",
                           hint="train under torch.autocast instead of with FSDP's param_dtype")


def _describe_unit(path: str | None, module: torch.nn.Module, names: dict[int, list[str]]) -> ShardedUnit:
    shards = [(fp, fp.sharded_param.to_local()) for fp in _fsdp_params(module)]
    named = [(n, storage_bytes([local])) for fp, local in shards for n in names.get(id(fp.sharded_param), ())]
    return ShardedUnit(path, tuple(n for n, _ in named), tuple(b for _, b in named), _world_size(module),
                       shard_bytes=storage_bytes(local for _, local in shards))


@contextlib.contextmanager
def unsharded_for_capture(model: torch.nn.Module, wrapper: torch.nn.Module | None = None) -> Iterator[None]:
    """All units' parameters gathered (every rank must enter this together) and their forward hooks set aside, so
    ``torch.export`` sees a plain model holding FSDP's unsharded parameter objects; resharded on the way out."""
    units = [m for _, m in fsdp_units(model, wrapper)]
    hooks = []
    for module in units:
        module.unshard()
    try:
        for module in units:
            hooks.append((module, module._forward_pre_hooks, module._forward_hooks))
            module._forward_pre_hooks, module._forward_hooks = type(module._forward_pre_hooks)(), \
                type(module._forward_hooks)()
        yield
    finally:
        for module, pre, post in hooks:
            module._forward_pre_hooks, module._forward_hooks = pre, post
        for module in units:
            module.reshard()


def unsharded_storages(model: torch.nn.Module, wrapper: torch.nn.Module | None = None) -> list[torch.Tensor]:
    """The tensors whose storage FSDP2 allocates and frees in place (``resize_``) for the unsharded parameters: a
    :class:`~planner.meter.LiveMemoryMeter` given these counts their current size at every op."""
    tensors = []
    for _, module in fsdp_units(model, wrapper):
        for fp in _fsdp_params(module):
            tensors.extend(fp.all_gather_outputs)
            tensors.extend(getattr(fp, "_unsharded_inner_tensors", ()))
    return tensors


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class UnitHooks:
    """The three graph nodes of one unit (see the module docstring); their targets are this object's methods."""

    def __init__(self, module: torch.nn.Module, path: str | None):
        self.module = module
        self.path = path

    def _backward_started(self) -> bool:
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
        return _state(self.module)._training_state == TrainingState.PRE_BACKWARD

    def enter(self, *inputs: Any) -> tuple:
        if _in_backward():  # recomputing a region: gather, no new hooks
            self.ensure()
            return inputs
        args, _ = _state(self.module)._pre_forward(self.module, inputs, {})
        return tuple(args)

    def exit(self, *outputs: Any) -> tuple:
        if _in_backward():
            if not self._backward_started():  # recomputed ahead of the unit's own backward: let go again
                for group in _groups(self.module):
                    if group.is_unsharded:
                        group.reshard()
            return outputs
        return tuple(_state(self.module)._post_forward(self.module, (), outputs))

    def ensure(self) -> None:
        if not _in_backward():
            return
        for group in _groups(self.module):
            if not group.is_unsharded:
                group.unshard()
                group.wait_for_unshard()


def _in_scope(node: fx.Node, path: str | None) -> bool | None:
    """Whether ``node`` runs inside the unit at ``path``; None for a node no module claims (it breaks no run)."""
    if not path:  # the model, or the wrapper around it
        return True
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    return any(entry[0] == path for entry in stack.values())


def _scope(compute: list[fx.Node], path: str | None) -> list[fx.Node]:
    """The nodes from the unit's first to its last, in order; raise when another module's run in between."""
    inside = [i for i, n in enumerate(compute) if _in_scope(n, path)]
    if not inside:
        return []
    span = compute[inside[0]:inside[-1] + 1]
    stray = next((n.name for n in span if _in_scope(n, path) is False), None)
    if stray is not None:
        raise PlannerError(f"the nodes of the sharded unit {_unit_name(path)} do not run in one piece ({stray} runs "
                           "in between): planner calls FSDP's hooks where the unit begins and ends",
                           hint="shard modules that run once per step, each in one call")
    return span


def check_units_run_in_one_piece(graph_module: fx.GraphModule, sharding: Sharding) -> None:
    """Raise when a unit's nodes are interleaved with others' (a block called twice, say): its hooks have one
    place to begin and one to end."""
    compute = [n for n in graph_module.graph.nodes if n.op == "call_function"]
    for unit in sharding.units:
        _scope(compute, unit.path)


def _insert_enter(graph: fx.Graph, hooks: UnitHooks, scope: list[fx.Node]) -> list[fx.Node]:
    inside = set(scope)
    inputs = []
    for n in scope:
        for src in n.all_input_nodes:
            if src not in inside and src.op != "get_attr" and src not in inputs:
                inputs.append(src)
    with graph.inserting_before(scope[0]):
        enter = graph.call_function(hooks.enter, tuple(inputs))
        items = [graph.call_function(operator.getitem, (enter, i)) for i in range(len(inputs))]
    for n in scope:
        for src, item in zip(inputs, items):
            n.replace_input_with(src, item)
    return [enter, *items]


def _insert_exit(graph: fx.Graph, hooks: UnitHooks, scope: list[fx.Node]) -> list[fx.Node]:
    inside = set(scope)
    outputs = [n for n in scope if any(u not in inside for u in n.users)]
    users = {n: [u for u in n.users if u not in inside] for n in outputs}
    with graph.inserting_after(scope[-1]):
        exit_ = graph.call_function(hooks.exit, tuple(outputs))
    added = [exit_]
    for i, n in enumerate(outputs):
        with graph.inserting_after(added[-1]):
            added.append(graph.call_function(operator.getitem, (exit_, i)))
        for user in users[n]:
            user.replace_input_with(n, added[-1])
    return added


def _units_read_per_stage(compute: list[fx.Node], stage_of: dict[str, int],
                          sharding: Sharding) -> dict[int, tuple[fx.Node, list[str | None]]]:
    """Per stage: its first node and the paths of the units whose parameters its nodes read."""
    unit_of_param = sharding.unit_of_param()
    found: dict[int, tuple[fx.Node, list[str]]] = {}
    for n in compute:
        first, paths = found.setdefault(stage_of[n.name], (n, []))
        for src in n.all_input_nodes:
            unit = unit_of_param.get(src.target) if src.op == "get_attr" else None
            if unit is not None and unit.path not in paths:
                paths.append(unit.path)
    return found


def with_unit_hooks(graph_module: fx.GraphModule, stage_nodes: Sequence[Sequence[str]], model: torch.nn.Module,
                    sharding: Sharding, wrapper: torch.nn.Module | None = None,
                    drive_wrapper: bool = False) -> tuple[fx.GraphModule, tuple[tuple[str, ...], ...]]:
    """A copy of ``graph_module`` (sharing its parameters) with each unit's ``enter``/``exit``/``ensure`` nodes,
    and ``stage_nodes`` with the new nodes in the stages where they run. The sharded ``wrapper``'s own hooks fire
    around its forward: its nodes are added only with ``drive_wrapper`` (a step run without the wrapper)."""
    driven = Sharding(tuple(u for u in sharding.units if u.path is not None or drive_wrapper))
    graph = fx.Graph()
    graph._codegen = graph_module.graph._codegen
    graph.output(graph.graph_copy(graph_module.graph, {}))  # names are kept: the graph is copied into an empty one
    stage_of = {name: k for k, names in enumerate(stage_nodes) for name in names}
    compute = [n for n in graph.nodes if n.op == "call_function" and n.name in stage_of]
    hooks_of = {u.path: UnitHooks(_unit_module(model, wrapper, u.path), u.path) for u in driven.units}
    added = _insert_boundaries(graph, compute, stage_of, driven, hooks_of)
    added.update(_insert_ensures(graph, compute, stage_of, driven, hooks_of))
    result = fx.GraphModule(graph_module, graph, class_name=type(graph_module).__name__)
    for attr in ("_in_spec", "_out_spec"):
        if hasattr(graph_module, attr):
            setattr(result, attr, getattr(graph_module, attr))
    return result, _restaged(graph, {**stage_of, **added}, len(stage_nodes))


def _insert_boundaries(graph: fx.Graph, compute: list[fx.Node], stage_of: dict[str, int], driven: Sharding,
                       hooks_of: dict) -> dict[str, int]:
    """Each unit's ``enter`` (in the stage of its first node) and ``exit`` (of its last); their stages by name."""
    added: dict[str, int] = {}
    for unit in driven.units:  # outermost first: an inner unit's hooks then sit inside the outer unit's
        scope = _scope(compute, unit.path)
        if scope:
            added.update({n.name: stage_of[scope[0].name] for n in _insert_enter(graph, hooks_of[unit.path], scope)})
            added.update({n.name: stage_of[scope[-1].name] for n in _insert_exit(graph, hooks_of[unit.path], scope)})
    return added


def _insert_ensures(graph: fx.Graph, compute: list[fx.Node], stage_of: dict[str, int], driven: Sharding,
                    hooks_of: dict) -> dict[str, int]:
    """An ``ensure`` at the start of each stage for each unit whose parameters it reads; their stages by name."""
    added: dict[str, int] = {}
    for k, (first, paths) in _units_read_per_stage(compute, stage_of, driven).items():
        for path in paths:
            with graph.inserting_before(first):
                added[graph.call_function(hooks_of[path].ensure, ()).name] = k
    return added


def _restaged(graph: fx.Graph, stage_of: dict[str, int], num_stages: int) -> tuple[tuple[str, ...], ...]:
    stages: list[list[str]] = [[] for _ in range(num_stages)]
    for n in graph.nodes:
        if n.name in stage_of:
            stages[stage_of[n.name]].append(n.name)
    return tuple(tuple(names) for names in stages)


def per_rank_profile(profile: GraphProfile, graph_module: fx.GraphModule, sharding: Sharding) -> GraphProfile:
    """``profile`` (made with every unit gathered) as one rank keeps it between steps: each sharded parameter, and
    its gradient, at the size of this rank's shard. What is gathered during the step is measured by
    :func:`per_rank_problem`."""
    shard_of = {name: nbytes for u in sharding.units for name, nbytes in zip(u.param_names, u.param_shard_bytes)}
    params = dict(graph_module.named_parameters(remove_duplicate=False))
    gathered = storage_bytes(params[name] for name in shard_of if name in params)
    fixed = profile.fixed_bytes - gathered + sum(u.shard_bytes for u in sharding.units)
    grads = {name: shard_of.get(name, nbytes) for name, nbytes in profile.param_grad_bytes.items()}
    return dataclasses.replace(profile, fixed_bytes=fixed, param_grad_bytes=grads)


class _MemoryOnly(Stopwatch):
    """Times nothing: the FSDP step is run once, for its memory."""

    name = "memory_only"
    warmup = 0

    def stamp(self) -> float:
        return 0.0

    def seconds(self, start: Any, end: Any) -> float:
        return 0.0

    def runs(self, repeats: int) -> list[bool]:
        return []

    def combine(self, samples: Sequence[float]) -> float:
        return min(samples, default=0.0)


@contextlib.contextmanager
def gradients_set_aside(model: torch.nn.Module) -> Iterator[None]:
    """The model's gradients (FSDP's sharded ones) put aside while planning runs a step of its own, then restored:
    the step neither adds to them nor leaves its own behind."""
    params = list(model.parameters())
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        yield
    finally:
        for p, grad in zip(params, grads):
            p.grad = grad


def per_rank_problem(problem: Problem, stage_nodes: Sequence[Sequence[str]], captured: CapturedGraph,
                     model: torch.nn.Module, sharding: Sharding, *, loss_fn, hold_outputs: bool,
                     wrapper: torch.nn.Module | None = None) -> Problem:
    """``problem``'s memory as one rank sees it: one eager step of the captured graph runs with FSDP's hooks (every
    rank runs it together), and its stages' measured peaks, gathered parameters and unsharded gradients included,
    calibrate the workspaces. Times stay as ``problem`` measured them.

    A region is recomputed at the start of the backward of its last stage, whose unit FSDP has gathered for that
    backward: those bytes count into the recomputation too (with the gradients of the stage's outputs), on top of
    the recomputed stages' forward workspaces, which hold their own units' gathering.
    """
    graph_module, hooked_stages = with_unit_hooks(captured.graph_module, stage_nodes, model, sharding, wrapper,
                                                  drive_wrapper=True)
    hooked = dataclasses.replace(captured, graph_module=graph_module)
    stage_of = {name: k for k, names in enumerate(hooked_stages) for name in names}
    with gradients_set_aside(model):
        measured = measure_stages(hooked, stage_of, len(hooked_stages), loss_fn=loss_fn, hold_outputs=hold_outputs,
                                  stopwatch=_MemoryOnly(),
                                  resizable=lambda: unsharded_storages(model, wrapper))
    calibrated = calibrate(problem, measured)
    held = gathered_bytes_per_stage(captured.graph_module, stage_nodes, sharding)
    stages = tuple(dataclasses.replace(new, backward_seconds=old.backward_seconds,
                                       output_grad_bytes=new.output_grad_bytes + held[k])
                   for k, (old, new) in enumerate(zip(problem.stages, calibrated.stages)))
    return dataclasses.replace(problem, stages=stages)


def gathered_bytes_per_stage(graph_module: fx.GraphModule, stage_nodes: Sequence[Sequence[str]],
                             sharding: Sharding) -> list[int]:
    """Per stage, the bytes FSDP gathers for the largest unit whose parameters the stage reads (0 for none); not for
    the root (the model or the wrapper), which FSDP keeps gathered from the forward to the end of the backward."""
    stage_of = {name: k for k, names in enumerate(stage_nodes) for name in names}
    compute = [n for n in graph_module.graph.nodes if n.op == "call_function" and n.name in stage_of]
    units = {u.path: u for u in sharding.units}
    held = [0] * len(stage_nodes)
    for k, (_, paths) in _units_read_per_stage(compute, stage_of, sharding).items():
        held[k] = max((units[p].shard_bytes * units[p].world_size for p in paths if p), default=0)  # not the root
    return held


def _world() -> int:
    import torch.distributed as dist
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def check_same_inputs_on_all_ranks(signature: tuple) -> None:
    """Raise on every rank (all must call this together) when the ranks plan for different input shapes: they must
    run the same plan, and each new shape is planned by all of them together."""
    import torch.distributed as dist
    if _world() == 1:
        return
    found: list[Any] = [None] * _world()
    dist.all_gather_object(found, repr(signature))
    if len(set(found)) > 1:
        differ = [rank for rank, seen in enumerate(found) if seen != found[0]]
        raise PlannerError(f"ranks {differ} plan for other input shapes than rank 0; under FSDP every rank must run "
                           "the same plan (a recomputed region gathers parameters: the collectives must match)",
                           hint="give every rank batches of one shape in each step (pad them to it)")


def rank_zero_plan(solve: Callable[[], Any]) -> Any:
    """Rank 0's ``solve()`` on every rank (all must call this together), or rank 0's error raised on every rank.

    FSDP's collectives, the all-gathers a recomputed region makes among them, must come in the same order on every
    rank, so every rank runs the same regions: each solves its own measurements, and rank 0's outcome wins (a
    budget a rank found just feasible must not send it on alone to wait for the others)."""
    import torch.distributed as dist
    try:
        outcome: tuple = ("plan", solve())
    except PlannerError as exc:
        outcome = ("planner_error", type(exc), exc.message, exc.hint, exc.minimum_budget_bytes)
    except Exception as exc:
        if _world() == 1 or dist.get_rank() != 0:
            raise
        dist.broadcast_object_list([("error", f"{type(exc).__name__}: {exc}")], src=0)
        raise
    if _world() > 1:
        shared = [outcome]
        dist.broadcast_object_list(shared, src=0)
        outcome = shared[0]
    if outcome[0] == "plan":
        return outcome[1]
    if outcome[0] == "error":
        raise PlannerError(f"rank 0 failed to plan ({outcome[1]})", hint="see rank 0's error")
    _, error_type, message, hint, minimum = outcome
    raise error_type(message, hint=hint, minimum_budget_bytes=minimum)
