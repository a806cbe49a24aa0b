"""The package's layers import only downwards, with no cycles (docs/architecture.md).

Reads every module's imports (top-level and inside functions) from its source, so the test
needs no heavy imports and fails on the line that breaks a rule. The folder is the layer:

  base (the package's top-level modules: errors, io, documents, ...)   rank 0
  models/                                                               rank 1
  data/ (corpora, stores, Tasks, Beam)                                  rank 2
  dp/ (the privacy layer: accounting, ledger, mechanisms)               rank 3
  tokenizer/ (SentencePiece, DP-SentencePiece)                          rank 4
  train/, eval/, selective/                                             rank 5
  experiments/ (the end-to-end study, the benchmark)                    rank 6
  stages/ (every command, the CLI, flags, the Gin registry)             rank 7

A module may import modules of its own rank or below, never above; no import cycle between
modules; no private name (`_x`) imported from another module; gin, argparse and the flag
helpers only in stages/, and nothing outside stages/ imports it; `dp_accounting` only in
`dp/accounting.py`. train/, eval/ and selective/ never import one another (checkpoints are read
and written through models/, `models.checkpoints`); only the two runs of selective DP that
train (`TRAINING_RUNS`) import train/. stages/ is the entry layer: each of its modules holds at
most `STAGE_MODULE_MAX_LINES` lines (its flags, its Gin parsing and the call; libraries live below).
"""
import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "private_t5"
PACKAGE = "private_t5"

# Folder -> layer; the package's top-level modules are the base layer (0).
FOLDER_RANKS = {"models": 1, "data": 2, "dp": 3, "tokenizer": 4, "train": 5, "eval": 5,
                "selective": 5, "experiments": 6, "stages": 7}
STAGES_FOLDER = "stages"
# The most lines a module of stages/ may hold.
STAGE_MODULE_MAX_LINES = 200
# Modules only the stages may import (third-party and standard library).
STAGE_ONLY_IMPORTS = ("gin", "argparse")
# The one module that talks to `dp_accounting`.
ACCOUNTING_MODULE = "private_t5.dp.accounting"
# Folders of the stage libraries: siblings that share the layers below and import no other.
STAGE_FOLDERS = ("train", "eval", "selective")
# The runs of selective DP that call `train.main.train` with their own setup.
TRAINING_RUNS = {"private_t5.selective.jft", "private_t5.selective.adaptive_train"}


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT.parent).with_suffix("").parts
  if parts[-1] == "__init__":
    parts = parts[:-1]
  return ".".join(parts)


def _modules():
  return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


MODULES = _modules()


def folder(module: str):
  """The layer folder of a module (`models`, `train`, `stages`, ...), None for the base layer."""
  parts = module.split(".")
  if len(parts) > 2 or (len(parts) == 2 and (ROOT / parts[1]).is_dir()):
    return parts[1]
  return None


def rank(module: str) -> int:
  """The layer of a module: its folder's, 0 for the package's top-level modules."""
  name = folder(module)
  return 0 if name is None else FOLDER_RANKS[name]


def crosses_stage_folders(module: str, target: str) -> bool:
  """Whether `module` importing `target` reaches into a stage folder other than its own."""
  if module in TRAINING_RUNS and folder(target) == "train":
    return False
  return folder(module) in STAGE_FOLDERS and folder(target) in STAGE_FOLDERS and folder(target) != folder(module)


def _resolve(module: str, path: pathlib.Path, node: ast.ImportFrom) -> str:
  if not node.level:
    return node.module or ""
  package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
  base = package[:len(package) - node.level + 1]
  return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str):
  """(imported module, imported name or None, line) for every package-internal import."""
  path = MODULES[module]
  out = []
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      out += [(a.name, None, node.lineno) for a in node.names if a.name.split(".")[0] == PACKAGE]
    elif isinstance(node, ast.ImportFrom):
      target = _resolve(module, path, node)
      if target.split(".")[0] != PACKAGE:
        continue
      for alias in node.names:
        sub = f"{target}.{alias.name}"
        if sub in MODULES:  # `from private_t5.dp import accounting`
          out.append((sub, None, node.lineno))
        else:
          out.append((target, alias.name, node.lineno))
  return out


