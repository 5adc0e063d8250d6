"""The package's layout: the import graph of gradtx/ has no cycle, no
module uses a private name (``_x``) of another, and docs/contributing.md's
module map lists every module in import order and gives each one job.

Read from the source with ``ast``, so an import inside a function counts as
much as one at the top of a module.
"""

import ast
import re
from pathlib import Path
from typing import NamedTuple

PACKAGE = Path(__file__).resolve().parent.parent / "gradtx"

# Known edges of a cycle, each with the reason it is still here. Empty this
# list as they go: the test fails on an edge listed here that is gone.
KNOWN_CYCLE_EDGES: set[tuple[str, str]] = set()


def _modules() -> dict[str, ast.Module]:
  return {
    path.stem: ast.parse(path.read_text(), filename=str(path))
    for path in sorted(PACKAGE.glob("*.py"))
  }


MODULES = _modules()


class _Use(NamedTuple):
  """``module`` uses ``target`` (its ``name``; None: the module itself)."""

  module: str
  target: str
  name: str | None
  line: int

  def __repr__(self):
    what = f"{self.target}.{self.name}" if self.name else self.target
    return f"gradtx/{self.module}.py:{self.line} uses {what}"


def _target(dotted: str | None, level: int) -> str | None:
  """The gradtx module an import names (``__init__`` for the package), or
  None for an import from outside gradtx."""
  parts = (dotted or "").split(".") if dotted else []
  if level:  # relative: gradtx/ is one package, so "." is gradtx
    parts = ["gradtx", *parts]
  if not parts or parts[0] != "gradtx":
    return None
  return parts[1] if len(parts) > 1 else "__init__"


def _uses(module: str, tree: ast.Module) -> list[_Use]:
  """Every import of a gradtx module in ``tree``, wherever it is, and every
  attribute of an imported gradtx module read through it."""
  uses, aliases = [], {}
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for a in node.names:
        target = _target(a.name, 0)
        if target is None:
          continue
        uses.append(_Use(module, target, None, node.lineno))
        if a.asname:
          aliases[a.asname] = target
    elif isinstance(node, ast.ImportFrom):
      target = _target(node.module, node.level)
      if target is None:
        continue
      for a in node.names:
        if target == "__init__" and a.name in MODULES:  # from gradtx import _m
          uses.append(_Use(module, a.name, None, node.lineno))
          aliases[a.asname or a.name] = a.name
        else:
          uses.append(_Use(module, target, a.name, node.lineno))
  for node in ast.walk(tree):
    if (
      isinstance(node, ast.Attribute)
      and isinstance(node.value, ast.Name)
      and node.value.id in aliases
    ):
      uses.append(_Use(module, aliases[node.value.id], node.attr, node.lineno))
  return uses


USES = [use for m, tree in MODULES.items() for use in _uses(m, tree)]


def _private(name: str | None) -> bool:
  return bool(name) and name.startswith("_") and not name.startswith("__")


def _edges() -> dict[str, set[str]]:
  graph = {m: set() for m in MODULES}
  for use in USES:
    if use.target != use.module:
      graph[use.module].add(use.target)
  return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """One cycle of ``graph`` as a path ``[a, b, ..., a]``, or None."""
  state = {}  # module -> "open" while on the stack, "done" after

  def visit(node, path):
    state[node] = "open"
    for nxt in sorted(graph.get(node, ())):
      if state.get(nxt) == "open":
        return path[path.index(nxt) :] + [node, nxt]
      if nxt not in state:
        found = visit(nxt, [*path, node])
        if found:
          return found
    state[node] = "done"
    return None

  for start in sorted(graph):
    if start not in state:
      found = visit(start, [])
      if found:
        return found
  return None


def test_the_graph_is_read():
  # The reader finds what we know is there: a guard against a test that
  # passes because it reads nothing.
  graph = _edges()
  assert "_sparse_rows" in graph["_rows"] and "_rowio" in graph["_rows"]
  assert "_rowio" in graph["_autodiff"] and "_jaxpr" in graph["_autodiff"]
  assert "_sparse_rows" in graph["__init__"]
  assert "_platform" in graph["_dedup"]  # `from gradtx import _platform`


