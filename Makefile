# Every target sets itself up on a fresh machine that has only Python + pip.
# Two environments, both ends of the supported JAX range, each pinned by a
# constraints file: .venv (Python 3.11, jax 0.10.2) and .venv-newest
# (Python 3.13, the newest jax). `make test` builds both at once, lints
# once, runs the whole suite on the newest and the version-dependent tests
# on the oldest (VERSION_TESTS); test-oldest / test-newest run one.
# pip byte-compiles what it installs: where PYTHONDONTWRITEBYTECODE is set
# (as on the reference machine) nothing else would, and every Python
# process the tests start would compile its imports again (7.1 s against
# 2.9 s for the newest environment's).
PYTHON_OLDEST ?= python3.11
PYTHON_NEWEST ?= env PYENV_VERSION=3.13.0 python3.13
VENV := .venv
VENV_NEWEST := .venv-newest
PY := $(VENV)/bin/python
PY_NEWEST := $(VENV_NEWEST)/bin/python
# pytest workers: two for one suite run alone; `make test` runs the two
# environments' suites side by side, the oldest's in one process and the
# newest's in two (see there).
WORKERS ?= -n 2 --dist worksteal
PYTEST = -m pytest -q $(WORKERS)

.PHONY: test test-oldest test-oldest-all test-newest test-ray lint fuzz demo bench \
  docs clean

comma := ,
# $(1): venv folder, $(2): the Python that creates it, $(3): constraints
# file, $(4): extras
define venv_rule
$(1)/.installed: pyproject.toml $(3)
	test -x $(1)/bin/python || $(2) -m venv $(1)
	$(1)/bin/python -m pip install --quiet --upgrade pip
	$(1)/bin/python -m pip install --quiet -c $(3) -e '.[$(4)]'
	touch $$@
endef
$(eval $(call venv_rule,$(VENV),$(PYTHON_OLDEST),constraints/oldest.txt,dev))
$(eval $(call venv_rule,$(VENV_NEWEST),$(PYTHON_NEWEST),constraints/newest.txt,dev$(comma)ray))

lint: $(VENV)/.installed
	$(PY) -m ruff format --check .
	$(PY) -m ruff check .

# The published examples (docstrings, guides, README, the docs site, the
# quickstart notebook, the example programs: the demo and the Ray trainer)
# run on the newest environment, the one a new user installs; everything
# else, the library's own tests, runs on both.
EXAMPLE_TESTS := --ignore=tests/test_docs.py --ignore=tests/test_notebook.py \
  --ignore=tests/test_demo.py --ignore=tests/test_ray.py

# The oldest environment runs the tests whose outcome can depend on the JAX
# version: the jaxpr reader and what it reads (the rewrite, its fuzzer,
# sparse_value_and_grad, the public models), the compatibility layer
# (shard_map, pmap, multi-process, orbax, the flatten guard, interop), what
# the compiler makes of a step (HLO, copies, exported programs, lowering
# per platform, determinism), and the conformance suite's jit checks over
# every transformation as the smoke set; the newest runs everything.
# `make test-oldest-all` runs the whole suite on the oldest.
VERSION_TESTS := $(addprefix tests/test_,$(addsuffix .py,\
  jaxpr fuzz sparse models interop mirrored sharded multihost checkpoint \
  input_traps no_table_copy platforms accelerator_branches determinism)) \
  'tests/test_conformance.py::test_conformance[check_jit-transforms]' \
  'tests/test_conformance.py::test_conformance[check_jit-optimizers]'

# The two environments' suites side by side: the oldest's in one pytest
# process, the newest's (the larger) in two workers that take whole files
# (one traces a file's shared programs once; the compilation cache is
# shared, so a program compiles once for all three). The Ray trainer's tests
# run in a process of their own once the oldest's suite is done (most of
# their time is spent waiting on Ray's processes, whose restarts time out
# when three suites hold both cores). The output comes a line at a time,
# each line whole.
test:
	$(MAKE) --no-print-directory -j4 --output-sync=line WORKERS= \
	  NEWEST_WORKERS='-n 2 --dist loadfile' \
	  NEWEST_APART=--ignore=tests/test_ray.py RAY_AFTER=test-oldest lint \
	  test-oldest test-newest test-ray

test-oldest: $(VENV)/.installed
	@$(PY) -c 'import sys, jax; print("== oldest: Python", sys.version.split()[0], "jax", jax.__version__)'
	$(PY) $(PYTEST) $(VERSION_TESTS)

test-oldest-all: $(VENV)/.installed
	$(PY) $(PYTEST) $(EXAMPLE_TESTS)

test-newest: $(VENV_NEWEST)/.installed
	@$(PY_NEWEST) -c 'import sys, jax; print("== newest: Python", sys.version.split()[0], "jax", jax.__version__)'
	$(PY_NEWEST) $(PYTEST) $(NEWEST_WORKERS) $(NEWEST_APART)

test-ray: $(VENV_NEWEST)/.installed | $(RAY_AFTER)
	$(PY_NEWEST) -m pytest -q tests/test_ray.py

# The differential fuzzer of the rewrite, long: N random losses (default
# 2000) against jax.value_and_grad on each environment.
fuzz: $(VENV)/.installed $(VENV_NEWEST)/.installed
	GRADTX_FUZZ_EXAMPLES=$(or $(N),2000) $(PY_NEWEST) -m pytest -q -x \
	  --hypothesis-show-statistics tests/test_fuzz.py
	GRADTX_FUZZ_EXAMPLES=$(or $(N),2000) $(PY) -m pytest -q -x \
	  --hypothesis-show-statistics tests/test_fuzz.py

demo: $(VENV)/.installed
	$(PY) -m examples.demo $(ARGS)

bench: $(VENV)/.installed
	$(PY) -m benchmarks $(ARGS)

docs: $(VENV)/.installed
	$(PY) -m mkdocs build --strict

clean:
	rm -rf $(VENV) $(VENV_NEWEST) site
