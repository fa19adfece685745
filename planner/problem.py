"""The planning problem as plain data, and the execution model every solver optimizes.

A model is a sequence of *stages* (contiguous runs of graph nodes in topological order, usually one layer each).
A :class:`Schedule` says which stages run normally ("stored": autograd keeps what their backward needs) and which
run inside non-reentrant checkpoint *regions* (contiguous runs of stages) with a selective-checkpoint option that
names the nodes whose outputs are cached instead of recomputed.

:func:`simulate` is the execution model: it replays one training step (forward, then backward from the last stage
to the first) and tracks every tensor storage the way PyTorch frees it. It is the ground truth the solvers encode
(``solvers.ilp`` states exactly these rules as linear constraints) and the predictor whose numbers every plan
carries. The rules, for a tensor ``t`` produced by stage ``p``:

* forward: alive from ``p`` until its last forward reader, and to the end of the forward if something *holds* it
  or the model returns it; a tensor that nothing holds, the model does not return and no later stage reads lives
  and dies inside stage ``p``: it is part of that stage's forward workspace, not counted on its own. A stage that
  reads last tensors nothing saves (see :func:`last_rerun_reader`) while something holds some of them may need
  more in its forward: the eager step frees them inside the stage (:meth:`Stage.held_input_forward`);
* holders, each releasing ``t`` after the backward of a stage ``h``: a stored stage that saves ``t`` (``h`` = that
  stage); a region that reads ``t`` from outside (checkpoint keeps its inputs; ``h`` = the region's first stage);
  the selective-checkpoint cache of ``p``'s region (``h`` = the first stage of the region that saves ``t``; when no
  stage there saves it, the region's recomputation consumes and frees it); a model output (``h`` = -1: the caller
  holds it throughout);
* backward: at the start of stage ``k``'s backward, ``t`` is alive when some holder has ``h <= k``; a stage's
  backward frees what only it held as it goes, so its peak is taken as what outlives it (holders ``h <= k - 1``,
  recomputed copies still needed by earlier stages of its region) plus a measured *backward workspace* (its own
  saved tensors not yet freed, activation gradients, temporaries), or as everything alive when it starts plus a
  measured *backward-start workspace*, whichever of the two moments is higher;
* recomputation: when the backward reaches the last stage ``b`` of a region, the region re-runs its stages in order
  and every tensor they save is materialised again (a second copy if the original is still held elsewhere, no copy
  if cached); each copy lives until the backward of the first stage in the region that saves it. While stage ``j``
  of the region re-runs, alive are what is alive when ``b``'s backward starts, the caches not yet consumed (a cached
  tensor that no stage saves is gone once its last reader, or its own stage, has re-run, if the region holds it no
  longer: :func:`cached_dies_with`), the activation gradients sent back past ``b`` (``Stage.output_grad_bytes``),
  what the region's earlier stages *keep* (their tensors that are saved, read by a later stage or model outputs,
  unless cached; one that nothing saves and only stages of the region read dies once the last of them has re-run:
  :func:`last_rerun_reader`) and ``j``'s own working set: what it keeps plus its *recompute workspace* with its
  option (which holds the inputs ``j`` frees as a region holds its inputs; less what those of them that the region
  made itself free again: ``Stage.input_savings``, :func:`input_saving`). A region that caches nothing stops after
  its last stage's last saving op, so that stage's working set is what its re-run has made by then and still holds
  (:meth:`Stage.stopped_rerun`); a region that caches runs to its end;
* gradients of parameters appear during the backward of the stage that uses them last and stay.

Workspaces (temporaries, activation gradients in flight) are per stage and come from measurement; a caching option
carries its own recompute workspace (``costmodel`` replays the re-run node by node), and every option the forward
workspace of its stage inside a region, where what the stage saves is not kept and dies after its last reader
(replayed the same way; :meth:`Stage.forward_workspace_of`).

Time: each recomputed stage costs its option's recompute seconds, but the last stage of a region that caches
nothing only up to its last saving op (:meth:`Stage.stopped_seconds`); each region costs ``region_seconds`` itself,
a region that caches ``caching_region_seconds`` more (its cache: :mod:`planner.rewrite`), and a step with
any region ``per_step_seconds`` (:func:`recompute_seconds`, :func:`simulate`).

>>> stages = tuple(Stage(f"s{i}", forward_seconds=1.0, backward_seconds=2.0) for i in range(3))
>>> tensors = tuple(TensorInfo(f"t{i}", 100, producer=i, consumers=frozenset({i + 1}) if i < 2 else frozenset(),
...                            savers=frozenset({i, i + 1}) if i < 2 else frozenset({i}), node=f"n{i}")
...                 for i in range(3))
>>> problem = Problem(stages, tensors, fixed_bytes=1000)
>>> simulate(problem, Schedule.store_all(3)).peak_bytes
1300
>>> simulate(problem, Schedule.uniform(3)).peak_bytes, simulate(problem, Schedule.uniform(3)).recompute_seconds
(1300, 3.0)
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence


@dataclass(frozen=True)
class RecomputeOption:
    """One way to recompute a stage: which of its nodes are cached, and the forward time the rest costs again.

    ``workspace_bytes``: the stage's recompute workspace with this option (see :meth:`Stage.recompute_workspace_of`);
    None takes the stage's own ``recompute_workspace``. ``forward_bytes``: the most bytes the stage's first forward
    inside a region holds beyond what the execution model counts (what it makes and frees again: under a
    checkpoint nothing it saves is kept), when that is above its ``forward_workspace_bytes`` (see
    :meth:`Stage.forward_workspace_of`); None: no more than that.
    """

    name: str
    cached_nodes: frozenset[str]
    recompute_seconds: float
    workspace_bytes: int | None = None
    forward_bytes: int | None = None


@dataclass(frozen=True)
class InputSaving:
    """What a stage's re-run holds less, per option (``option_bytes[o]``), than its working set counts when its
    region starts at or before stage ``since``: that region's re-run made the inputs the stage frees (tensors of
    earlier stages that it reads last and nothing saves) from ``since`` on, and they die inside the stage as in
    the eager step, where its working set holds them as a region holds its inputs. An option the tuple does not
    reach saves nothing. ``option_bytes`` holds wherever the stage is in its region, the last stage of one that
    stops early after it included; ``through_bytes`` (where it says more) where a later stage of the region
    follows, so that the stage's re-run runs through (empty: the same).

    >>> InputSaving(since=2, option_bytes=(100, 40)).of(1), InputSaving(since=2, option_bytes=(100,)).of(1)
    (40, 0)
    >>> saving = InputSaving(since=2, option_bytes=(0, 40), through_bytes=(120, 40))
    >>> saving.of(0), saving.of(0, through=True), saving.of(1, through=True)
    (0, 120, 40)
    """

    since: int
    option_bytes: tuple[int, ...]
    through_bytes: tuple[int, ...] = ()

    def of(self, option: int, through: bool = False) -> int:
        """The saving with ``option``; ``through``: where a later stage of the region follows."""
        least = self.option_bytes[option] if option < len(self.option_bytes) else 0
        if through and option < len(self.through_bytes):
            return max(least, self.through_bytes[option])
        return least


@dataclass(frozen=True)
class HeldInputs:
    """What a stage's replayed forward peak rises by (``excess_bytes``) while the tensors named ``tensors`` (ones
    it reads last and nothing saves, which the eager step frees inside it) are held through it."""

    tensors: frozenset[str]
    excess_bytes: int


@dataclass(frozen=True)
class BackwardEpoch:
    """A stretch of a stage's eager backward between two frees of the tensors of earlier stages that the stage saves
    last (the eager step frees them inside its backward): which of them are still alive in it (``alive``), and how
    much less than the stage's backward workspace it needs at its busiest (``below_bytes``), those tensors
    included."""

    alive: frozenset[str]
    below_bytes: int = 0


@dataclass(frozen=True)
class Stage:
    """A contiguous run of graph nodes, measured.

    ``options`` lists the ways to recompute it; when empty, the one way is to recompute everything.
    ``stopped_rerun_bytes``: the most bytes the stage's re-run holds at once (what it makes: saved tensors, values
    still to be read, outputs, temporaries) when it is the last stage of a region that caches nothing, whose re-run
    stops after its last saving op (see :meth:`stopped_rerun`); None: what it saves itself plus its workspace.
    ``grad_bytes`` counts parameter gradients first produced during this stage's backward;
    ``output_grad_bytes`` the activation gradients that later stages have sent back to this stage or earlier ones
    when its backward starts (alive while it is recomputed): on a chain, those of its outputs; and, measured, what
    its own backward makes before it first reads a saved tensor, where a region ending here begins its re-run (under
    autocast, a residual add's backward casts the gradient for its bf16 branch).
    ``early_stop_seconds``: what the re-run of this stage skips as the last stage of a region that caches nothing
    (see :meth:`stopped_seconds`): the forward time of the ops after its last saving op, and of that op itself
    when it saves only its inputs (autograd saves them before the op runs).
    ``held_input_bytes``: what the stage's forward needs more when the tensors of earlier stages that it reads last
    and nothing holds (the eager step frees them inside it) stay alive throughout it, as when a checkpoint region
    holds them; ``costmodel.calibrate`` adds it to the recompute workspace. None: all of those tensors' bytes.
    ``held_inputs``: what the stage's replayed forward peak rises by when some of those tensors are held through
    it (a region reading them from outside keeps them as its inputs, or a cache keeps them): one
    :class:`HeldInputs` per set of them that can be held apart. ``forward_overcount_bytes``: what the model counts
    in the stage's forward beyond its measured eager peak (those tensors, counted all through the stage where the
    eager step frees them early), which the forward workspace, at least 0, leaves out; holding them takes it
    back first (:meth:`held_input_forward`).
    ``input_savings``: what the stage's re-run holds less than its working set says where its region's own re-run
    made some of those inputs: they die inside it as in the eager step, so what holding them adds is not all
    there (:class:`InputSaving`, :func:`input_saving`).
    ``backward_epochs``: the stage's measured backward told apart by which of the tensors of earlier stages that it
    saves last are still alive (:class:`BackwardEpoch`). The eager step frees them inside the stage's backward, so
    its backward event counts them no more, and the backward workspace holds those alive at its peak; where a
    schedule keeps them alive past the stage anyway (a cache, a region holding its inputs), the event counts them
    among its activations, and they count once (:meth:`backward_workspace_with`). Empty: the workspace is whole.
    ``saves_nothing``: no op of the stage saves a tensor for the backward, not even a parameter or an input (a
    residual add, a reshape). A region of such stages only is no region: non-reentrant checkpoint keeps its inputs
    through what its ops save, so it keeps nothing and re-runs nothing, where this model would hold its inputs
    (:func:`without_empty_regions`).
    ``largest_grad_bytes``: the largest gradient of one parameter that this stage's backward finishes (counted in
    ``grad_bytes`` unless the step began with gradients held). Where a call made before others in one step
    finishes it, autograd sums it out of place with the later calls' one waiting in its buffer, holding both and
    the sum at once (see ``solvers.buffered_gradients``).
    """

    name: str
    forward_seconds: float
    backward_seconds: float
    grad_bytes: int = 0
    forward_workspace_bytes: int = 0
    backward_workspace_bytes: int = 0
    recompute_workspace_bytes: int | None = None
    options: tuple[RecomputeOption, ...] = ()
    output_grad_bytes: int = 0
    backward_start_workspace_bytes: int = 0
    stopped_rerun_bytes: int | None = None
    early_stop_seconds: float = 0.0
    held_input_bytes: int | None = None
    held_inputs: tuple["HeldInputs", ...] = ()
    forward_overcount_bytes: int = 0
    input_savings: tuple["InputSaving", ...] = ()
    saves_nothing: bool = False
    backward_epochs: tuple[BackwardEpoch, ...] = ()
    largest_grad_bytes: int = 0

    @property
    def recompute_options(self) -> tuple[RecomputeOption, ...]:
        if self.options:
            return self.options
        return (RecomputeOption("recompute_all", frozenset(), self.forward_seconds),)

    @property
    def recompute_workspace(self) -> int:
        if self.recompute_workspace_bytes is None:
            return self.forward_workspace_bytes
        return self.recompute_workspace_bytes

    def forward_workspace_of(self, option: int | None) -> int:
        """Bytes the forward of this stage needs beyond what the execution model counts: stored (``option`` None),
        or inside a region with ``option``.

        >>> stage = Stage("s", 1.0, 2.0, forward_workspace_bytes=10,
        ...               options=(RecomputeOption("recompute_all", frozenset(), 1.0, forward_bytes=50),))
        >>> stage.forward_workspace_of(None), stage.forward_workspace_of(0)
        (10, 50)
        """
        extra = None if option is None else self.recompute_options[option].forward_bytes
        return self.forward_workspace_bytes if extra is None else max(self.forward_workspace_bytes, extra)

    def held_input_forward(self, held: Iterable[str]) -> int:
        """What the stage's forward needs beyond its forward workspace while the tensors named ``held`` (of those it
        reads last and nothing saves) are held through it: the most any of its :class:`HeldInputs` wholly held
        adds, less the forward over-count. Inside a region, its option's forward workspace (replayed with those
        tensors counted through the stage, as held) covers it as far as it goes (``simulate`` takes the larger).

        >>> stage = Stage("s", 1.0, 2.0, held_inputs=(HeldInputs(frozenset({"bias"}), 300),
        ...               HeldInputs(frozenset({"bias", "mask"}), 500)), forward_overcount_bytes=100)
        >>> forward = stage.held_input_forward
        >>> forward({"mask"}), forward({"bias"}), forward({"bias", "mask"})
        (0, 200, 400)
        """
        held = set(held)
        return max((max(0, e.excess_bytes - self.forward_overcount_bytes) for e in self.held_inputs
                    if e.tensors <= held), default=0)

    def backward_workspace_with(self, kept: Mapping[str, int]) -> int:
        """The backward workspace beside the tensors ``kept`` (names to bytes) alive past this stage's backward,
        which its event counts among the activations: the busiest of its epochs (:class:`BackwardEpoch`), each less
        what of it those tensors, alive in it, already are.

        >>> stage = Stage("s", 1.0, 2.0, backward_workspace_bytes=500, backward_epochs=(
        ...     BackwardEpoch(frozenset({"x", "y"})), BackwardEpoch(frozenset({"y"}), below_bytes=100),
        ...     BackwardEpoch(frozenset(), below_bytes=300)))
        >>> stage.backward_workspace_with({}), stage.backward_workspace_with({"x": 200})
        (500, 400)
        >>> stage.backward_workspace_with({"x": 200, "y": 50})
        350
        """
        return self.backward_workspace_bytes - min(
            (e.below_bytes + sum(kept.get(name, 0) for name in e.alive) for e in self.backward_epochs), default=0)

    @property
    def backward_releasing(self) -> frozenset[str]:
        """The tensors of earlier stages that this stage saves last whose frees tell its epochs apart
        (:class:`BackwardEpoch`)."""
        return frozenset().union(*(e.alive for e in self.backward_epochs))

    def forward_extra_of(self, option: int) -> int:
        """Bytes the forward of this stage needs inside a region with ``option`` beyond what it needs stored (what
        it saves dies early there, but lives for a while).

        >>> stage = Stage("s", 1.0, 2.0, forward_workspace_bytes=10,
        ...               options=(RecomputeOption("recompute_all", frozenset(), 1.0, forward_bytes=50),))
        >>> stage.forward_extra_of(0)
        40
        """
        return self.forward_workspace_of(option) - self.forward_workspace_bytes

    def plus_forward_bytes(self, nbytes: int) -> "Stage":
        """This stage with ``nbytes`` more in every forward event (stored or in a region); its recompute workspace
        stays."""
        options = tuple(o if o.forward_bytes is None else dataclasses.replace(o, forward_bytes=o.forward_bytes + nbytes)
                        for o in self.options)
        return dataclasses.replace(self, forward_workspace_bytes=self.forward_workspace_bytes + nbytes,
                                   recompute_workspace_bytes=self.recompute_workspace, options=options)

    def recompute_workspace_of(self, option: int) -> int:
        """Bytes the recomputation of this stage with ``option`` needs beyond what the execution model counts."""
        workspace = self.recompute_options[option].workspace_bytes
        return self.recompute_workspace if workspace is None else workspace

    def stopped_rerun(self, option: int, kept_bytes: int, saved_bytes: int) -> int:
        """What the re-run of this stage with ``option`` adds at its highest as the last stage of a region that
        caches nothing, whose re-run stops after the stage's last saving op: ``stopped_rerun_bytes``, but never
        more than running on past the stage (``kept_bytes`` and the recompute workspace); without it, what the
        stage saves itself (``saved_bytes``) plus its workspace. An option that caches runs on.

        >>> stage = Stage("s", 1.0, 2.0, forward_workspace_bytes=10)
        >>> stage.stopped_rerun(0, kept_bytes=100, saved_bytes=40)
        50
        >>> dataclasses.replace(stage, stopped_rerun_bytes=70).stopped_rerun(0, kept_bytes=100, saved_bytes=40)
        70
        """
        through = kept_bytes + self.recompute_workspace_of(option)
        if self.recompute_options[option].cached_nodes:
            return through
        if self.stopped_rerun_bytes is None:
            return saved_bytes + self.recompute_workspace_of(option)
        return min(through, self.stopped_rerun_bytes)

    def stopped_seconds(self, option: int) -> float:
        """What the re-run of this stage with ``option`` costs as the last stage of a region that caches nothing:
        non-reentrant checkpoint stops the re-run once the last saved tensor is made again, so the ops after it
        never run (``early_stop_seconds`` fewer, never below zero). An option that caches runs on.

        >>> stage = Stage("s", 1.0, 2.0, early_stop_seconds=0.75)
        >>> stage.stopped_seconds(0), dataclasses.replace(stage, early_stop_seconds=3.0).stopped_seconds(0)
        (0.25, 0.0)
        """
        option_ = self.recompute_options[option]
        if option_.cached_nodes:
            return option_.recompute_seconds
        return max(0.0, option_.recompute_seconds - self.early_stop_seconds)

    def stop_saving(self, option: int) -> float:
        """What stopping early saves on this stage's re-run with ``option`` (see :meth:`stopped_seconds`): what
        the solvers take off when a region that caches nothing ends here.

        >>> Stage("s", 1.0, 2.0, early_stop_seconds=0.25).stop_saving(0)
        0.25
        """
        return self.recompute_options[option].recompute_seconds - self.stopped_seconds(option)


@dataclass(frozen=True)
class TensorInfo:
    """One storage the forward allocates: who makes it, who reads it, whose backward needs it.

    ``is_output``: a model output the caller holds through the backward. ``returned``: a model output, held or
    not: a region that makes it returns it, so its re-run keeps it to the end (:func:`keeps`), even when the caller
    has let it go (``optimize(..., hold_outputs=False)``).
    """

    name: str
    nbytes: int
    producer: int
    consumers: frozenset[int] = frozenset()
    savers: frozenset[int] = frozenset()
    node: str = ""
    is_output: bool = False
    returned: bool = False
    seconds: float = 0.0  # the forward time of the op that makes it (its node's own, as profiled): for explaining
    module_path: str = ""  # the module whose forward runs that op: for explaining

    @property
    def last_forward_use(self) -> int:
        return max(self.consumers | {self.producer})


@dataclass(frozen=True)
class Problem:
    """Everything a solver needs, without torch: stages in order, tensors, and memory that never moves."""

    stages: tuple[Stage, ...]
    tensors: tuple[TensorInfo, ...]
    fixed_bytes: int = 0
    name: str = ""
    region_seconds: float = 0.0  # what each region costs beyond its stages' options: the checkpoint call itself
    # what checkpointing costs once a step when any region runs, beyond each region's own (see simulate)
    per_step_seconds: float = 0.0
    # what a region that caches costs beyond region_seconds and its options: its cache, set up in the forward and
    # handed to the re-run (planner.rewrite's dispatch modes); each cached node's own cost is in its options
    caching_region_seconds: float = 0.0

    def __post_init__(self):
        n = len(self.stages)
        released: list[set[str]] = [set() for _ in range(n)]
        for t in self.tensors:
            if (reader := last_rerun_reader(t)) is not None and reader < n:
                released[reader].add(t.name)
        for k, stage in enumerate(self.stages):
            if any(not 0 <= saving.since < k for saving in stage.input_savings):
                raise ValueError(f"stage {stage.name} saves on inputs of stages outside 0..{k - 1}")
            if any(not held.tensors <= released[k] for held in stage.held_inputs):
                raise ValueError(f"stage {stage.name} counts held inputs that it does not read last: "
                                 f"{sorted(set().union(*(h.tensors for h in stage.held_inputs)) - released[k])}")
        for t in self.tensors:
            if not 0 <= t.producer < n:
                raise ValueError(f"tensor {t.name} has producer {t.producer} outside 0..{n - 1}")
            if any(not t.producer <= s < n for s in t.savers | t.consumers):
                raise ValueError(f"tensor {t.name} is read or saved by a stage before its producer or past the end")

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def is_chain(self) -> bool:
        """True when every tensor is read and saved only by its producer and the next stage (and one the model
        returns, alive to the end of the forward, is made by one of the last two)."""
        n = self.num_stages
        return all(max(t.consumers | t.savers | {t.producer}) <= t.producer + 1 and not t.is_output
                   and (not t.returned or t.producer >= n - 2)
                   or (t.is_output and not t.consumers)
                   for t in self.tensors)


@dataclass(frozen=True)
class Region:
    """Stages ``start`` to ``stop - 1`` run inside one checkpoint; ``options[i]`` indexes stage ``start+i``'s options."""

    start: int
    stop: int
    options: tuple[int, ...] = ()

    def __post_init__(self):
        if not 0 <= self.start < self.stop:
            raise ValueError(f"region [{self.start}, {self.stop}) is empty or negative")
        if self.options and len(self.options) != self.stop - self.start:
            raise ValueError(f"region [{self.start}, {self.stop}) needs one option per stage, got {self.options}")

    @property
    def stages(self) -> range:
        return range(self.start, self.stop)

    def option_of(self, stage: int) -> int:
        return self.options[stage - self.start] if self.options else 0


