"""experiments/quickstart.ipynb runs top to bottom in a real Jupyter kernel (nbclient)."""

import os
import re
import sys

import pytest

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")

from conftest import FAST_RUN, ROOT  # noqa: E402


def _text(cell) -> str:
    return "".join(o.get("text", "") + "".join(o.get("data", {}).get("text/plain", ""))
                   for o in cell.get("outputs", []))


def test_quickstart_notebook(tmp_path, monkeypatch):
    monkeypatch.setenv("QUICKSTART_WORKDIR", str(tmp_path / "run"))
    monkeypatch.setenv("XLA_FLAGS", FAST_RUN)  # 120 steps: the kernel's steps, not its compiles, dominate
    # The kernel spec starts `python`: make that this environment's interpreter.
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    notebook = nbformat.read(ROOT / "experiments" / "quickstart.ipynb", as_version=4)
    nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT / "experiments")}}).execute()
    code = [c for c in notebook.cells if c.cell_type == "code"]
    outputs = [_text(c) for c in code]
    assert outputs[0].startswith("8 devices")
    first_loss = float(re.search(r"step 80: loss ([\d.]+)", outputs[1]).group(1))
    assert first_loss < 3.0  # learned well below the 5.5 of uniform bytes
    assert any("image/png" in o.get("data", {}) for o in code[2].outputs)  # the plot
    assert "PartitionSpec" in outputs[3] and "params/embed" in outputs[3]
    assert "resuming from step 80" in outputs[4] and "step 120: loss" in outputs[4]
    assert "note: checkpoint written on mesh data=8" in outputs[4]
    generated = outputs[5].strip()
    assert generated.startswith("'") and len(generated) > 20  # the repr of the generated text
