"""docs/notebooks/quickstart.ipynb runs top to bottom on the offline SmolLM2 (so it cannot rot)."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

NOTEBOOK = Path(__file__).resolve().parents[1] / "docs" / "notebooks" / "quickstart.ipynb"


def test_quickstart_notebook_executes(tmp_path):
    missing = [m for m in ("nbclient", "nbformat", "ipykernel", "matplotlib") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"notebook test needs {missing}: `pip install -e '.[notebook]'`")
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOK, as_version=4)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the kernel inherits it: no network
    # The kernel runs in tmp_path, never in the repository root (drafters/ there shadows a PyPI package).
    client = NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    assert "identical to autoregressive: True" in text and "mean_accepted_length" in text
    assert any("image/png" in o.get("data", {}) for o in outputs), "the plot is missing"
    assert re.search(r"^spec +[\d.]+ tok/s  speedup [\d.]+  mean accepted length [\d.]+$", text, re.M), text