@dataclass(frozen=True)
class Schedule:
    """Which stages are recomputed, grouped into checkpoint regions; every other stage is stored."""

    regions: tuple[Region, ...] = ()

    def __post_init__(self):
        last = -1
        for r in self.regions:
            if r.start <= last:
                raise ValueError(f"regions overlap or are out of order: {self.regions}")
            last = r.stop - 1

    @classmethod
    def store_all(cls, num_stages: int) -> "Schedule":
        """No recomputation: what eager PyTorch does."""
        return cls(())

    @classmethod
    def uniform(cls, num_stages: int) -> "Schedule":
        """Every stage its own region, recomputed entirely: what ``gradient_checkpointing_enable`` does per layer."""
        return cls.prefix(num_stages)

    @classmethod
    def prefix(cls, count: int) -> "Schedule":
        """The first ``count`` stages each in its own region, recomputed entirely, the rest stored: checkpointing
        only as many blocks as a budget needs, as a careful user does by hand.

        >>> [(r.start, r.stop) for r in Schedule.prefix(2).regions]
        [(0, 1), (1, 2)]
        """
        return cls(tuple(Region(k, k + 1) for k in range(count)))

    @classmethod
    def from_segments(cls, segments: Iterable[tuple[int, int]]) -> "Schedule":
        return cls(tuple(Region(a, b) for a, b in segments))

    def refined(self, ranges: Sequence[tuple[int, int]]) -> "Schedule":
        """This schedule over coarse stages, as one over the finer stages that make them up: ``ranges[k]`` is the
        ``[start, stop)`` of coarse stage ``k``'s fine stages. Only for schedules that recompute whole stages.

        >>> Schedule.from_segments([(0, 1), (1, 3)]).refined([(0, 2), (2, 5), (5, 6), (6, 8)]).regions
        (Region(start=0, stop=2, options=()), Region(start=2, stop=6, options=()))
        """
        if any(any(r.options) for r in self.regions):
            raise ValueError("only a schedule that recomputes whole stages maps onto finer stages")
        return Schedule(tuple(Region(ranges[r.start][0], ranges[r.stop - 1][1]) for r in self.regions))

    def region_index(self, num_stages: int) -> list[int | None]:
        owner: list[int | None] = [None] * num_stages
        for i, r in enumerate(self.regions):
            if r.stop > num_stages:
                raise ValueError(f"region [{r.start}, {r.stop}) runs past the last stage {num_stages - 1}")
            for k in r.stages:
                owner[k] = i
        return owner

    def recomputed_stages(self) -> list[int]:
        return [k for r in self.regions for k in r.stages]


