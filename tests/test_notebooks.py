"""Every notebook in notebooks/ runs top to bottom at small sizes (``PLANNER_NOTEBOOK_SMALL=1``), and is committed
without bulky outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
MAX_COMMITTED_OUTPUT_BYTES = 50_000


def test_notebooks_exist():
    assert {"quickstart.ipynb", "convnets.ipynb"} <= {p.name for p in NOTEBOOKS}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_committed_small(path):
    cells = json.loads(path.read_text())["cells"]
    outputs = sum(len(json.dumps(c.get("outputs", []))) for c in cells if c["cell_type"] == "code")
    assert outputs < MAX_COMMITTED_OUTPUT_BYTES, f"{path.name} carries {outputs} bytes of outputs: strip them"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("PLANNER_NOTEBOOK_SMALL", "1")  # the kernel inherits the environment
    monkeypatch.setenv("MPLBACKEND", "Agg")
    book = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(book, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError, with the cell and its traceback, when a cell fails
    errors = [o for c in book.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    images = [o for c in book.cells if c.cell_type == "code" for o in c.outputs
              if "image/png" in o.get("data", {})]
    assert images, f"{path.name} drew no picture"