def test_no_import_cycle():
  graph = _edges()
  for a, b in sorted(KNOWN_CYCLE_EDGES):
    assert b in graph.get(a, ()), (
      f"gradtx/{a}.py no longer imports {b}: remove ({a!r}, {b!r}) from "
      "KNOWN_CYCLE_EDGES in tests/test_layout.py"
    )
    graph[a].discard(b)
  cycle = _cycle(graph)
  assert cycle is None, (
    "import cycle " + " -> ".join(cycle) + " (imports inside functions "
    "count): move the shared code down to a module both can import"
  )


def test_known_cycle_edges_are_what_is_left():
  # Each listed edge closes a cycle today; an edge that closes none is not
  # an exception to anything.
  graph = _edges()
  for a, b in sorted(KNOWN_CYCLE_EDGES):
    others = {k: set(v) for k, v in graph.items()}
    others[a].discard(b)
    assert _reaches(others, b, a), (
      f"({a!r}, {b!r}) in KNOWN_CYCLE_EDGES closes no cycle: remove it"
    )


def _reaches(graph: dict[str, set[str]], start: str, goal: str) -> bool:
  seen, todo = set(), [start]
  while todo:
    node = todo.pop()
    if node == goal:
      return True
    if node not in seen:
      seen.add(node)
      todo.extend(graph.get(node, ()))
  return False


def test_no_private_name_crosses_modules():
  bad = [use for use in USES if _private(use.name) and use.target != use.module]
  assert not bad, (
    "private names used from another module (give them a name without the "
    "leading underscore, or move them to the module that uses them): "
    + "; ".join(map(repr, bad))
  )


def test_platform_code_goes_through_the_one_wrapper():
  # The test suite takes the GPU branches on CPU by patching
  # gradtx._platform.platform_dependent (tests/conformance.py): a caller
  # that calls lax.platform_dependent itself, or holds the wrapper under a
  # name of its own (`from gradtx._platform import platform_dependent`),
  # would escape the patch.
  bad = []
  for module, tree in MODULES.items():
    if module == "_platform":
      continue
    for node in ast.walk(tree):
      if (
        isinstance(node, ast.ImportFrom)
        and _target(node.module, node.level) == "_platform"
      ):
        bad.append(f"gradtx/{module}.py:{node.lineno} imports from _platform")
      elif (
        isinstance(node, ast.Attribute)
        and node.attr == "platform_dependent"
        and not (
          isinstance(node.value, ast.Name) and node.value.id == "_platform"
        )
      ):
        bad.append(
          f"gradtx/{module}.py:{node.lineno} calls {ast.unparse(node)}"
        )
  assert not bad, (
    "platform-dependent code must call `_platform.platform_dependent(...)` "
    "(`from gradtx import _platform`): " + "; ".join(bad)
  )


def _module_map() -> dict[str, str]:
  """docs/contributing.md's module map: module -> what it holds, in the
  map's order."""
  doc = (PACKAGE.parent / "docs" / "contributing.md").read_text()
  return dict(re.findall(r"^\| `(_\w+)\.py` \| (.*) \|$", doc, re.M))


def test_the_module_map_lists_every_module_in_import_order():
  listed = list(_module_map())
  modules = sorted(set(MODULES) - {"__init__"})
  assert sorted(listed) == modules, (
    "docs/contributing.md's module map must list each module of gradtx/ "
    f"once; missing {sorted(set(modules) - set(listed))}, not a module "
    f"{sorted(set(listed) - set(modules))}"
  )
  graph = _edges()
  for i, module in enumerate(listed):
    later = sorted(
      (graph[module] & set(listed[i + 1 :]))
      - {b for a, b in KNOWN_CYCLE_EDGES if a == module}
    )
    assert not later, (
      f"gradtx/{module}.py imports {later}, listed below it in "
      "docs/contributing.md's module map (bottom first): move the line"
    )