class Phase(enum.Enum):
    FORWARD = "forward"
    RECOMPUTE = "recompute"
    BACKWARD_START = "backward_start"
    BACKWARD = "backward"


@dataclass(frozen=True)
class MemoryEvent:
    """Memory in use while one stage runs in one phase."""

    phase: Phase
    stage: int
    total_bytes: int
    activation_bytes: int
    gradient_bytes: int
    workspace_bytes: int


@dataclass(frozen=True)
class Evaluation:
    """What the execution model predicts for a schedule."""

    peak_bytes: int
    recompute_seconds: float
    step_seconds: float
    events: tuple[MemoryEvent, ...] = field(repr=False)

    @property
    def peak_event(self) -> MemoryEvent:
        return max(self.events, key=lambda e: e.total_bytes)

    @property
    def overhead(self) -> float:
        """Extra step time as a fraction of the eager step."""
        eager = self.step_seconds - self.recompute_seconds
        return self.recompute_seconds / eager if eager > 0 else 0.0


@dataclass(frozen=True)
class _Liveness:
    """Per tensor: forward interval end (inclusive), first backward stage holding it, recomputed-copy range."""

    held_from: int | None  # alive at the start of stage k's backward when k >= held_from, after it when k > it
    forward_until: int  # alive at forward stage k for producer <= k <= forward_until
    copy_range: tuple[int, int] | None  # alive at backward stage k for lo <= k <= hi (a recomputed copy)
    consumed_at: int | None = None  # cached, freed by the recomputation of the region ending at this stage

    def alive_at_start(self, k: int) -> bool:
        """Held (not counting recomputed copies) when stage ``k``'s backward starts."""
        return (self.held_from is not None and k >= self.held_from) or \
            (self.consumed_at is not None and k > self.consumed_at)

    def alive_after(self, k: int) -> bool:
        """Held (not counting recomputed copies) once stage ``k``'s backward is done."""
        return (self.held_from is not None and k > self.held_from) or \
            (self.consumed_at is not None and k > self.consumed_at)


