"""The seqio Task or Mixture a run names, looked up and checked.

seqio itself (imported on first use, with TensorFlow's start-up lines silenced), the user's modules
that register the Tasks (`import_task_modules`), the Task or Mixture by name
(`get_mixture_or_task`), a Mixture's rates (`check_rates`, `zero_rate_tasks`, `fixed_rates`,
`sampled_tasks`) and the one vocabulary every task tokenizes with (`check_vocabularies`,
`seqio_vocab_path`); the rules are in `seqio_source`'s docstring. An error raised by the user's code
is put on one line (`error_line`).
"""
import re
from typing import Dict, Optional, Sequence, Set, Union

from private_t5 import checks, quiet_tf, user_modules
from private_t5.errors import ConfigError
from private_t5.io import file_sha256
from private_t5.lazy_imports import import_now, lazy_module

# Imported on first use (with TensorFlow's start-up lines silenced): the rest of the package runs without seqio.
seqio = lazy_module("seqio", needed_for="a seqio Task", install="with pip install 'private_t5[seqio]'",
                    before=quiet_tf.import_tensorflow)


def import_task_modules(module: Union[None, str, Sequence[str]]) -> None:
  """Imports the module(s) that register the Tasks (T5X's MIXTURE_OR_TASK_MODULE)."""
  # The one importer of the user's modules (TASK_MODULE too), with TensorFlow's errors put in one line.
  user_modules.import_modules(module, "MIXTURE_OR_TASK_MODULE",
                              describe=lambda e: first_line(e) if isinstance(e, ImportError) else error_line(e))


def first_line(e: BaseException) -> str:
  """The first non-empty line of `e`'s message, without TensorFlow's `{{function_node ...}}` prefix;
  of an error TensorFlow raised while tracing a function ("in user code:", then a stack), its last
  line: the error itself; of TensorFlow's wrapper of a Python error raised in a function it runs on
  each row, that error ("ValueError: ...")."""
  text = re.sub(r"^\s*\{\{[^}]*\}\}\s*", "", str(getattr(e, "message", None) or e))
  lines = [l.strip() for l in text.splitlines() if l.strip()]
  line = (lines[-1] if lines[0] == "in user code:" else lines[0]) if lines else ""
  inner = re.match(r"Error in user-defined function passed to \S+ transformation with iterator: \S+: (\w+: .*)", line)
  if inner:
    line = inner.group(1)
  return line if len(line) <= 400 else line[:397] + "..."


def error_line(e: BaseException) -> str:
  """`type: first line of message` of an error raised by the user's code, on one line (a
  SyntaxError with its file and line; a Python error TensorFlow wraps: that error's)."""
  if isinstance(e, SyntaxError):
    return f"{type(e).__name__}: {e.msg} ({e.filename}, line {e.lineno})"
  line = first_line(e)
  if not line:
    return type(e).__name__
  if line.startswith(f"{type(e).__name__}: ") or (type(e).__module__.startswith("tensorflow")
                                                  and re.match(r"\w+(Error|Exception): ", line)):
    return line
  return f"{type(e).__name__}: {line}"


def get_mixture_or_task(name: str, module: Union[None, str, Sequence[str]] = None):
  """The registered seqio Task or Mixture `name`, after importing `module`; ConfigError if none."""
  if not isinstance(name, str) or not name:
    raise ConfigError(f"MIXTURE_OR_TASK_NAME must be a non-empty string, got {name!r}")
  import_now(seqio)  # seqio, with TensorFlow's start-up lines silenced, before the user's modules import it
  import_task_modules(module)
  try:
    return seqio.get_mixture_or_task(name)
  except ValueError as e:
    where = f" (after importing {module})" if module else " (set MIXTURE_OR_TASK_MODULE to the module registering it)"
    raise ConfigError(f"no seqio Task or Mixture named {name!r} is registered{where}: "
                      f"{str(e).splitlines()[0]}") from e


def _submixture(mixture, name: str):
  """The sub-mixture `mixture` mixes under `name`, None when `name` is one of its Tasks."""
  sub = getattr(mixture, "_task_map", {}).get(name)
  if isinstance(sub, seqio.Mixture):
    return sub
  if sub is None and name in seqio.MixtureRegistry.names():
    return seqio.get_mixture_or_task(name)
  return None


def check_rates(mixture) -> None:
  """ConfigError (one line) when a rate of `mixture` or of a sub-mixture that is a number is not a
  finite number >= 0, or when every rate of one of them is 0 (seqio samples none of its tasks).
  Rates computed by a function are left to `fixed_rates`."""
  rates = mixture.rate_per_task_name
  for name, rate in rates.items():
    if not callable(rate):
      checks.number(rate, f"seqio Mixture {mixture.name!r}: the rate of {name!r}", minimum=0)
    sub = _submixture(mixture, name)
    if sub is not None:
      check_rates(sub)
  if rates and all(not callable(r) and float(r) == 0 for r in rates.values()):
    raise ConfigError(f"seqio Mixture {mixture.name!r}: every rate is 0 ({', '.join(map(repr, rates))}), so "
                      "seqio samples none of its tasks; give at least one task a rate > 0")


def zero_rate_tasks(mixture) -> Set[str]:
  """Names of the tasks of `mixture` that seqio never samples: every way the mixture reaches them
  (directly or through sub-mixtures) has a rate that is the number 0. A rate computed by a function
  is not evaluated (the task counts as sampled). Call `check_rates` first."""

  def sampled(mix) -> Set[str]:
    names = set()
    for name, rate in mix.rate_per_task_name.items():
      if not callable(rate) and float(rate) == 0:
        continue
      sub = _submixture(mix, name)
      names |= sampled(sub) if sub is not None else {name}
    return names

  return {task.name for task in mixture.tasks} - sampled(mixture)


