"""The notebook runs top to bottom on the package (a small step count), failing on any cell error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "fashion_mnist_jax.ipynb"


def test_notebook_is_committed_without_outputs():
    document = json.loads(NOTEBOOK.read_text())
    for cell in document["cells"]:
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [] and cell["execution_count"] is None


@pytest.mark.notebook
def test_notebook_executes(real_dataset, monkeypatch, tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("FASHIONJAX_NOTEBOOK_STEPS", "20")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError on the first failing cell
    text = "\n".join(output.get("text", "") for cell in notebook.cells for output in cell.get("outputs", []))
    assert "test accuracy" in text and "on 10,000 images" in text
    assert "grad vs value_and_grad difference: 0.000000" in text
    images = sum("image/png" in output.get("data", {}) for cell in notebook.cells for output in cell.get("outputs", []))
    assert images == 4
    assert "20 steps," in text  # the training cell ran the length the environment asked for
