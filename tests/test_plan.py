import json

import pytest

from planner.errors import PlannerError
from planner.plan import Plan, SolverStatus
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
