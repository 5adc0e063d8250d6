"""The docs: every public name documented, doctests pass, the site builds
strictly, the README's code runs."""

import doctest
import importlib
import os
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

import gradtx

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE

MODULES = sorted(
  m.name for m in pkgutil.iter_modules(gradtx.__path__, prefix="gradtx.")
)
PAGES = sorted(str(p.relative_to(ROOT)) for p in DOCS.rglob("*.md"))


def test_every_public_name_is_documented():
  api = (DOCS / "api.md").read_text()
  documented = set(re.findall(r"^::: gradtx\.(\w+)\s*$", api, re.M))
  missing = sorted(set(gradtx.__all__) - documented)
  assert not missing, f"add `::: gradtx.NAME` to docs/api.md for {missing}"
  unknown = sorted(documented - set(gradtx.__all__))
  assert not unknown, f"docs/api.md documents non-public names {unknown}"
  for name in gradtx.__all__:
    doc = getattr(gradtx, name).__doc__ or ""
    assert len(doc.strip()) > 20, f"gradtx.{name} has no docstring"


def test_all_is_sorted_and_complete():
  assert list(gradtx.__all__) == sorted(gradtx.__all__)
  assert all(hasattr(gradtx, n) for n in gradtx.__all__)


@pytest.mark.parametrize("module", MODULES)
def test_docstring_examples(module):
  result = doctest.testmod(importlib.import_module(module), optionflags=FLAGS)
  assert result.failed == 0, f"{result.failed} doctest(s) failed in {module}"
  assert result.attempted > 0, f"{module} has no docstring examples"


@pytest.mark.parametrize("page", PAGES)
def test_guide_examples(page):
  result = doctest.testfile(
    str(ROOT / page), module_relative=False, optionflags=FLAGS
  )
  assert result.failed == 0, f"{result.failed} example(s) failed in {page}"


def test_readme_code_runs():
  blocks = re.findall(
    r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S
  )
  assert blocks, "README has no python example"
  for block in blocks:
    exec(compile(block, "README.md", "exec"), {})


def test_site_builds_strictly(tmp_path):
  env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "mkdocs",
      "build",
      "--strict",
      "-q",
      "-d",
      str(tmp_path / "site"),
    ],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 0, proc.stdout + proc.stderr