def _graph():
  return {m: sorted({t for t, _, _ in imports_of(m) if t in MODULES and t != m}) for m in MODULES}


def test_every_module_has_a_layer():
  for module in MODULES:
    rank(module)  # KeyError names a folder missing from FOLDER_RANKS


def test_imports_point_down():
  bad = []
  for module in MODULES:
    for target, _, line in imports_of(module):
      if target in MODULES and rank(target) > rank(module):
        bad.append(f"{MODULES[module].relative_to(ROOT.parent)}:{line}: {module} (layer {rank(module)}) "
                   f"imports {target} (layer {rank(target)})")
  assert not bad, "upward imports:\n" + "\n".join(bad)


def test_stage_folders_do_not_import_one_another():
  bad = []
  for module in MODULES:
    for target, _, line in imports_of(module):
      if target in MODULES and crosses_stage_folders(module, target):
        bad.append(f"{MODULES[module].relative_to(ROOT.parent)}:{line}: {module} imports {target}")
  assert not bad, ("imports into another stage folder (checkpoints are read through "
                   "private_t5.models.checkpoints):\n" + "\n".join(bad))


def test_no_import_cycles():
  graph = _graph()
  index, low, on_stack, stack, cycles, counter = {}, {}, set(), [], [], [0]

  def visit(v):  # Tarjan's strongly connected components
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on_stack.add(v)
    for w in graph[v]:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      # A package __init__ re-exporting its own submodules is not a cycle of concepts.
      real = [m for m in component if MODULES[m].name != "__init__.py"]
      if len(real) > 1:
        cycles.append(sorted(real))

  for v in graph:
    if v not in index:
      visit(v)
  assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_no_private_names_across_modules():
  bad = []
  for module in MODULES:
    for target, name, line in imports_of(module):
      if name and name.startswith("_") and target != module:
        bad.append(f"{MODULES[module].relative_to(ROOT.parent)}:{line}: imports {target}.{name}")
  assert not bad, "private names imported across modules:\n" + "\n".join(bad)


def _imported_names(path: pathlib.Path):
  """(absolute module name, line) of every import statement of `path`, in function bodies too."""
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      yield from ((a.name, node.lineno) for a in node.names)
    elif isinstance(node, ast.ImportFrom) and not node.level:
      yield node.module or "", node.lineno


def test_gin_and_argparse_only_in_stages():
  bad = []
  for module, path in MODULES.items():
    if folder(module) == STAGES_FOLDER:
      continue
    for name, line in _imported_names(path):
      if name.split(".")[0] in STAGE_ONLY_IMPORTS:
        bad.append(f"{path.relative_to(ROOT.parent)}:{line}: {name}")
  assert not bad, "gin or argparse imported outside private_t5/stages: " + ", ".join(bad)


def test_nothing_imports_stages():
  bad = []
  for module in MODULES:
    if folder(module) == STAGES_FOLDER:
      continue
    for target, _, line in imports_of(module):
      if folder(target) == STAGES_FOLDER:
        bad.append(f"{MODULES[module].relative_to(ROOT.parent)}:{line}: {module} imports {target}")
  assert not bad, "private_t5/stages is the top layer; nothing below imports it:\n" + "\n".join(bad)


def test_dp_accounting_only_in_dp_accounting_module():
  bad = []
  for module, path in MODULES.items():
    if module == ACCOUNTING_MODULE:
      continue
    for name, line in _imported_names(path):
      if name == "dp_accounting" or name.startswith("dp_accounting."):
        bad.append(f"{path.relative_to(ROOT.parent)}:{line}")
  assert not bad, f"dp_accounting imported outside {ACCOUNTING_MODULE}: " + ", ".join(bad)


