"""Gin's errors in one line: the syntax of a file or a binding, and the project's errors Gin wrapped."""
import io
import re
import tokenize
from typing import Optional, Sequence

import gin
from gin import config_parser

from private_t5 import errors
from private_t5.errors import ConfigError

def _syntax_error(text: str, filename: Optional[str] = None) -> Optional[str]:
  """Gin's syntax error in `text` as "message (line N)", or None; binds nothing."""
  stream = io.StringIO(text)
  if filename:
    stream.name = filename
  try:
    for _ in config_parser.ConfigParser(stream, gin.config.ParserDelegate(skip_unknown=True)):
      pass
  except tokenize.TokenError as e:  # an unclosed bracket or quote: Gin lets the tokenizer's error through
    bracket = _unclosed_bracket(text)
    if bracket:
      return f"{bracket[0]!r}" + (f" opened on line {bracket[1]}" if filename else "") + " is not closed"
    return f"unclosed bracket or quote ({e.args[0]})" + (" at the end of the file" if filename else "")
  except SyntaxError as e:
    return describe_syntax_error(e, text if filename else None)
  return None


# ast.literal_eval's message for a bare word where Gin expects a value, as Gin passes it on.
_NOT_A_VALUE = re.compile(r"malformed node or string.*Failed to parse token '(.*)'", re.DOTALL)


def describe_syntax_error(e: SyntaxError, text: Optional[str] = None) -> str:
  """A Gin SyntaxError in words, for one line.

  In a file (`text`: its content, "" when unknown): "message (line N)", or "'[' opened on line M
  is not closed (line N: message)" when a bracket left open earlier is the cause. In a binding
  (`text` None): the message alone.
  """
  message = (e.msg or "invalid syntax").strip()
  word = _NOT_A_VALUE.match(message)
  bracket = _unclosed_bracket(text, (e.lineno, e.offset or 0)) if e.lineno and text is not None else None
  if bracket and bracket[1] < e.lineno:
    found = f"unexpected {word.group(1)!r}" if word else message.splitlines()[0].rstrip(".")
    return f"{bracket[0]!r} opened on line {bracket[1]} is not closed (line {e.lineno}: {found})"
  if word:
    message = (f"{word.group(1)!r} is not a value: quote a string, write @name for a configurable "
               "or %NAME for a macro")
  else:
    message = message.splitlines()[0].rstrip(".")
  return f"{message} (line {e.lineno})" if e.lineno and text is not None else message


def _unclosed_bracket(text: str, before: Optional[tuple] = None) -> Optional[tuple]:
  """(bracket, line) of the innermost bracket of `text` still open at position `before`
  ((line, column); default: the end), or None."""
  stack = []
  try:
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
      if before and token.start >= before:
        break
      if token.type == tokenize.OP and token.string in "([{":
        stack.append((token.string, token.start[0]))
      elif token.type == tokenize.OP and token.string in ")]}" and stack:
        stack.pop()
  except (tokenize.TokenError, SyntaxError):  # the end of a file with an open bracket, or worse
    pass
  return stack[-1] if stack else None


def check_syntax(files: Sequence[str], bindings: Sequence[str]) -> None:
  """Parses each file and each binding alone (syntax only); the error names it, in one line."""
  for path in files:
    with open(path, encoding="utf-8") as f:
      error = _syntax_error(f.read(), path)
    if error:
      raise ConfigError(f"invalid Gin syntax in {path}: {error}")
  for binding in bindings:
    error = _syntax_error(binding)
    if error:
      flag = getattr(binding, "flag", "") or binding
      raise ConfigError(f"invalid Gin binding {binding!r} (from {flag}): {error}")


def first_line(e: Exception) -> str:
  text = str(e).strip()
  return text.splitlines()[0] if text else type(e).__name__


_GIN_CONTEXT = "In call to configurable"


def error_message(e: BaseException) -> str:
  """`e`'s message without the "In call to configurable ..." lines Gin appends."""
  lines = [l for l in str(e).splitlines() if not l.strip().startswith(_GIN_CONTEXT)]
  return "\n".join(lines).strip()


def _is_gin_proxy(cls: type) -> bool:
  """Whether `cls` is the subclass Gin makes to add its context to an exception's message."""
  return "__getattr__" in cls.__dict__


def _wrapped_by_gin(e: BaseException) -> BaseException:
  """The exception Gin's proxies stand for (`e` itself when it is none). Gin raises its proxy
  while it handles the exception it wraps, so that exception is the proxy's `__context__` (one
  proxy per configurable the error went through)."""
  while _is_gin_proxy(type(e)) and type(e.__context__) is type(e).__base__:
    e = e.__context__
  return e


def unwrap_error(e: errors.PrivateT5Error) -> errors.PrivateT5Error:
  """The project's error that Gin wrapped: its own class (not Gin's proxy subclass), its message
  without Gin's context, and its attributes (a copy made without calling its `__init__`, so error
  classes with arguments of their own, such as `DamagedStoreError(path, reason)`, come through)."""
  cls = next(c for c in type(e).__mro__
             if issubclass(c, errors.PrivateT5Error) and not _is_gin_proxy(c)
             and not c.__module__.startswith("gin"))
  if cls is type(e) and _GIN_CONTEXT not in str(e):
    return e
  return errors.with_message(_wrapped_by_gin(e), error_message(e), cls)
