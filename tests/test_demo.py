"""`make demo` runs end to end (tiny sizes; the real run is ~2 minutes)."""

from examples import demo


def test_demo_runs_end_to_end(tmp_path, capsys):
  demo.main([
    "--steps", "6", "--batch", "64", "--max-tokens", "20000",
    "--vocab", "2000", "--dim", "8", "--out", str(tmp_path),
  ])  # fmt: skip
  out = capsys.readouterr().out
  assert "| optimizer updates | 3 |" in out
  assert "nearest neighbours" in out
  assert (tmp_path / "loss.png").stat().st_size > 0