def liveness(problem: Problem, schedule: Schedule, tensor: TensorInfo) -> _Liveness:
    """Apply the module docstring's rules to one tensor."""
    owner = schedule.region_index(problem.num_stages)
    regions = schedule.regions
    home = owner[tensor.producer]
    cached = home is not None and tensor.node in _stage_cached(problem, schedule, tensor.producer)
    holders: list[int] = []
    if tensor.is_output:
        holders.append(-1)
    holders += [s for s in tensor.savers if owner[s] is None]
    holders += [regions[owner[c]].start for c in tensor.consumers if owner[c] is not None and owner[c] != home]
    copy_range = None
    consumed_at = None
    if home is not None:
        region = regions[home]
        inside = [s for s in tensor.savers if owner[s] == home]
        if cached and inside:
            holders.append(min(inside))
        elif cached and not tensor.is_output:  # an output stays with the caller: held, never consumed
            consumed_at = region.stop - 1
        elif inside:
            copy_range = (min(inside), region.stop - 1)
    held_from = min(holders) if holders else None
    if held_from is not None or consumed_at is not None or tensor.returned:  # the model's return reads it last
        forward_until = problem.num_stages - 1
    elif tensor.last_forward_use > tensor.producer:
        forward_until = tensor.last_forward_use
    else:
        forward_until = tensor.producer - 1  # stage-internal: covered by the forward workspace
    return _Liveness(held_from, forward_until, copy_range, consumed_at)


