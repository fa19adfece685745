import dataclasses
import re

import pytest

import planner
from planner.explain import explain, format_seconds
from planner.plan import Plan, SolverStatus, StageSummary, TensorFate
from planner.problem import Problem, RecomputeOption, Region, Schedule, Stage, TensorInfo


def _problem():
    """Four layers: each makes a hidden tensor it saves and an output the next layer reads and saves."""
    stages = tuple(Stage(f"layers.{i}", 0.003, 0.006, options=(
        RecomputeOption("all", frozenset(), 0.003), RecomputeOption("keep_mm", frozenset({f"mm{i}"}), 0.001)))
        for i in range(4))
    tensors = tuple(t for i in range(4) for t in (
        TensorInfo(f"h{i}", 8192, producer=i, savers=frozenset({i}), node=f"mm{i}"),
        TensorInfo(f"x{i}", 1024, producer=i, consumers=frozenset({i + 1} if i < 3 else ()),
                   savers=frozenset({i, i + 1} if i < 3 else {i}), node=f"out{i}")))
    return Problem(stages, tensors, fixed_bytes=4096)


def _plan(schedule):
    return Plan.from_schedule(_problem(), schedule, solver="ilp", status=SolverStatus.OPTIMAL, gap=0.0,
                              budget_bytes=60_000)


def test_stage_summaries_record_what_each_stage_saves_and_costs():
    plan = _plan(Schedule((Region(1, 3, (0, 1)),)))
    stored, first, cached, last = plan.stage_summaries
    assert [s.name for s in plan.stage_summaries] == list(plan.stage_names)
    assert (stored.saved_bytes_eager, stored.saved_bytes_planned) == (8192 + 1024, 8192 + 1024)
    assert stored.recompute_seconds == 0 and stored.cached_nodes == ()
    # saved eagerly: own hidden, own output, the previous output (saved by both stages, counted for both)
    assert first.saved_bytes_eager == 8192 + 1024 + 1024
    assert (first.recompute_seconds, first.cached_nodes) == (0.003, ())
    assert first.saved_bytes_planned == 1024  # the region's input, kept by the checkpoint
    assert (cached.recompute_seconds, cached.cached_nodes) == (0.001, ("mm2",))
    assert cached.saved_bytes_planned == 8192  # the output of its cached node mm2
    assert last.saved_bytes_planned == last.saved_bytes_eager == 8192 + 1024 + 1024
    assert (first.forward_seconds, first.backward_seconds) == (0.003, 0.006)


def test_stage_summaries_round_trip_through_json():
    plan = _plan(Schedule((Region(0, 2, (1, 0)),)))
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert again.stage_summaries == plan.stage_summaries
    assert isinstance(again.stage_summaries[0], StageSummary)
    assert isinstance(again.stage_summaries[0].cached_nodes, tuple)


def test_explain_shows_one_row_per_stage_with_decision_bytes_and_time():
    text = explain(_plan(Schedule((Region(1, 3, (0, 1)),))))
    lines = text.splitlines()
    assert lines[0] == "plan by ilp (optimal): 2 of 4 stages recomputed in 1 region(s)"
    assert lines[1].split() == ["stage", "decision", "kept", "(plan)", "kept", "(eager)", "recompute"]
    rows = {line.split()[0]: line for line in lines[3:7]}
    assert list(rows) == ["layers.0", "layers.1", "layers.2", "layers.3"]
    assert "stored" in rows["layers.0"] and "9.00 KiB" in rows["layers.0"]
    assert rows["layers.1"].split()[1:5] == ["recomputed", "in", "region", "0"] and "caching" not in rows["layers.1"]
    assert "3.00 ms" in rows["layers.1"]
    assert "recomputed in region 0, caching 1 node " in rows["layers.2"] and "1.00 ms" in rows["layers.2"]
    assert rows["layers.1"].split()[-6:-2] == ["1.00", "KiB", "10.00", "KiB"]
    total = lines[8]
    assert total.startswith("total") and "2 of 4 recomputed" in total and total.endswith("4.00 ms")
    assert "predicted peak" in text and "within a budget of 58.59 KiB" in text


def test_explain_lists_cached_nodes_on_request():
    text = explain(_plan(Schedule((Region(2, 3, (1,)),))), show_nodes=True)
    assert "    caches mm2" in text.splitlines()
    assert "caches" not in explain(_plan(Schedule((Region(2, 3, (1,)),))))


def test_explain_numbers_regions_in_order():
    text = explain(_plan(Schedule.uniform(4)))
    for i in range(4):
        assert f"layers.{i}  recomputed in region {i}" in text


