"""`make demo` runs end to end (tiny sizes; the real run is ~2 minutes)."""

import re

from examples import demo


def test_demo_runs_end_to_end(tmp_path, capsys):
  demo.main([
    "--steps", "6", "--batch", "64", "--max-tokens", "20000",
    "--vocab", "2000", "--dim", "8", "--out", str(tmp_path),
  ])  # fmt: skip
  out = capsys.readouterr().out
  assert "| optimizer updates | 3 |" in out
  # table[ids] in the model: both tables sparse, 8 ids per center word
  assert re.search(r"\['center'\] +float32\[\d+, 8\] +sparse, 64 rows", out)
  assert re.search(r"\['context'\] +float32\[\d+, 8\] +sparse, 384 rows", out)
  assert "nearest neighbours" in out
  assert (tmp_path / "loss.png").stat().st_size > 0