# A module past this many lines holds more than one job (gradtx/_stack.py
# held nine at 1,615): split it by job, each with its line in the map.
MAX_MODULE_LINES = 1100


def test_no_module_outgrows_one_job():
  long = {
    f"gradtx/{path.name}": n
    for path in sorted(PACKAGE.glob("*.py"))
    if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
  }
  assert not long, (
    f"modules over {MAX_MODULE_LINES} lines: {long}; split them by job "
    "(docs/contributing.md's module map gives each its own line)"
  )


# The jobs of the table stack family (issues 47, 62), each one module's: its
# line in the map opens with the job, and no other line's job names it.
STACK_JOBS = {
  "raw id": "_ids",
  "input form": "_inputs",
  "plan": "_plan",
  "pooled read": "_pooled",
  "admission": "_admission",
  "id map": "_vocab",
  "placement": "_placement",
  "fresh rows": "_fresh_rows",
  "facade": "_stack",
}


def _job(what: str) -> str:
  """The job a line of the map opens with: its text up to the first
  ``": "`` outside backticks ("" if none)."""
  outside = re.sub(r"`[^`]*`", lambda m: "x" * len(m.group()), what)
  at = outside.find(": ")
  return what[:at] if at > 0 else ""


def test_the_module_map_gives_each_module_one_job():
  jobs = {m: _job(what) for m, what in _module_map().items()}
  assert jobs, "docs/contributing.md's module map was not read"
  headless = [m for m, job in jobs.items() if not job]
  assert not headless, (
    f"{headless}: open each line of docs/contributing.md's module map with "
    "its module's one job, then a colon and what it holds"
  )
  shared = {
    job: [m for m in jobs if jobs[m] == job]
    for job in set(jobs.values())
    if list(jobs.values()).count(job) > 1
  }
  assert not shared, f"modules share a job in the module map: {shared}"
  for word, module in STACK_JOBS.items():
    holders = [
      m for m, job in jobs.items() if re.search(rf"\b{word}s?\b", job, re.I)
    ]
    assert holders == [module], (
      f"the stack family's job {word!r} must be the job of gradtx/{module}.py "
      f"alone in docs/contributing.md's module map; the jobs naming it: "
      f"{ {m: jobs[m] for m in holders} }"
    )


# The table stack family (issue 62): a one-way wing over the rest of the
# package, which reads nothing of the sparse-gradient machinery for a
# constant or a formatter.
WING = (
  "_ids",
  "_inputs",
  "_plan",
  "_pooled",
  "_admission",
  "_stack",
  "_publish",
  "_vocab",
  "_placement",
  "_fresh_rows",
  "_open_vocab",
)


def test_no_module_of_the_wing_imports_autodiff():
  assert all(m in MODULES for m in WING), sorted(set(WING) - set(MODULES))
  bad = [
    use for use in USES if use.module in WING and use.target == "_autodiff"
  ]
  assert not bad, (
    "the table stack family imports gradtx/_autodiff.py (move what it needs "
    "down to a module both can import): " + "; ".join(map(repr, bad))
  )


# The facade stays thin (issue 62): each TableStack method checks its
# arguments and calls one module below it.
MAX_FACADE_LINES = {"_stack": 600, "TableStack": 400}


def test_the_stack_facade_stays_thin():
  tree = MODULES["_stack"]
  lines = {"_stack": len((PACKAGE / "_stack.py").read_text().splitlines())}
  for node in tree.body:
    if isinstance(node, ast.ClassDef) and node.name in MAX_FACADE_LINES:
      lines[node.name] = node.end_lineno - node.lineno + 1
  assert set(lines) == set(MAX_FACADE_LINES), lines
  long = {k: n for k, n in lines.items() if n >= MAX_FACADE_LINES[k]}
  assert not long, (
    f"the table stack's facade grew past {MAX_FACADE_LINES}: {long}; move "
    "the work into the module of its job (docs/contributing.md's map)"
  )
