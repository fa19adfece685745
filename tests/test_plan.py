import json

import pytest

from planner.errors import PlannerError
from planner.plan import Plan, SolverStatus, TensorFate, tensor_summaries
from planner.problem import Problem, RecomputeOption, Region, Schedule, Stage, TensorInfo, simulate


def _problem():
    option = RecomputeOption("cache_mm", frozenset({"mm1"}), 0.5)
    stages = tuple(Stage(f"layer.{i}", 1.0, 2.0, grad_bytes=10, options=(
        RecomputeOption("recompute_all", frozenset(), 1.0), option if i == 1 else
        RecomputeOption("cache_x", frozenset({f"n{i}"}), 0.2))) for i in range(3))
    tensors = tuple(TensorInfo(f"t{i}", 100, producer=i, consumers=frozenset({i + 1}) if i < 2 else frozenset(),
                               savers=frozenset({i}), node=f"n{i}") for i in range(3))
    return Problem(stages, tensors, fixed_bytes=50)


def test_plan_carries_the_prediction_of_its_schedule():
    problem = _problem()
    schedule = Schedule((Region(0, 2, (0, 1)),))
    plan = Plan.from_schedule(problem, schedule, solver="ilp", status=SolverStatus.OPTIMAL, gap=0.0,
                              solve_seconds=0.1, budget_bytes=1000)
    evaluation = simulate(problem, schedule)
    assert plan.predicted_peak_bytes == evaluation.peak_bytes
    assert plan.eager_peak_bytes == simulate(problem, Schedule()).peak_bytes
    assert plan.predicted_recompute_seconds == pytest.approx(1.5)
    assert plan.predicted_overhead == pytest.approx(1.5 / 9.0)
    assert plan.regions[0].cached_nodes == ("mm1",)
    assert plan.schedule == schedule
    assert plan.recomputed_stage_names == ("layer.0", "layer.1")


def test_plan_round_trips_through_json():
    plan = Plan.from_schedule(_problem(), Schedule((Region(1, 3, (1, 0)),)), solver="dp",
                              status=SolverStatus.FEASIBLE, gap=0.01, budget_bytes=123)
    plan = Plan(**{**plan.__dict__, "budget_text": "60%", "stage_nodes": (("a",), ("b", "c"), ("d",)),
                   "fingerprint": "abc", "extra": (("note", "x"),)})
    text = plan.to_json()
    assert json.loads(text)["status"] == "feasible"
    again = Plan.from_json(text)
    assert again == plan
    assert again.stage_nodes == plan.stage_nodes


@pytest.mark.parametrize("text, fragment", [
    ("not json", "not valid JSON"),
    ("[1, 2]", "must be an object"),
    ('{"schema_version": 99}', "schema_version"),
])
def test_malformed_plans_raise_planner_error(text, fragment):
    with pytest.raises(PlannerError, match=fragment):
        Plan.from_json(text)


def test_tampered_plans_raise_planner_error():
    data = json.loads(Plan.from_schedule(_problem(), Schedule.uniform(3), solver="uniform",
                                         status=SolverStatus.HEURISTIC).to_json())
    data["regions"][0]["start"] = 5
    with pytest.raises(PlannerError):
        Plan.from_json(json.dumps(data))
    data = json.loads(Plan.from_schedule(_problem(), Schedule.uniform(3), solver="uniform",
                                         status=SolverStatus.HEURISTIC).to_json())
    data["surprise"] = 1
    with pytest.raises(PlannerError, match="unknown fields"):
        Plan.from_json(json.dumps(data))
    del data["surprise"], data["status"]
    with pytest.raises(PlannerError, match="malformed"):
        Plan.from_json(json.dumps(data))


def test_summary_names_budget_peaks_and_regions():
    plan = Plan.from_schedule(_problem(), Schedule.uniform(3), solver="uniform", status=SolverStatus.HEURISTIC,
                              budget_bytes=2000)
    text = plan.summary()
    assert "uniform" in text and "predicted peak" in text and "checkpoint [layer.0]" in text


def _fates(problem, schedule):
    return {t.name: t.fate for t in tensor_summaries(problem, schedule)}


def test_tensor_summaries_say_what_becomes_of_each_tensor_the_backward_needs():
    """Stored stages keep what they save; a region recomputes what only it saves, holds what it caches, and the
    checkpoint holds what it reads from before it; a tensor nothing saves or reads later is not listed."""
    stages = tuple(Stage(f"s{i}", 1.0, 2.0, options=(RecomputeOption("all", frozenset(), 1.0),
                                                      RecomputeOption("keep_mm", frozenset({f"mm{i}"}), 0.5)))
                   for i in range(4))
    tensors = tuple(t for i in range(4) for t in (
        TensorInfo(f"h{i}", 40, producer=i, savers=frozenset({i}), node=f"mm{i}"),
        TensorInfo(f"x{i}", 10, producer=i, consumers=frozenset({i + 1}) if i < 3 else frozenset(),
                   savers=frozenset({i + 1}) if i < 3 else frozenset(), node=f"out{i}")))
    problem = Problem(stages, tensors + (TensorInfo("tmp", 99, producer=0, node="tmp"),))
    assert set(_fates(problem, Schedule())) == {t.name for t in tensors} - {"x3"}
    assert set(_fates(problem, Schedule()).values()) == {TensorFate.KEPT}
    fates = _fates(problem, Schedule((Region(1, 3, (0, 1)),)))
    assert fates == {"h0": TensorFate.KEPT, "x0": TensorFate.REGION_INPUT, "h1": TensorFate.RECOMPUTED,
                     "x1": TensorFate.RECOMPUTED, "h2": TensorFate.CACHED, "x2": TensorFate.KEPT,
                     "h3": TensorFate.KEPT}
    uniform = _fates(problem, Schedule.uniform(4))
    assert [uniform[f"x{i}"] for i in range(3)] == [TensorFate.REGION_INPUT] * 3
    assert [uniform[f"h{i}"] for i in range(4)] == [TensorFate.RECOMPUTED] * 4
    summaries = tensor_summaries(problem, Schedule.uniform(4))
    assert [(t.node, t.stage, t.nbytes) for t in summaries[:2]] == [("mm0", 0, 40), ("out0", 0, 10)]


def test_tensor_summaries_round_trip_through_json_and_are_checked():
    plan = Plan.from_schedule(_problem(), Schedule((Region(1, 3, (1, 0)),)), solver="dp",
                              status=SolverStatus.FEASIBLE)
    assert plan.tensor_summaries and Plan.from_json(plan.to_json()) == plan
    assert json.loads(plan.to_json())["tensor_summaries"][0]["fate"] == "kept"
    data = json.loads(plan.to_json())
    data["tensor_summaries"][0]["fate"] = "lost"
    with pytest.raises(PlannerError, match=r"tensor_summaries\[0\].fate"):
        Plan.from_json(json.dumps(data))
    data["tensor_summaries"][0].update(fate="kept", stage=7)
    with pytest.raises(PlannerError, match="past the last stage"):
        Plan.from_json(json.dumps(data))
    del data["tensor_summaries"]  # plans written before tensor summaries still read
    assert Plan.from_json(json.dumps(data)).tensor_summaries == ()