def backward_releasers(problem: Problem) -> dict[str, int]:
    """Each tensor that a stage's backward epochs name (``Stage.backward_epochs``), and that stage: the one that
    saves it last and frees it inside its eager backward.

    >>> stage = Stage("head", 1.0, 2.0, backward_epochs=(BackwardEpoch(frozenset({"x"})),))
    >>> backward_releasers(Problem((Stage("block", 1.0, 2.0), stage), ()))
    {'x': 1}
    """
    return {name: k for k, stage in enumerate(problem.stages) for name in stage.backward_releasing}


def keeps(tensor: TensorInfo) -> bool:
    """Whether a re-run of ``tensor``'s stage keeps it past the stage (saved, read by a later stage, or a model
    output, held or only returned), unless it is cached; otherwise it dies within the stage. Anything with a
    ``TensorInfo``'s ``producer``, ``consumers``, ``savers``, ``is_output`` and ``returned`` will do (the ILP's
    tensor groups)."""
    return bool(tensor.savers or tensor.consumers - {tensor.producer} or tensor.is_output or tensor.returned)


def dies_after_readers(tensor: TensorInfo) -> bool:
    """Whether a copy of ``tensor`` that a re-run makes, or takes from a cache, dies after its last reader:
    nothing saves it and it is no model output, held by the caller or only returned (a region returns the model
    outputs it makes). Anything with a ``TensorInfo``'s ``savers``, ``is_output`` and ``returned`` will do (the
    ILP's tensor groups)."""
    return not (tensor.savers or tensor.is_output or tensor.returned)