def test_stage_modules_are_small():
  long = [f"{path.relative_to(ROOT.parent)}: {n} lines" for module, path in MODULES.items()
          if folder(module) == STAGES_FOLDER and (n := len(path.read_text().splitlines())) > STAGE_MODULE_MAX_LINES]
  assert not long, (f"stages/ modules over {STAGE_MODULE_MAX_LINES} lines (move their library code below "
                    "stages/):\n" + "\n".join(long))


@pytest.mark.parametrize("module,importer,expected", [
    ("private_t5.errors", "private_t5.models.config", True),
    ("private_t5.train.loop", "private_t5.data.glue_tasks", False),
    ("private_t5.models.checkpoints", "private_t5.eval.memorization", True),
    ("private_t5.stages.gin_utils", "private_t5.train.main", False),
    ("private_t5.train.main", "private_t5.stages.train", True),
    ("private_t5.train.main", "private_t5.experiments.study", True),
    ("private_t5.experiments.benchmark", "private_t5.stages.bench", True),
    ("private_t5.stages.gin_utils", "private_t5.experiments.study", False),
])
def test_rank_rule_itself(module, importer, expected):
  assert (rank(module) <= rank(importer)) is expected


@pytest.mark.parametrize("module,target,expected", [
    ("private_t5.eval.glue_eval", "private_t5.train.loop", True),
    ("private_t5.eval.memorization_run", "private_t5.train.main", True),
    ("private_t5.selective.adaptive", "private_t5.train.main", True),
    ("private_t5.eval.report", "private_t5.selective.adaptive", True),
    ("private_t5.selective.jft", "private_t5.train.main", False),
    ("private_t5.train.main", "private_t5.models.checkpoints", False),
    ("private_t5.stages.bench", "private_t5.train.trainer", False),
    ("private_t5.stages.study", "private_t5.eval.memorization_run", False),
    ("private_t5.stages.jft", "private_t5.train.main", False),
])
def test_stage_folder_rule_itself(module, target, expected):
  assert crosses_stage_folders(module, target) is expected


# The most imports inside function bodies outside stages/: every other import sits at the top of
# its module, heavy optional libraries included (named there through `lazy_imports.lazy_module`).
MAX_FUNCTION_BODY_IMPORTS = 15


def function_body_imports(path: pathlib.Path):
  """(line, source line) of every import statement inside a function of `path`."""
  source = path.read_text()
  lines = source.splitlines()
  found = set()
  for node in ast.walk(ast.parse(source, str(path))):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      for sub in ast.walk(node):
        if isinstance(sub, (ast.Import, ast.ImportFrom)):
          found.add((sub.lineno, lines[sub.lineno - 1].strip()))
  return sorted(found)


def _reason(line: str) -> str:
  """The comment of a source line, pylint directives left out."""
  return re.sub(r"pylint:[^#]*", "", line.partition("#")[2]).replace("#", "").strip()


def test_imports_at_the_top():
  inside = [(f"{path.relative_to(ROOT.parent)}:{line}", text) for module, path in MODULES.items()
            if folder(module) != STAGES_FOLDER for line, text in function_body_imports(path)]
  listing = "\n".join(f"{where}: {text}" for where, text in inside)
  assert len(inside) <= MAX_FUNCTION_BODY_IMPORTS, (
      f"{len(inside)} imports inside function bodies outside stages/ (at most {MAX_FUNCTION_BODY_IMPORTS}): move "
      f"them to the module's top, or name a heavy optional library with lazy_imports.lazy_module:\n{listing}")
  own = [f"{where}: {text}" for where, text in inside if f" {PACKAGE}" in text or text.startswith("from .")]
  assert not own, "the package imported inside a function (a cycle can hide there):\n" + "\n".join(own)
  unexplained = [f"{where}: {text}" for where, text in inside if not _reason(text)]
  assert not unexplained, "an import inside a function needs its reason beside it (a comment):\n" + "\n".join(unexplained)


