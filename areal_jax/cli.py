"""Flags and signals of the launchers and tools (does not import JAX): a mistyped `--config.` key ends in one line,
not a traceback (ml_collections raises a raw AttributeError for it); SIGTERM / SIGINT stop a run cleanly.

    _CONFIG = cli.define_config()
    ...
    app.run(main, flags_parser=cli.parse_flags)
"""

from __future__ import annotations

import signal
import sys

from absl import app, flags
from ml_collections import config_flags

from areal_jax.errors import ConfigError


def define_config(default: str = "configs/math.py"):
  """`--config=FILE[:PRESET]` and its `--config.KEY=VALUE` overrides (applied here already for the default file)."""
  try:
    return config_flags.DEFINE_config_file("config", default, "Config file[:preset].", lock_config=True)
  except (AttributeError, KeyError) as e:
    _unknown_key(e, sys.argv)


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing for `app.run(flags_parser=...)`: errors, an unknown config key too, in one line."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    sys.exit(f"FATAL Flags parsing error: {e}\nPass --helpshort or --helpfull to see help on flags.")
  except (AttributeError, KeyError) as e:
    _unknown_key(e, argv)


def run(main) -> None:
  """`app.run` for the tools: flag and config errors (`errors.ConfigError`) end in one line, as the run's do."""
  def main_with_config_errors(argv):
    try:
      return main(argv)
    except ConfigError as e:
      sys.exit(f"FATAL config error: {e}")

  app.run(main_with_config_errors, flags_parser=parse_flags)


def _unknown_key(e: BaseException, argv: list[str]):
  while e.args and isinstance(e.args[0], BaseException):  # the KeyError inside ml_collections' AttributeError
    e = e.args[0]
  key, _, hint = str(e.args[0] if e.args else e).partition("\n")  # "'lrr'\nDid you mean "lr" instead of "lrr"?"
  key = key.strip("'\"")
  named = [a.split("=")[0] for a in argv[1:] if a.startswith("--config.") and key in a.split("=")[0].split(".")]
  hint = f"; {hint[:1].lower()}{hint[1:]}" if hint else ""
  sys.exit(f"FATAL Flags parsing error: {named[0] if named else '--config'}: the config has no field {key!r}{hint}")


class Stopped(BaseException):
  """SIGTERM or SIGINT arrived: raised in the main thread, so every `finally` runs (not an `Exception`, so handlers
  of errors do not take it for one)."""

  def __init__(self, signum: int):
    super().__init__(f"received {signal.Signals(signum).name}")
    self.signum = signum


def stop_on_signals() -> None:
  """The first SIGTERM or SIGINT raises `Stopped` in the main thread; a second one ends the process at once."""
  def stop(signum, _frame):
    for s in (signal.SIGTERM, signal.SIGINT):
      signal.signal(s, signal.SIG_DFL)
    raise Stopped(signum)

  for s in (signal.SIGTERM, signal.SIGINT):
    signal.signal(s, stop)
  sys.unraisablehook = _keep_swallowed_stop


_swallowed: Stopped | None = None  # a stop raised where Python could not propagate it


def _keep_swallowed_stop(info) -> None:
  """A signal that lands in code whose exceptions Python drops (a garbage-collection callback, a `__del__`) loses
  its `Stopped`: kept for `check_stopped` instead of printed as an ignored traceback."""
  global _swallowed
  if isinstance(info.exc_value, Stopped):
    _swallowed = info.exc_value
  else:
    sys.__unraisablehook__(info)


def check_stopped() -> None:
  """Raises the `Stopped` a signal raised where it could not propagate (see `_keep_swallowed_stop`), if any; loops
  that wait in the main thread call it."""
  if _swallowed is not None:
    raise _swallowed