def last_rerun_reader(tensor: TensorInfo) -> int | None:
    """The stage after whose re-run a recomputed copy of ``tensor`` dies, when that stage is in its producer's
    region: the last later stage that reads it, when nothing saves it and it is no model output (None otherwise:
    it is kept to the end of the re-run, or beyond; a region returns the model outputs it makes, held by the
    caller or not). Anything with a ``TensorInfo``'s ``producer``, ``consumers``, ``savers``, ``is_output`` and
    ``returned`` will do (the ILP's tensor groups).

    >>> last_rerun_reader(TensorInfo("bn", 100, producer=2, consumers=frozenset({3, 4})))
    4
    >>> last_rerun_reader(TensorInfo("x", 100, producer=2, consumers=frozenset({3}), savers=frozenset({3}))) is None
    True
    >>> last_rerun_reader(TensorInfo("encoder_out", 100, producer=2, consumers=frozenset({3}), returned=True)) is None
    True
    """
    if not dies_after_readers(tensor) or not tensor.consumers - {tensor.producer}:
        return None
    return max(tensor.consumers)


@dataclass(frozen=True)
class _Rerun:
    """What the re-run of each recomputed stage leaves alive, by stage: see :func:`_recompute_peak`."""

    kept: list[int]  # kept tensors (not cached)
    consumed_inside: list[int]  # cached tensors that nothing saves, gone once the stage has re-run
    saved_self: list[int]  # tensors it saves itself (not cached): what it keeps when its region stops early
    freed_after: list[int]  # kept tensors of earlier stages of its region that its re-run reads last (they die)


def input_saving(problem: Problem, region: Region, j: int) -> int:
    """What stage ``j``'s re-run in ``region`` holds less because the region made inputs it frees: the most of
    its ``Stage.input_savings`` that the region starts early enough for, with its option (what it saves running
    through where a later stage of the region follows: ``InputSaving.through_bytes``).

    >>> stage = Stage("relu", 1.0, 2.0, input_savings=(InputSaving(3, (30, 10)), InputSaving(1, (100, 40))))
    >>> problem = Problem(tuple(Stage(f"s{k}", 1.0, 2.0) for k in range(4)) + (stage,), ())
    >>> [input_saving(problem, Region(start, 5), 4) for start in (4, 3, 2, 1, 0)]
    [0, 30, 30, 100, 100]
    >>> input_saving(problem, Region(1, 5, (0, 0, 0, 1)), 4)
    40
    >>> through = Stage("add", 1.0, 2.0, input_savings=(InputSaving(3, (0,), through_bytes=(30,)),))
    >>> problem = Problem(problem.stages[:4] + (through, Stage("norm", 1.0, 2.0)), ())
    >>> input_saving(problem, Region(3, 5), 4), input_saving(problem, Region(3, 6), 4)
    (0, 30)
    """
    option, through = region.option_of(j), j < region.stop - 1
    return max((s.of(option, through) for s in problem.stages[j].input_savings if region.start <= s.since),
               default=0)


def cached_dies_with(tensor: TensorInfo, region: Region) -> int:
    """The stage of ``region`` after whose re-run a cached ``tensor`` that nothing saves is gone: its last reader,
    or its producer when none reads it later; the region's last stage when a stage after the region reads it (the
    region returns it, so its re-run holds it to the end). The re-run takes it from the cache, and what nothing
    saves dies after its last reader, as in the eager step.

    >>> q = TensorInfo("q", 100, producer=1, consumers=frozenset({2}))
    >>> cached_dies_with(q, Region(1, 4)), cached_dies_with(q, Region(0, 2))
    (2, 1)
    """
    return min(max(tensor.consumers | {tensor.producer}), region.stop - 1)