def test_function_body_import_finder_itself(tmp_path):
  path = tmp_path / "m.py"
  path.write_text("import os\n\ndef f():\n  import json  # why\n  def g():\n    from x import y  # pylint: disable=a\n  return json\n")
  assert function_body_imports(path) == [(4, "import json  # why"), (6, "from x import y  # pylint: disable=a")]
  assert _reason("import json  # why") == "why"
  assert _reason("from x import y  # pylint: disable=a") == ""
  assert _reason("import tensorflow  # pylint: disable=g-import-not-at-top  # this module is its importer") == (
      "this module is its importer")


def _defined_names(module: str) -> set:
  """The names a module binds itself at its top level (functions, classes, assignments, also
  under a top-level `if` or `try`), not the names it imports."""
  tree = ast.parse(MODULES[module].read_text())
  names = set()
  for node in ast.walk(tree):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node in _top(tree):
      names.add(node.name)
    elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and node in _top(tree):
      targets = node.targets if isinstance(node, ast.Assign) else [node.target]
      names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
  return names


def _top(tree) -> list:
  """The statements of a module's top level, those under top-level `if`/`try` blocks included."""
  out, todo = [], list(tree.body)
  while todo:
    node = todo.pop()
    out.append(node)
    if isinstance(node, (ast.If, ast.Try)):
      todo += node.body + node.orelse + getattr(node, "handlers", []) + getattr(node, "finalbody", [])
    elif isinstance(node, ast.ExceptHandler):
      todo += node.body
  return out


REPO = ROOT.parent
IN_REPO_FOLDERS = ("private_t5", "tests", "benchmarks", "scripts")


def _internal_imports(module: str) -> set:
  """The names a module binds by importing them from the package (at any level)."""
  names = set()
  for node in ast.walk(ast.parse(MODULES[module].read_text())):
    if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == PACKAGE:
      names |= {a.asname or a.name for a in node.names}
    elif isinstance(node, ast.Import):
      names |= {a.asname for a in node.names if a.asname and a.name.split(".")[0] == PACKAGE}
  return names


def test_every_name_is_imported_from_the_module_that_defines_it():
  """One address per name: an in-repo import of a package name (`from M import name`, or `M.name`
  through a module alias) reads it from the module that binds it, not through a module that imported
  it (a re-export) or keeps it for old callers (`private_t5.moved_names`)."""
  defined = {m: _defined_names(m) for m in MODULES}
  internal = {m: _internal_imports(m) for m in MODULES}
  bad = []
  for folder_name in IN_REPO_FOLDERS:
    for path in sorted((REPO / folder_name).rglob("*.py")):
      if ".venv" in path.parts:
        continue
      tree = ast.parse(path.read_text(), str(path))
      aliases = {}
      for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
          for a in node.names:
            if f"{node.module}.{a.name}" in MODULES:
              aliases[a.asname or a.name] = f"{node.module}.{a.name}"
            elif node.module in MODULES and a.name != "*" and a.name not in defined[node.module]:
              bad.append(f"{path.relative_to(REPO)}:{node.lineno}: {a.name} from {node.module}")
        elif isinstance(node, ast.Import):
          aliases.update({a.asname: a.name for a in node.names if a.asname and a.name in MODULES})
      rebound = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
      rebound |= {a.arg for n in ast.walk(tree) if isinstance(n, ast.arguments)
                  for a in n.args + n.kwonlyargs + n.posonlyargs}
      for name in rebound:
        aliases.pop(name, None)  # a local variable of the same name, not the module
      for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
          module = aliases[node.value.id]
          if node.attr in internal[module] and node.attr not in defined[module] \
              and f"{module}.{node.attr}" not in MODULES:
            bad.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value.id}.{node.attr} ({module})")
  assert not bad, "names read through a module that does not define them:\n" + "\n".join(sorted(set(bad)))
