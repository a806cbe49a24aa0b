"""private_t5.lazy_imports: a library named at a module's top is imported on first use, once;
a missing one is one line naming what needed it (a ConfigError that is also an ImportError)."""
import sys

import pytest

from private_t5.errors import ConfigError
from private_t5.lazy_imports import MissingLibrary, import_now, installed, lazy_module


@pytest.fixture
def fake_library(tmp_path, monkeypatch):
  (tmp_path / "pt5_fake_lib.py").write_text("LOADS = []\nLOADS.append(1)\nVALUE = 42\ndef load(name):\n  return name\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.delitem(sys.modules, "pt5_fake_lib", raising=False)
  yield "pt5_fake_lib"
  sys.modules.pop("pt5_fake_lib", None)


def test_imported_on_first_attribute_read_and_only_once(fake_library):
  calls = []
  lib = lazy_module(fake_library, before=lambda: calls.append("before"))
  assert fake_library not in sys.modules and "not imported yet" in repr(lib)
  assert installed(lib)
  assert lib.VALUE == 42 and lib.VALUE == 42
  assert fake_library in sys.modules and import_now(lib) is sys.modules[fake_library]
  assert lib.LOADS == [1] and calls == ["before"]
  assert lib.load("en") == "en"  # the library's own names are never hidden by the stand-in's
  lib.VALUE = 7  # writes go to the module itself
  assert sys.modules[fake_library].VALUE == 7 and "imported" in repr(lib)


def test_missing_library_is_one_line_config_and_import_error():
  lib = lazy_module("pt5_no_such_library", needed_for="a Beam runner", install="apache-beam, or --runner=local")
  assert not installed(lib)
  with pytest.raises(MissingLibrary) as e:
    lib.Pipeline  # pylint: disable=pointless-statement
  assert isinstance(e.value, ConfigError) and isinstance(e.value, ImportError)
  message = str(e.value)
  assert "\n" not in message
  assert message.startswith("a Beam runner needs pt5_no_such_library, which is not importable")
  assert message.endswith("; install apache-beam, or --runner=local")


def test_missing_submodule_of_missing_package_is_not_available():
  assert not installed(lazy_module("pt5_no_such_library.sub.module"))