def _rerun_bytes(problem: Problem, schedule: Schedule) -> _Rerun:
    n = problem.num_stages
    rerun = _Rerun([0] * n, [0] * n, [0] * n, [0] * n)
    owner = schedule.region_index(n)
    for t in problem.tensors:
        if owner[t.producer] is None:
            continue
        if t.node in _stage_cached(problem, schedule, t.producer):
            if dies_after_readers(t):  # the re-run takes it from the cache and drops it
                rerun.consumed_inside[cached_dies_with(t, schedule.regions[owner[t.producer]])] += t.nbytes
            continue
        rerun.kept[t.producer] += t.nbytes if keeps(t) else 0
        rerun.saved_self[t.producer] += t.nbytes if t.producer in t.savers else 0
        last = last_rerun_reader(t)
        if last is not None and owner[last] == owner[t.producer]:
            rerun.freed_after[last] += t.nbytes
    return rerun


def region_caches(problem: Problem, region: Region) -> bool:
    """Whether some stage of ``region`` runs with an option that caches: then its re-run goes to its end."""
    return any(problem.stages[j].recompute_options[region.option_of(j)].cached_nodes for j in region.stages)


def _recompute_peak(problem: Problem, region: Region, rerun: _Rerun) -> tuple[int, int]:
    """The most bytes the re-run of ``region`` adds to what is alive as its last stage's backward starts (and to
    its caches), as one stage after another re-runs, and the workspace at that moment."""
    caches = region_caches(problem, region)
    earlier, best = 0, None
    for j in region.stages:
        stops = j == region.stop - 1 and not caches
        stage, option = problem.stages[j], region.option_of(j)
        workspace = stage.recompute_workspace_of(option)
        own = stage.stopped_rerun(option, rerun.kept[j], rerun.saved_self[j]) if stops else rerun.kept[j] + workspace
        own -= input_saving(problem, region, j)
        moment = earlier + own
        workspace = own - (rerun.saved_self[j] if stops else rerun.kept[j])
        if best is None or moment > best[0]:
            best = (moment, workspace)
        earlier += rerun.kept[j] - rerun.consumed_inside[j] - rerun.freed_after[j]
    return best


def _stage_cached(problem: Problem, schedule: Schedule, stage: int) -> frozenset[str]:
    for r in schedule.regions:
        if r.start <= stage < r.stop:
            return problem.stages[stage].recompute_options[r.option_of(stage)].cached_nodes
    return frozenset()


def simulate(problem: Problem, schedule: Schedule) -> Evaluation:
    """Replay one training step of ``schedule`` and return its peak memory, recompute time and timeline."""
    n = problem.num_stages
    owner = schedule.region_index(n)
    for r in schedule.regions:
        for k in r.stages:
            if not 0 <= r.option_of(k) < len(problem.stages[k].recompute_options):
                raise ValueError(f"stage {k} has no option {r.option_of(k)}")
    forward = [0] * n
    held_inputs: list[set[str]] = [set() for _ in range(n)]  # held tensors that stage k reads last, none saves
    held_start = [0] * n  # bytes held when stage k's backward starts
    held_after = [0] * n  # bytes held once stage k's backward is done
    consumed = [0] * n  # cached bytes the recomputation of the region ending at k consumes
    copies = [0] * n
    releasing = backward_releasers(problem)
    kept_after: list[dict[str, int]] = [{} for _ in range(n)]  # see Stage.backward_workspace_with
    for t in problem.tensors:
        live = liveness(problem, schedule, t)
        if (releaser := releasing.get(t.name)) is not None and live.alive_after(releaser):
            kept_after[releaser][t.name] = t.nbytes
        for k in range(t.producer, live.forward_until + 1):
            forward[k] += t.nbytes
        if (reader := last_rerun_reader(t)) is not None and (live.held_from, live.consumed_at) != (None, None):
            held_inputs[reader].add(t.name)
        for k in range(n):
            held_start[k] += t.nbytes * live.alive_at_start(k)
            held_after[k] += t.nbytes * live.alive_after(k)
        if live.consumed_at is not None:
            consumed[live.consumed_at] += t.nbytes
        if live.copy_range is not None:
            for k in range(live.copy_range[0], live.copy_range[1] + 1):
                copies[k] += t.nbytes
    events: list[MemoryEvent] = []
    for k, stage in enumerate(problem.stages):
        ws = stage.forward_workspace_of(None if owner[k] is None else schedule.regions[owner[k]].option_of(k))
        ws = max(ws, stage.forward_workspace_bytes + stage.held_input_forward(held_inputs[k]))
        events.append(MemoryEvent(Phase.FORWARD, k, problem.fixed_bytes + forward[k] + ws, forward[k], 0, ws))
    grads = 0
    region_end = {r.stop - 1: r for r in schedule.regions}
    rerun = _rerun_bytes(problem, schedule)
    fixed = problem.fixed_bytes
    for k in reversed(range(n)):
        start = held_start[k] + copies[k]
        if k in region_end:
            peak, workspace = _recompute_peak(problem, region_end[k], rerun)
            act = held_start[k] + consumed[k] + peak - workspace
            ws = workspace + problem.stages[k].output_grad_bytes
            events.append(MemoryEvent(Phase.RECOMPUTE, k, fixed + act + grads + ws, act, grads, ws))
        ws = problem.stages[k].backward_start_workspace_bytes
        events.append(MemoryEvent(Phase.BACKWARD_START, k, fixed + start + grads + ws, start, grads, ws))
        grads += problem.stages[k].grad_bytes
        ws = problem.stages[k].backward_workspace_with(kept_after[k])
        same_region = k > 0 and owner[k] is not None and owner[k - 1] == owner[k]
        after = held_after[k] + (copies[k - 1] if same_region else 0)
        events.append(MemoryEvent(Phase.BACKWARD, k, fixed + after + grads + ws, after, grads, ws))
    recompute = recompute_seconds(problem, schedule) + (problem.per_step_seconds if schedule.regions else 0.0)
    base = sum(s.forward_seconds + s.backward_seconds for s in problem.stages)
    return Evaluation(max(e.total_bytes for e in events), recompute, base + recompute, tuple(events))