def test_explain_marks_missing_numbers_of_plans_without_summaries():
    plan = dataclasses.replace(_plan(Schedule.uniform(4)), stage_summaries=())
    rows = explain(plan).splitlines()[3:7]
    assert all(row.split()[-3:] == ["?", "?", "?"] for row in rows)


def test_explain_says_when_a_plan_reuses_the_plan_for_larger_inputs():
    plan = _plan(Schedule.uniform(4))
    assert "reusing" not in explain(plan)
    reused = dataclasses.replace(plan, extra=(("reused_from", "59701e63a71b44c6"),))
    assert explain(reused).splitlines()[1] == ("reusing the plan for larger inputs (59701e63a71b44c6): its bytes "
                                               "and times below are upper bounds for these")


def test_explain_is_exported_from_the_package():
    assert planner.explain is explain


def test_explain_takes_the_module_optimize_returned_and_names_what_it_cannot_explain():
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(),
                                                      torch.nn.Linear(64, 16)) for _ in range(4)])
    opt = planner.optimize(model, "70%", example_inputs=(torch.randn(128, 16),), profile_repeats=1)
    assert explain(opt) == explain(opt.plan)
    with pytest.raises(planner.PlannerError, match="not a Sequential"):
        explain(model)
    installed = planner.optimize(model, "70%", example_inputs=(torch.randn(128, 16),), profile_repeats=1,
                                 in_place=True)
    assert explain(model) == explain(installed.plan)  # a model planned in place


@pytest.mark.parametrize("seconds, text", [(0, "0"), (5e-7, "0.5 us"), (0.25, "250.00 ms"), (12.5, "12.50 s")])
def test_format_seconds(seconds, text):
    assert format_seconds(seconds) == text


def test_explain_lists_each_stages_tensors_and_their_fate_on_request():
    text = explain(_plan(Schedule((Region(1, 3, (0, 1)),))), show_tensors=True)
    lines = text.splitlines()
    first = lines.index(next(line for line in lines if line.startswith("layers.1")))
    # layers.1 makes h1 (only it saves it) and x1 (saved by layers.1 and layers.2, both recomputed)
    assert lines[first + 1].split() == ["recomputed", "8.00", "KiB", "h1"]
    assert lines[first + 2].split() == ["recomputed", "1.00", "KiB", "x1"]
    assert lines[first + 3] == "    recomputing frees 9.00 KiB between the forward and the backward"
    assert "    cached          8.00 KiB  h2" in lines  # keep_mm caches mm2, which makes h2
    assert "    kept            1.00 KiB  x2" in lines  # layers.3, stored, saves it
    assert "    kept            1.00 KiB  x0" in lines  # so does layers.0, which makes it
    assert text.endswith("instead of remaking them.")
    assert "recomputing frees" not in explain(_plan(Schedule())) and "h1" not in explain(_plan(Schedule()))


def test_explain_shows_region_inputs_held_by_a_later_region():
    text = explain(_plan(Schedule.uniform(4)), show_tensors=True, show_nodes=True)
    assert text.count("region input") == 3 + 1  # x0, x1, x2, and the note
    assert "caches" not in text


def test_a_real_models_plan_names_its_graph_tensors_and_their_fates():
    """An MLP chain planned at 70% of its eager peak: every listed tensor is made by a node of the stage it
    is listed under; unplanned, all are kept; planned, some are recomputed, and the tensors a stored stage keeps
    are what the stage summaries count for the stored stages that make and save them."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                                      torch.nn.Linear(256, 64)) for _ in range(4)))
    x = torch.randn(2048, 64)
    eager = planner.plan(model, "100%", (x,), profile_repeats=0)
    assert eager.regions == () and {t.fate for t in eager.tensor_summaries} == {TensorFate.KEPT}
    half = planner.plan(model, "70%", (x,), profile_repeats=0)
    assert half.regions and TensorFate.RECOMPUTED in {t.fate for t in half.tensor_summaries}
    for t in half.tensor_summaries:
        assert t.node in half.stage_nodes[t.stage] and t.nbytes > 0
        assert t.module_path.startswith(half.stage_names[t.stage] + ".") and t.seconds > 0  # e.g. "2.1", a ReLU
    assert Plan.from_json(half.to_json()).tensor_summaries == half.tensor_summaries
    text = explain(half, show_tensors=True)
    assert "recomputing frees" in text and re.search(r"  \(\d\.\d, op [\d.]+ [mu]?s\)", text)
