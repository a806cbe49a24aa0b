"""`builtin:python_docs`: real English text present on every machine that has Python.

The quickstart must run on a fresh machine without downloads, so its default corpus is text
that ships with the interpreter itself and that nobody on this project wrote:

* `pydoc_data.topics.topics`: the topics of the Python Language Reference (`help("for")`),
  one document per topic, ids `topic:NAME`;
* the docstrings of the standard library's `.py` files, read with `ast` (the modules are
  never imported, so no side effects), one document per module, ids `stdlib:PACKAGE.MODULE`:
  the module docstring followed by the docstrings of its classes and functions, each headed
  by its qualified name.

Tests and private `test.*` packages are skipped; modules with less than `MIN_DOCSTRING_CHARS`
of docstrings are dropped. The order is deterministic. About 2.3 MB of text (490 documents on Python 3.11).
"""
import ast
import os
import sysconfig
from typing import Iterator, List

from pydoc_data import topics

from private_t5.documents import Document
from private_t5.errors import DataError

MIN_DOCSTRING_CHARS = 200
_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__",
                        "lib2to3", "turtledemo", "ensurepip"})
BUILTIN_CORPORA = ("python_docs",)


def _stdlib_dir() -> str:
  return sysconfig.get_paths()["stdlib"]


def _module_name(root: str, path: str) -> str:
  rel = os.path.relpath(path, root)[:-len(".py")].replace(os.sep, ".")
  return rel[:-len(".__init__")] if rel.endswith(".__init__") else rel


def _stdlib_files(root: str) -> List[str]:
  files = []
  for dirpath, dirs, names in os.walk(root):
    dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith(("test", ".")))
    files.extend(os.path.join(dirpath, n) for n in sorted(names)
                 if n.endswith(".py") and not n.startswith("test_"))
  return files


def _definition_docstrings(body, prefix: str) -> Iterator[str]:
  """`name:\ndocstring` for every documented class/function, depth first, in source order."""
  for node in body:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      name = f"{prefix}{node.name}"
      doc = ast.get_docstring(node, clean=True)
      if doc:
        yield f"{name}:\n{doc}"
      if isinstance(node, ast.ClassDef):
        yield from _definition_docstrings(node.body, f"{name}.")


def _module_docstrings(path: str):
  """The module docstring then its definitions' docstrings, or None when unreadable."""
  try:
    with open(path, "rb") as f:
      source = f.read()
    tree = ast.parse(source, filename=path)
  except (SyntaxError, ValueError, OSError, UnicodeDecodeError):
    return None  # a few stdlib files are deliberately invalid (e.g. bad-coding test data)
  parts = [ast.get_docstring(tree, clean=True) or ""]
  parts.extend(_definition_docstrings(tree.body, ""))
  return "\n\n".join(p for p in parts if p).strip()


def iter_python_docs() -> Iterator[Document]:
  """Yields the Python reference topics, then the stdlib module docstrings."""
  for name in sorted(topics.topics):
    yield Document(id=f"topic:{name}", text=topics.topics[name])
  root = _stdlib_dir()
  for path in _stdlib_files(root):
    doc = _module_docstrings(path)
    if doc and len(doc) >= MIN_DOCSTRING_CHARS:
      yield Document(id=f"stdlib:{_module_name(root, path)}", text=doc)


def iter_builtin(name: str) -> Iterator[Document]:
  """The documents of builtin corpus `name` (`builtin:NAME`)."""
  if name == "python_docs":
    return iter_python_docs()
  raise DataError(f"unknown builtin corpus {name!r} (available: {', '.join(BUILTIN_CORPORA)})")