def held_after_forward_bytes(problem: Problem, schedule: Schedule) -> int:
    """What a step of ``schedule`` holds beyond fixed memory from the end of its forward until its backward: the
    tensors saved outside regions, the regions' inputs, the cached ones and the held outputs. Another call of the
    model before that backward (two views through one encoder, a discriminator on real and on fake samples) runs
    while this much is held.

    >>> stages = tuple(Stage(f"s{i}", 1.0, 2.0) for i in range(3))
    >>> inner = tuple(TensorInfo(f"a{i}", 100, i, frozenset({i}), frozenset({i})) for i in range(3))
    >>> edges = tuple(TensorInfo(f"x{i}", 10, i, frozenset({i + 1}), frozenset({i + 1})) for i in range(2))
    >>> problem = Problem(stages, inner + edges)
    >>> held_after_forward_bytes(problem, Schedule.store_all(3)), held_after_forward_bytes(problem, Schedule.uniform(3))
    (320, 20)
    """
    held = 0
    for tensor in problem.tensors:
        live = liveness(problem, schedule, tensor)
        if live.held_from is not None or live.consumed_at is not None:
            held += tensor.nbytes
    return held


def without_empty_regions(problem: Problem, schedule: Schedule) -> Schedule:
    """``schedule`` less its regions whose stages all save nothing (``Stage.saves_nothing``): run by a checkpoint,
    such a region keeps nothing and re-runs nothing, as if stored, while :func:`simulate` would hold its inputs
    until its backward; stored, it is what it is, and costs no checkpoint call. No peak or time this model
    predicts is higher without them.

    >>> stages = (Stage("mlp", 1.0, 2.0), Stage("residual", 0.1, 0.1, saves_nothing=True))
    >>> problem = Problem(stages, (TensorInfo("h", 100, 0, frozenset({1}), frozenset({0})),))
    >>> without_empty_regions(problem, Schedule((Region(0, 1), Region(1, 2)))).regions
    (Region(start=0, stop=1, options=()),)
    """
    kept = tuple(r for r in schedule.regions if not all(problem.stages[k].saves_nothing for k in r.stages))
    return schedule if len(kept) == len(schedule.regions) else Schedule(kept)


def recompute_seconds(problem: Problem, schedule: Schedule) -> float:
    """The time ``schedule``'s regions spend again, as the solvers count it: each stage's option,
    ``problem.region_seconds`` per region (counted with its first stage), ``problem.caching_region_seconds`` per
    region that caches (counted with its last stage), and a region that caches nothing stops early in its last
    stage (:meth:`Stage.stopped_seconds`). :func:`simulate`'s ``recompute_seconds`` is this and,
    when there is a region, ``problem.per_step_seconds``: the same for every plan that checkpoints, so the
    solvers leave it out.

    >>> stages = tuple(Stage(f"s{i}", forward_seconds=1.0, backward_seconds=2.0) for i in range(3))
    >>> recompute_seconds(Problem(stages, ()), Schedule.from_segments([(0, 2)]))
    2.0
    >>> recompute_seconds(Problem(stages, (), region_seconds=0.25), Schedule.from_segments([(0, 2)]))
    2.25
    >>> recompute_seconds(Problem(stages, (), region_seconds=0.25), Schedule.from_segments([(0, 1), (1, 2)]))
    2.5
    >>> stopping = tuple(dataclasses.replace(s, early_stop_seconds=0.5) for s in stages)
    >>> recompute_seconds(Problem(stopping, ()), Schedule.from_segments([(0, 2)]))
    1.5
    >>> once = Problem(stages, (), per_step_seconds=0.5)
    >>> recompute_seconds(once, Schedule.uniform(3)), simulate(once, Schedule.uniform(3)).recompute_seconds
    (3.0, 3.5)
    """
    return sum(stage_recompute_seconds(problem, r, k) for r in schedule.regions for k in r.stages)


def stage_recompute_seconds(problem: Problem, region: Region, k: int, caches: bool | None = None) -> float:
    """What stage ``k`` of ``region`` spends again: its option's recompute seconds (stopped early when it ends a
    region that caches nothing: :meth:`Stage.stopped_seconds`), for the region's first stage
    ``problem.region_seconds`` (the region's own cost) and for the last stage of a region that caches
    ``problem.caching_region_seconds``. ``caches``: whether to count the region as caching (default: whether its
    options do; a relaxation passes False).

    >>> stages = tuple(Stage(f"s{i}", 1.0, 2.0, early_stop_seconds=0.25) for i in range(2))
    >>> problem = Problem(stages, (), region_seconds=0.25, caching_region_seconds=0.5)
    >>> [stage_recompute_seconds(problem, Region(0, 2), k) for k in (0, 1)]
    [1.25, 0.75]
    >>> [stage_recompute_seconds(problem, Region(0, 2), k, caches=True) for k in (0, 1)]
    [1.25, 1.5]
    """
    own = problem.region_seconds if k == region.start else 0.0
    stage, option = problem.stages[k], region.option_of(k)
    if k != region.stop - 1:
        return stage.recompute_options[option].recompute_seconds + own
    if not (region_caches(problem, region) if caches is None else caches):
        return stage.stopped_seconds(option) + own
    return stage.recompute_options[option].recompute_seconds + own + problem.caching_region_seconds
