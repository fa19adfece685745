import dataclasses
import json
import re
import tomllib
from pathlib import Path

import pytest

from planner.errors import PlannerError
from planner.plan import Plan, SolverStatus, StageSummary
from planner.problem import Problem, RecomputeOption, Region, Schedule, Stage, TensorInfo
from planner.schema import plan_schema, validate

ROOT = Path(__file__).resolve().parents[1]


def _plan_data():
    option = RecomputeOption("keep", frozenset({"n1"}), 0.5)
    stages = tuple(Stage(f"layer.{i}", 1.0, 2.0, options=(RecomputeOption("all", frozenset(), 1.0), option))
                   for i in range(3))
    tensors = tuple(TensorInfo(f"t{i}", 100, producer=i, consumers=frozenset({i + 1}) if i < 2 else frozenset(),
                               savers=frozenset({i}), node=f"n{i}") for i in range(3))
    plan = Plan.from_schedule(Problem(stages, tensors), Schedule((Region(0, 2, (0, 1)),)), solver="ilp",
                              status=SolverStatus.OPTIMAL, gap=0.0, budget_bytes=1000)
    plan = dataclasses.replace(plan, budget_text="1000", stage_nodes=(("n0",), ("n1",), ("n2",)),
                               extra=(("note", "x"),))
    return json.loads(plan.to_json())


def test_a_plan_written_by_to_json_validates():
    data = _plan_data()
    validate(data, plan_schema())
    assert json.loads(Plan.from_dict(data).to_json()) == data


def test_the_schema_describes_every_field_of_plan_and_stage_summary():
    schema = plan_schema()
    assert schema["$schema"].endswith("2020-12/schema")
    assert set(schema["properties"]) == {f.name for f in dataclasses.fields(Plan)}
    summary = schema["properties"]["stage_summaries"]["items"]["properties"]
    assert set(summary) == {f.name for f in dataclasses.fields(StageSummary)}
    assert schema["properties"]["status"]["enum"] == [s.value for s in SolverStatus]
    required = {f.name for f in dataclasses.fields(Plan) if f.default is dataclasses.MISSING}
    assert required <= set(schema["required"])


def test_the_schema_ships_as_package_data():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "*.json" in config["tool"]["setuptools"]["package-data"]["planner"]
    assert (ROOT / "planner" / "plan.schema.json").is_file()


def _tamper(edit):
    data = _plan_data()
    edit(data)
    return json.dumps(data)


@pytest.mark.parametrize("edit, path, problem", [
    (lambda d: d.update(predicted_peak_bytes="big"), "$.predicted_peak_bytes", "expected integer, got string"),
    (lambda d: d.update(predicted_peak_bytes=True), "$.predicted_peak_bytes", "expected integer, got boolean"),
    (lambda d: d.update(predicted_overhead=None), "$.predicted_overhead", "expected number, got null"),
    (lambda d: d.update(stage_names="layer.0"), "$.stage_names", "expected array"),
    (lambda d: d["stage_names"].__setitem__(1, 7), "$.stage_names[1]", "expected string, got integer 7"),
    (lambda d: d.pop("solver"), "$.solver", "required field is missing"),
    (lambda d: d["regions"][0].pop("stop"), "$.regions[0].stop", "required field is missing"),
    (lambda d: d["stage_summaries"][2].pop("cached_nodes"), "$.stage_summaries[2].cached_nodes", "missing"),
    (lambda d: d.update(eager_peak_bytes=-1), "$.eager_peak_bytes", "below the minimum 0"),
    (lambda d: d.update(budget_bytes=-1000), "$.budget_bytes", "below the minimum 0"),
    (lambda d: d["stage_summaries"][1].update(saved_bytes_eager=-8), "$.stage_summaries[1].saved_bytes_eager",
     "below the minimum"),
    (lambda d: d["regions"][0]["options"].__setitem__(0, -1), "$.regions[0].options[0]", "below the minimum"),
    (lambda d: d.update(status="great"), "$.status", '"great" is not one of "optimal", "feasible", "heuristic"'),
    (lambda d: d.update(surprise=1), "$", "unknown fields ['surprise']"),
    (lambda d: d["regions"][0].update(colour="red"), "$.regions[0]", "unknown fields ['colour']"),
    (lambda d: d["regions"][0].update(stop=9), "$.regions[0].stop", "runs past the last stage 2"),
    (lambda d: d["regions"].append({"start": 1, "stop": 2}), "$.regions[1].start", "inside or before"),
    (lambda d: d["regions"][0].update(options=[0]), "$.regions[0].options", "1 options for 2 stages"),
    (lambda d: d["stage_summaries"].pop(), "$.stage_summaries", "2 entries for 3 stages"),
    (lambda d: d["stage_summaries"][0].update(name="other"), "$.stage_summaries[0].name", "is not stage 0"),
])
def test_tampered_plans_raise_planner_error_naming_the_path(edit, path, problem):
    with pytest.raises(PlannerError, match=re.escape(f"malformed at {path}: ") + ".*" + re.escape(problem)):
        Plan.from_json(_tamper(edit))


def test_non_finite_numbers_are_not_numbers():
    with pytest.raises(PlannerError, match=re.escape("$.solve_seconds: expected number, got non-finite number")):
        Plan.from_json(_tamper(lambda d: d.update(solve_seconds=float("nan"))))


def test_optional_fields_may_be_left_out():
    data = _plan_data()
    for name in ("gap", "solve_seconds", "budget_bytes", "budget_text", "stage_nodes", "fingerprint",
                 "torch_version", "device", "stage_summaries", "extra"):
        del data[name]
    plan = Plan.from_dict(data)
    assert plan.stage_summaries == () and plan.gap is None


@pytest.mark.parametrize("schema, value, message", [
    ({"type": ["integer", "null"], "minimum": 0}, None, None),
    ({"type": ["integer", "null"], "minimum": 0}, -1, "$: -1 is below the minimum 0"),
    ({"type": "number"}, 3, None),
    ({"type": "integer"}, 3.0, "$: expected integer, got number 3.0"),
    ({"enum": [1]}, True, "$: true is not one of 1"),
    ({"type": "array", "items": {"type": "array", "items": {"type": "string"}}}, [["a"], ["b", 2]],
     "$[1][1]: expected string, got integer 2"),
    ({"type": "object", "additionalProperties": {"type": "integer"}}, {"a": 1, "b": "x"},
     '$.b: expected integer, got string "x"'),
    ({"type": "object"}, {"anything": [1, {"goes": None}]}, None),
])
def test_validator_keywords(schema, value, message):
    if message is None:
        validate(value, schema)
    else:
        with pytest.raises(PlannerError, match=re.escape(f"data is malformed at {message}")):
            validate(value, schema)
