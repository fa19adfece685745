"""The ``planner`` command, run as ``python -m planner`` in subprocesses, and its cheap failures through ``main``.

Every subprocess imports torch (seconds), so all of them start at once in a thread pool (one module fixture) and
the tests read their results; the runs that plan profile once with ``--profile-repeats 1`` on a tiny model.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import re
import subprocess
import sys
import textwrap
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from planner import cli
from planner.plan import Plan, SolverStatus
from planner.problem import Problem, Schedule, Stage, TensorInfo

ROOT = Path(__file__).resolve().parents[1]

FACTORY = textwrap.dedent('''
    import torch

    def build():
        torch.manual_seed(0)
        blocks = [torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 32))
                  for _ in range(4)]
        return torch.nn.Sequential(*blocks), (torch.randn(256, 32),)

    def boom():
        raise RuntimeError("no data here")

    class Branchy(torch.nn.Module):
        def forward(self, x):
            return x * 2 if x.sum() > 0 else x

    def branchy():
        return Branchy(), torch.randn(3)

    def on_meta():
        with torch.device("meta"):
            blocks = [torch.nn.Sequential(torch.nn.Linear(4096, 16384), torch.nn.GELU(), torch.nn.Linear(16384, 4096))
                      for _ in range(4)]
        return torch.nn.Sequential(*blocks), (torch.empty(32768, 4096, device="meta"),)
''')

QUICK = ("--profile-repeats", "1")
RUNS = {
    "plan": ["plan", "factory.py:build", "--budget", "60%", "-o", "plan.json", "--json", *QUICK],
    "explain": ["explain", "plan.json"],  # after "plan"
    "sweep": ["sweep", "factory.py:build", "--budgets", "30%,50%,70%,100%", "--csv", "sweep.csv",
              "--png", "sweep.png", *QUICK],
    "infeasible": ["plan", "factory.py:build", "--budget", "1KB", "-q", *QUICK],
    "missing_file": ["plan", "nowhere.py:build", "--budget", "1GB", "-q"],
    "tampered_plan": ["explain", "tampered.json", "-q"],
    "not_capturable": ["plan", "factory.py:branchy", "--budget", "1GB"],  # with progress on stderr
}
IN_PROCESS = {  # the same checks through cli.main, without a torch import each
    "bad_arguments": ["plan", "factory.py:build", "--budget", "1GB", "--solver", "magic", "-q"],
    "missing_factory": ["plan", "factory.py:nothing", "--budget", "1GB", "-q"],
    "factory_raises": ["plan", "factory.py:boom", "--budget", "1GB", "-q"],
    "malformed_plan": ["explain", "garbage.json", "-q"],
    "sweep_json": ["sweep", "factory.py:build", "--budgets", "50%,100%", "--json", "-q", *QUICK],
    "meta_device": ["plan", "factory.py:on_meta", "--device", "l4", "--json", "-q"],
    "meta_without_device": ["plan", "factory.py:on_meta", "--budget", "1GB", "-q"],
    "no_budget": ["plan", "factory.py:build", "-q"],
    "unknown_device": ["plan", "factory.py:build", "--device", "v100", "-q"],
    "layer": ["plan", "factory.py:build", "--budget", "50%", "--granularity", "layer", "--json", "-q", *QUICK],
    "compiled": ["plan", "factory.py:build", "--budget", "60%", "--compile", "--json", "-q", *QUICK],
    "compile_for_device": ["plan", "factory.py:build", "--device", "h100", "--compile-mode", "max-autotune", "-q"],
}


@dataclass(frozen=True)
class Run:
    code: int
    stdout: str
    stderr: str


def _run(cwd: Path, args: list[str]) -> Run:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "planner", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)
    return Run(done.returncode, done.stdout, done.stderr)


def _tampered_plan() -> str:
    problem = Problem((Stage("a", 1.0, 2.0), Stage("b", 1.0, 2.0)),
                      (TensorInfo("x", 10, producer=0, consumers=frozenset({1}), savers=frozenset({1})),))
    data = Plan.from_schedule(problem, Schedule.uniform(2), solver="uniform", status=SolverStatus.HEURISTIC).to_dict()
    data["stage_summaries"][1]["saved_bytes_eager"] = -10
    return json.dumps(data)


def _main(cwd: Path, args: list[str]) -> Run:
    """``cli.main(args)`` in ``cwd``, leaving ``sys.path`` as it was and forgetting the factory module."""
    saved_path, here = list(sys.path), os.getcwd()
    out, err = io.StringIO(), io.StringIO()
    try:
        os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.main(args)
    finally:
        os.chdir(here)
        sys.path[:] = saved_path
        sys.modules.pop("_planner_factory_factory", None)
    return Run(code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Run]:
    cwd = tmp_path_factory.mktemp("cli")
    (cwd / "factory.py").write_text(FACTORY)
    (cwd / "garbage.json").write_text("{this is not json")
    (cwd / "tampered.json").write_text(_tampered_plan())
    jobs = {name: args for name, args in RUNS.items() if name not in ("plan", "explain")}
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        planned = pool.submit(lambda: (_run(cwd, RUNS["plan"]), _run(cwd, RUNS["explain"])))
        futures = {name: pool.submit(_run, cwd, args) for name, args in jobs.items()}
        results = {name: _main(cwd, args) for name, args in IN_PROCESS.items()}  # while the subprocesses run
        results.update({name: future.result() for name, future in futures.items()})
    results["plan"], results["explain"] = planned.result()
    results["cwd"] = cwd  # type: ignore[assignment]
    return results


def _no_traceback(run: Run) -> None:
    assert "Traceback" not in run.stderr + run.stdout


def test_plan_prints_json_and_writes_a_plan_file(runs):
    run = runs["plan"]
    assert run.code == 0, run.stderr
    _no_traceback(run)
    plan = Plan.from_json((runs["cwd"] / "plan.json").read_text())
    assert Plan.from_dict(json.loads(run.stdout)) == plan
    assert plan.budget_text == "60%" and plan.predicted_peak_bytes <= plan.budget_bytes
    assert len(plan.stage_summaries) == len(plan.stage_names) == 4 and plan.fingerprint
    for step in ("capturing Sequential", "profiling", "solving", "wrote plan.json"):
        assert step in run.stderr


def test_explain_prints_the_stage_table(runs):
    run = runs["explain"]
    assert run.code == 0, run.stderr
    plan = Plan.from_json((runs["cwd"] / "plan.json").read_text())
    lines = run.stdout.splitlines()
    assert lines[1].split()[:2] == ["stage", "decision"]
    assert [line.split()[0] for line in lines[3:3 + len(plan.stage_names)]] == list(plan.stage_names)
    assert any(line.startswith("total") for line in lines) and "predicted peak" in run.stdout


def test_sweep_prints_a_table_and_writes_csv(runs):
    run = runs["sweep"]
    assert run.code == 0, run.stderr
    _no_traceback(run)
    lines = run.stdout.splitlines()
    assert lines[1].split() == ["budget", "planner", "uniform", "chen_sqrt", "fewest_blocks"]
    rows = {line.split()[0]: line for line in lines[2:6]}
    assert list(rows) == ["30%", "50%", "70%", "100%"]
    assert rows["100%"].split()[5] == "+0.0%"  # the planner stores everything when the eager peak fits
    assert rows["30%"].split()[3] == "-" and "smallest feasible budget" in run.stdout
    with open(runs["cwd"] / "sweep.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert len(table) == 16
    assert {r["method"] for r in table} == {"planner", "uniform", "chen_sqrt", "fewest_blocks"}
    full = next(r for r in table if r["budget"] == "100%" and r["method"] == "planner")
    assert float(full["predicted_overhead"]) == 0.0 and int(full["predicted_peak_bytes"]) > 0
    png = runs["cwd"] / "sweep.png"
    assert png.is_file() or "matplotlib is not installed" in run.stderr


def test_sweep_json_lists_every_budget_and_method(runs):
    run = runs["sweep_json"]
    assert run.code == 0, run.stderr
    assert run.stderr == ""
    rows = json.loads(run.stdout)
    assert [(r["budget"], r["method"]) for r in rows] == [
        (b, m) for b in ("50%", "100%") for m in ("planner", "uniform", "chen_sqrt", "fewest_blocks")]
    assert rows[4]["predicted_overhead"] == 0.0 and rows[4]["status"] == "optimal"


@pytest.mark.parametrize("name, fragment", [
    ("bad_arguments", "invalid choice: 'magic'"),
    ("missing_file", "no such file: nowhere.py"),
    ("missing_factory", "factory.py has no factory 'nothing'"),
    ("factory_raises", "factory factory.py:boom raised RuntimeError: no data here"),
    ("malformed_plan", "garbage.json: plan is not valid JSON"),
    ("tampered_plan", "tampered.json: plan data is malformed at $.stage_summaries[1].saved_bytes_eager"),
    ("meta_without_device", "a model on the meta device has no run time to measure"),
    ("no_budget", "--budget is required unless --device names the GPU"),
    ("unknown_device", "unknown device 'v100'. Hint: known devices: a100, h100, h200, l4"),
])
def test_usage_errors_exit_2_with_one_line(runs, name, fragment):
    run = runs[name]
    assert run.code == 2
    _no_traceback(run)
    assert run.stdout == ""
    [line] = run.stderr.splitlines()
    assert line.startswith("planner: error: ") and fragment in line


def test_a_model_that_does_not_capture_exits_2_with_one_error_line(runs):
    run = runs["not_capturable"]
    assert run.code == 2
    _no_traceback(run)
    errors = [line for line in run.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("planner: error: could not capture Branchy")
    assert "def forward" not in run.stderr  # torch's partial graph is kept off stderr
    assert "capturing Branchy ... failed" in run.stderr


def test_an_infeasible_budget_exits_3_naming_the_smallest_feasible_budget(runs):
    run = runs["infeasible"]
    assert run.code == 3
    _no_traceback(run)
    [line] = run.stderr.splitlines()
    match = re.search(r"smallest feasible budget is [0-9.]+ [KMG]?i?B \(([0-9]+) bytes\): rerun with --budget \1",
                      line)
    assert line.startswith("planner: error: budget '1KB'") and match, line
    assert int(match.group(1)) > 1000


def test_the_console_script_is_declared():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert config["project"]["scripts"]["planner"] == "planner.cli:main"


def test_factories_load_from_a_package_module(tmp_path, monkeypatch):
    (tmp_path / "mymodels").mkdir()
    (tmp_path / "mymodels" / "__init__.py").write_text("")
    (tmp_path / "mymodels" / "tiny.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    try:
        model, inputs, kwargs = cli.build_model("mymodels.tiny:build")
    finally:
        sys.modules.pop("mymodels.tiny", None)
        sys.modules.pop("mymodels", None)
    assert len(model) == 4 and inputs[0].shape == (256, 32) and kwargs == {}


def test_in_process_errors_are_one_line(capsys):
    assert cli.main(["plan", "x.py:build"]) == 2
    assert cli.main(["sweep", "x.py:build", "--budgets", "8 bananas"]) == 2
    assert cli.main(["plan", "x.py", "--budget", "1GB", "--quiet"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "planner: error: --budget is required unless --device names the GPU whose memory to plan for. Hint: e.g. "
        "--budget 8GB, --budget 60%, or --device h100",
        "planner: error: budget '8 bananas' has an unknown unit 'bananas'. Hint: write an int of bytes, a size such "
        "as '8GB', '512MiB', '1.5GiB', or a share of the eager peak such as '60%'",
        "planner: error: model 'x.py' is not FILE.py:FACTORY or package.module:FACTORY. Hint: for example "
        "model.py:build"]


def test_device_plans_a_meta_model_for_a_gpu_it_does_not_have(runs):
    run = runs["meta_device"]
    assert run.code == 0, run.stderr
    plan = Plan.from_dict(json.loads(run.stdout))
    assert plan.timing == "analytic:l4" and plan.device == "meta" and plan.budget_text == "l4 memory"
    assert plan.allocator_margin == 0.05 and plan.eager_peak_bytes > plan.budget_bytes  # 4 x 2 GiB activations
    assert plan.regions and plan.predicted_peak_bytes <= plan.planned_budget_bytes


def test_granularity_cuts_inside_the_blocks_and_is_recorded(runs):
    run = runs["layer"]
    assert run.code == 0, run.stderr
    plan = Plan.from_dict(json.loads(run.stdout))
    assert len(plan.stage_names) > 4 and dict(plan.extra)["granularity"] == "layer"
    assert plan.predicted_peak_bytes <= plan.budget_bytes


def test_solver_progress_and_time_limit_reach_the_solver(tmp_path, monkeypatch, capsys):
    (tmp_path / "factory.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    code = cli.main(["plan", "factory.py:build", "--budget", "70%", "--profile-repeats", "1", "--solver", "dp",
                     "--solver-progress", "--time-limit", "30", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "planner: dp: stage 1/4" in captured.err
    plan = Plan.from_dict(json.loads(captured.out))
    assert plan.lower_bound_seconds is not None and plan.gap is not None


def test_explain_tensors_lists_what_becomes_of_each_tensor(tmp_path, capsys):
    problem = Problem(tuple(Stage(f"block.{i}", 0.001, 0.002) for i in range(2)),
                      (TensorInfo("h0", 4096, producer=0, savers=frozenset({0}), node="mm0"),
                       TensorInfo("x0", 1024, producer=0, consumers=frozenset({1}), savers=frozenset({1}),
                                  node="add0")))
    path = tmp_path / "plan.json"
    path.write_text(Plan.from_schedule(problem, Schedule.from_segments([(0, 1)]), solver="dp",
                                       status=SolverStatus.OPTIMAL).to_json())
    assert cli.main(["explain", str(path), "--tensors"]) == 0
    out = capsys.readouterr().out
    assert "    recomputed      4.00 KiB  h0" in out and "    kept            1.00 KiB  x0" in out
    assert cli.main(["explain", str(path)]) == 0 and "h0" not in capsys.readouterr().out


def test_compile_plans_for_the_compiled_step_and_records_its_measured_peak(runs):
    run = runs["compiled"]
    assert run.code == 0, run.stderr
    plan = Plan.from_dict(json.loads(run.stdout))
    assert plan.compiled_peak_bytes is not None and plan.compiled_peak_bytes <= plan.budget_bytes
    assert dict(plan.extra)["compiled_plans_measured"] >= 1 and dict(plan.extra)["compiled_with"] == ""


def test_compile_with_a_device_to_plan_for_is_a_usage_error(runs):
    run = runs["compile_for_device"]
    assert run.code == 2 and "roofline" in run.stderr and len(run.stderr.strip().splitlines()) == 1
