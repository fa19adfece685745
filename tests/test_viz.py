"""Pictures and the data behind them: timelines (predicted and measured), the frontier, the per-stage strip."""

from __future__ import annotations

import os
import sys

import matplotlib
import pytest
import torch

matplotlib.use("Agg")

import planner  # noqa: E402
from planner import viz  # noqa: E402
from planner.errors import PlannerError  # noqa: E402
from planner.frontier import Method, compile_frontier, planner_frontier  # noqa: E402
from planner.meter import LiveMemoryMeter, allocator_peak_bytes, storage_bytes  # noqa: E402
from planner.plan import Plan  # noqa: E402
from planner.problem import Phase, Schedule, simulate  # noqa: E402
from planner.timeline import step_slots, step_timelines  # noqa: E402
from planner.api import planned_module  # noqa: E402
from planner.profile import default_loss  # noqa: E402

MIB = 2**20


def _mlp(blocks: int = 5, width: int = 64, hidden: int = 256) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, hidden), torch.nn.GELU(),
                                                     torch.nn.Linear(hidden, width)) for _ in range(blocks)])


class _ConvNet(torch.nn.Module):
    """BatchNorm, dropout and a skip connection across blocks: the timeline must not change the model's state."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Conv2d(8, 8, 3, padding=1),
                                                              torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                                              torch.nn.Dropout(0.1)) for _ in range(4))

    def forward(self, x):
        skip = self.blocks[0](x)
        y = self.blocks[2](self.blocks[1](skip))
        return self.blocks[3](y + skip)


@pytest.fixture(scope="module")
def mlp_planned():
    model = _mlp()
    x = torch.randn(512, 64)
    opt = planner.optimize(model, "50%", example_inputs=(x,), profile_repeats=1)
    return opt, step_timelines(opt)


def test_timeline_peaks_and_budget_are_the_plans(mlp_planned):
    opt, (eager, planned) = mlp_planned
    plan = opt.plan
    assert planned.predicted_peak_bytes == plan.predicted_peak_bytes
    assert eager.predicted_peak_bytes == plan.eager_peak_bytes
    assert planned.budget_bytes == eager.budget_bytes == plan.budget_bytes
    assert plan.regions, "a 50% budget must recompute something"
    assert eager.slots == planned.slots == step_slots(len(plan.stage_names), plan.schedule)
    recompute_slots = [s for s in planned.slots if s.phase is Phase.RECOMPUTE]
    assert [s.stage for s in recompute_slots] == sorted((r.stop - 1 for r in plan.regions), reverse=True)


def test_measured_points_for_every_stage_and_region(mlp_planned):
    opt, (eager, planned) = mlp_planned
    n = len(opt.plan.stage_names)
    for timeline in (eager, planned):
        assert set(timeline.measured_stage_peaks(Phase.FORWARD)) == set(range(n))
        assert set(timeline.measured_stage_peaks(Phase.BACKWARD)) == set(range(n))
        xs = [p.x for p in timeline.measured]
        assert xs == sorted(xs) and 0 <= xs[0] and xs[-1] < len(timeline.slots)
    assert eager.measured_stage_peaks(Phase.RECOMPUTE) == {}
    assert set(planned.measured_stage_peaks(Phase.RECOMPUTE)) == {r.stop - 1 for r in opt.plan.regions}


def test_measured_timeline_is_the_real_step(mlp_planned):
    """The stage markers change nothing: the timeline's peak is a plain metered step's peak, fixed bytes included."""
    opt, (eager, planned) = mlp_planned
    captured = opt.planned.captured
    x = captured.example_args[0]
    fixed = storage_bytes(list(captured.graph_module.parameters()) + [x])
    module = planned_module(captured, opt.plan, opt.plan.stage_nodes)
    for timeline, step_module in ((eager, opt.model), (planned, module)):
        with LiveMemoryMeter() as meter:
            out = step_module(x)  # held through the backward, as the plan assumed (hold_outputs=True)
            default_loss(out).backward()
            del out
        opt.model.zero_grad(set_to_none=True)
        assert timeline.measured_peak_bytes == fixed + meter.peak_bytes
    assert planned.measured_peak_bytes <= opt.plan.budget_bytes
    # the execution model is calibrated on the eager step: it reproduces it exactly
    assert eager.predicted_peak_bytes == eager.measured_peak_bytes
    assert abs(planned.predicted_peak_bytes / planned.measured_peak_bytes - 1) < 0.05


def test_timeline_leaves_training_state_alone():
    model = _ConvNet().train()
    x = torch.randn(4, 8, 16, 16)
    opt = planner.optimize(model, "70%", example_inputs=(x,), profile_repeats=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    eager, planned = step_timelines(opt)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state())
    assert all(p.grad is None for p in model.parameters())
    assert planned.measured_peak_bytes < eager.measured_peak_bytes


def test_plot_timeline_draws_the_data(mlp_planned):
    opt, timelines = mlp_planned
    figure = viz.plot_timeline(timelines)
    lines = {line.get_label(): line for line in figure.axes[0].get_lines()}
    assert lines[f"budget {planner.budget.format_bytes(opt.plan.budget_bytes)}"].get_ydata()[0] == \
        opt.plan.budget_bytes / MIB
    predicted = lines["planned predicted"].get_ydata()
    assert max(y for y in predicted if y == y) == opt.plan.predicted_peak_bytes / MIB
    measured = lines["planned measured"].get_ydata()
    assert max(y for y in measured if y == y) == timelines[1].measured_peak_bytes / MIB
    peaks = sorted(float(line.get_ydata()[0]) for line in figure.axes[0].get_lines() if line.get_marker() == "v")
    assert peaks == sorted(t.predicted_peak_bytes / MIB for t in timelines)


def test_plot_timeline_on_given_axes(mlp_planned):
    _, timelines = mlp_planned
    figure = matplotlib.figure.Figure()
    ax = figure.add_subplot()
    assert viz.plot_timeline(timelines[1:], ax=ax) is figure
    assert ax.get_xlim() == (0, len(timelines[1].slots))


def test_frontier_points(mlp_planned):
    opt, _ = mlp_planned
    problem = opt.planned.problem
    points = planner_frontier(problem, shares=(0.0, 0.3, 0.6, 1.0))
    by = {m: [p for p in points if p.method is m] for m in Method}
    assert by[Method.EAGER][0].peak_bytes == simulate(problem, Schedule.store_all(problem.num_stages)).peak_bytes
    assert not any(p.measured for p in points)
    planned = sorted(by[Method.PLANNER], key=lambda p: p.peak_bytes)
    assert len(planned) >= 2
    assert all(a.overhead >= b.overhead for a, b in zip(planned, planned[1:]))
    assert planned[-1].overhead == 0.0
    for baseline in by[Method.UNIFORM] + by[Method.CHEN_SQRT]:
        # the planner is optimal over plans that include the baselines: at any budget that admits one, it is no slower
        admitted = [p for p in planned if p.budget_bytes >= baseline.peak_bytes]
        assert all(p.peak_bytes <= p.budget_bytes for p in planned)
        assert all(p.overhead <= baseline.overhead + 1e-9 for p in admitted)
    figure = viz.plot_frontier(points, budget_bytes=opt.plan.budget_bytes)
    lines = {line.get_label(): line for line in figure.axes[0].get_lines()}
    assert [float(x) for x in lines["planner"].get_xdata()] == [p.peak_bytes / MIB for p in planned]
    assert [float(y) for y in lines["planner"].get_ydata()] == [100 * p.overhead for p in planned]


def test_allocator_peak_agrees_with_meter_on_eager_code():
    model = _mlp(blocks=3)
    x = torch.randn(128, 64)

    def step():
        model(x).pow(2).mean().backward()
        model.zero_grad(set_to_none=True)

    with LiveMemoryMeter() as meter:
        step()
    assert allocator_peak_bytes(step) == meter.peak_bytes


@pytest.mark.skipif(not os.environ.get("PLANNER_COMPILE_TESTS"),
                    reason="compiles with inductor (tens of seconds); set PLANNER_COMPILE_TESTS=1")
def test_compile_frontier_measures_peaks():
    model = _mlp(blocks=4, width=128, hidden=1024)
    x = torch.randn(512, 128)
    points = compile_frontier(model, (x,), ratios=(1.0, 0.3), repeats=2)
    assert [p.setting for p in points] == ["activation_memory_budget=1", "activation_memory_budget=0.3"]
    assert all(p.measured and p.method is Method.TORCH_COMPILE for p in points)
    assert points[1].peak_bytes < points[0].peak_bytes
    assert points[0].overhead == 0.0
    assert all(p.grad is None for p in model.parameters())


def test_stage_strip_decisions(mlp_planned):
    opt, _ = mlp_planned
    plan = opt.plan
    decisions = viz.stage_decisions(plan)
    assert [d.name for d in decisions] == list(plan.stage_names)
    for d in decisions:
        inside = [i for i, r in enumerate(plan.regions) if r.start <= d.stage < r.stop]
        assert d.region == (inside[0] if inside else None)
        expected = (viz.Decision.KEPT if not inside else
                    viz.Decision.CACHED if plan.stage_summaries[d.stage].cached_nodes else viz.Decision.RECOMPUTED)
        assert d.decision is expected
    figure = viz.plot_stages(plan)
    cells = [p for p in figure.axes[0].patches if p.get_label()]
    assert [c.get_label() for c in cells] == [f"{d.name}: {d.decision.value}" for d in decisions]
    colors = {matplotlib.colors.to_hex(c.get_facecolor()) for c in cells}
    assert colors == {viz.DECISION_COLORS[d.decision.value] for d in decisions}
    regions = [t.get_text() for t in figure.axes[0].texts]
    assert regions == [f"region {i}" for i in range(len(plan.regions))]


def test_plan_from_json_has_no_timeline(mlp_planned):
    opt, _ = mlp_planned
    loaded = planner.apply(opt.model, Plan.from_json(opt.plan.to_json()), opt.planned.captured.example_args)
    with pytest.raises(PlannerError, match="loaded from JSON"):
        step_timelines(loaded)
    assert viz.stage_decisions(loaded.plan) == viz.stage_decisions(opt.plan)


def test_without_matplotlib_says_how_to_install(monkeypatch, mlp_planned):
    opt, _ = mlp_planned
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what Python does for a package that is not installed
    with pytest.raises(PlannerError, match=r"pip install planner\[viz\]"):
        viz.plot_stages(opt.plan)
