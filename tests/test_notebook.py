"""The quickstart notebook executes top to bottom (it cannot silently rot)."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK = (
  Path(__file__).resolve().parent.parent
  / "docs"
  / "notebooks"
  / "quickstart.ipynb"
)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_quickstart_notebook_runs(tmp_path):
  nb = nbformat.read(NOTEBOOK, as_version=4)
  NotebookClient(
    nb,
    timeout=300,
    kernel_name="python3",
    resources={"metadata": {"path": str(tmp_path)}},
  ).execute()
  outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
  assert not [o for o in outputs if o.output_type == "error"]
  assert any(o.output_type == "display_data" for o in outputs), "no plot"