def fixed_rates(mixture) -> Dict[str, float]:
  """Task name -> mixing rate of each task of `mixture`; ConfigError (one line) when a rate of it or
  of a sub-mixture is a function (computed from the data) rather than a number fixed in advance,
  or a number that is not finite and >= 0 (`check_rates`)."""
  check_rates(mixture)
  for name, rate in mixture.rate_per_task_name.items():
    if callable(rate):
      raise ConfigError(
          f"seqio Mixture {mixture.name!r}: the rate of {name!r} is computed by "
          f"{getattr(rate, '__name__', type(rate).__name__)} (from the data); a DP run needs every rate fixed "
          f"in advance as a number, e.g. ({name!r}, 1.0)")
    sub = _submixture(mixture, name)
    if sub is not None:
      fixed_rates(sub)
  return {task.name: float(mixture.get_rate(task)) for task in mixture.tasks}


def _sentencepiece_file(task, feature: str = "targets") -> Optional[str]:
  """The SentencePiece model file of the Task's `feature` vocabulary, None if it has none."""
  found = task.output_features.get(feature)
  return getattr(getattr(found, "vocabulary", None), "sentencepiece_model_file", None)


def check_vocabularies(tasks: Sequence, vocab_path: Optional[str] = None, what: str = "") -> str:
  """The vocabulary file a run on `tasks` trains with: `vocab_path`, else the first task's.

  Every task must tokenize 'inputs' and 'targets' with that vocabulary (the same file content,
  100 sentinels): the ids of every example then mean the pieces the model is trained on, and the
  one vocabulary whose privacy is composed is the one that made them. ConfigError (one line)
  naming the task and both files if not. `what` names the Task or Mixture in the messages.
  """
  what = what or f"seqio Task {tasks[0].name!r}"
  digests: Dict[str, str] = {}

  def digest(path: str) -> str:
    if path not in digests:
      digests[path] = file_sha256(path)
    return digests[path]

  def sentencepiece_file(task, feature: str) -> str:
    own = _sentencepiece_file(task, feature)
    if own is None:
      raise ConfigError(f"seqio Task {task.name!r} has no SentencePiece vocabulary on its {feature!r} feature; "
                        "private_t5 trains on SentencePiece vocabularies (T5 layout)")
    extra_ids = getattr(task.output_features[feature].vocabulary, "extra_ids", None)
    if extra_ids not in (None, 100):
      raise ConfigError(f"seqio Task {task.name!r}: its {feature!r} vocabulary has {extra_ids} extra ids; "
                        "private_t5 vocabularies have 100 sentinels (T5's layout)")
    return own

  reference = vocab_path
  for task in tasks:
    targets = sentencepiece_file(task, "targets")
    if "inputs" in task.output_features:  # a Task without 'inputs' is refused when its examples are read
      inputs = sentencepiece_file(task, "inputs")
      if digest(inputs) != digest(targets):
        raise ConfigError(f"seqio Task {task.name!r} tokenizes 'inputs' with {inputs} but 'targets' with {targets}; "
                          "both features must use the same SentencePiece vocabulary (the one training uses)")
    if reference is None:
      reference = targets
    if digest(targets) == digest(reference):
      continue
    if vocab_path is not None:
      raise ConfigError(f"VOCAB_PATH {vocab_path} is not the vocabulary seqio Task {task.name!r} tokenizes with "
                        f"({targets}); leave VOCAB_PATH unset to use the Task's")
    raise ConfigError(f"{what}: Task {task.name!r} tokenizes with {targets}, not with {reference}, the vocabulary "
                      f"training uses (that of Task {tasks[0].name!r}); every task must use the same SentencePiece "
                      "vocabulary")
  return reference


def seqio_vocab_path(mixture_or_task_name: str, module: Union[None, str, Sequence[str]] = None,
                     vocab_path: Optional[str] = None) -> str:
  """The vocabulary of a run on a seqio Task or Mixture: `vocab_path`, else the Task's own.

  The Task tokenizes its examples with the vocabulary of its output features: that is the
  vocabulary used (and recorded with the checkpoints). A `vocab_path` given must be the same
  file (by content), as the ids would otherwise mean other pieces; so must the 'inputs' and
  'targets' vocabularies of every task of a Mixture, sub-mixtures included (`check_vocabularies`).
  """
  found = get_mixture_or_task(mixture_or_task_name, module)
  return check_vocabularies(tasks_of(found), vocab_path, label(found))


def tasks_of(found) -> list:
  """The Tasks of a Task (itself) or of a Mixture (sub-mixtures' included)."""
  return list(found.tasks) if isinstance(found, seqio.Mixture) else [found]


def label(found) -> str:
  """The Task or Mixture as the messages name it ("seqio Mixture 'name'")."""
  return f"seqio {'Mixture' if isinstance(found, seqio.Mixture) else 'Task'} {found.name!r}"


def sampled_tasks(found) -> list:
  """The Tasks whose examples are read: a Mixture's without those of rate 0."""
  if not isinstance(found, seqio.Mixture):
    return [found]
  check_rates(found)
  excluded = zero_rate_tasks(found)
  return [t for t in found.tasks if t.name not in excluded]
