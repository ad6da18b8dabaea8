"""Every `python launch/...` and `python tools/...` command shown in the README and the docs still parses: its flags
are the script's own (absl or argparse) and, for a script with a `--config`, the config loads with its overrides and
passes `config.validate` (`data=False` for the AOT check and the planner, which read no dataset). Each command runs
in a child process that stops once its arguments are parsed; the runs themselves are covered by the whole-run tests
(`tests/rl/test_trainer.py`, `tests/test_faults.py`, `tests/tools/`)."""

import concurrent.futures
import glob
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]
SCRIPTS = ("launch/", "tools/")
# keyword arguments of `config.validate` per script: the AOT check and the planner read no dataset
VALIDATE = {"tools/aot_check.py": {"data": False}, "tools/plan.py": {"data": False}}

# Runs SCRIPT as __main__ with the documented arguments, stopped right after they are parsed (absl's `app.run` and
# argparse's `parse_args` are replaced in this child process alone), then validates the parsed `--config`, if any.
_PARSE = """
import argparse, json, runpy, sys
from absl import app, flags
path, args, validate_kw = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])

class Parsed(BaseException):
  pass

def parse_only(main, argv=None, flags_parser=None, **unused):
  (flags_parser or flags.FLAGS)(sys.argv)
  raise Parsed()

def parse_args_only(self, *a, parse=argparse.ArgumentParser.parse_args, **k):
  parse(self, *a, **k)
  raise Parsed()

app.run, argparse.ArgumentParser.parse_args = parse_only, parse_args_only
sys.argv = [path, *args]  # ml_collections registers --config.* overrides from sys.argv
try:
  runpy.run_path(path, run_name="__main__")
except Parsed:
  pass
else:
  sys.exit("the script ended without parsing its arguments")
if "config" in flags.FLAGS:
  from areal_jax.config import validate
  validate(flags.FLAGS["config"].value, **validate_kw)
print("PARSED")
"""


def documented_commands() -> list[tuple[str, str]]:
  """(file, command) for each `python launch/...` or `python tools/...` command in a fenced code block."""
  out = []
  for path in DOCS:
    with open(path) as f:
      text = f.read()
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
      for line in block.replace("\\\n", " ").splitlines():
        line = line.split(" # ")[0].strip()
        for part in line.split("&&"):
          words = part.split()
          if len(words) > 1 and words[0] in ("python", "python3") and words[1].startswith(SCRIPTS):
            out.append((os.path.relpath(path, ROOT), part.strip()))
  return out


def test_the_docs_show_commands_of_the_run_and_the_tools():
  scripts = {shlex.split(c)[1] for _, c in documented_commands()}
  assert {"launch/tpu_run.py", "launch/local.py", "tools/aot_check.py", "tools/chaos.py"} <= scripts, scripts


def _parse(script: str, args: list[str]) -> str:
  """"ok", or why the script rejected `args`."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  proc = subprocess.run([sys.executable, "-c", _PARSE, script, json.dumps(args), json.dumps(VALIDATE.get(script, {}))],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  if proc.returncode == 0 and "PARSED" in proc.stdout:
    return "ok"
  return (proc.stderr.strip().splitlines() or ["exit status %d" % proc.returncode])[-1]


@pytest.mark.slow
def test_every_documented_command_parses_and_its_config_validates():
  shown = {}  # (script, args) -> where it is shown
  for where, command in documented_commands():
    words = shlex.split(command)
    assert os.path.exists(os.path.join(ROOT, words[1])), f"{where}: {words[1]} does not exist"
    shown.setdefault((words[1], tuple(words[2:])), f"{where}: {command}")
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    results = list(pool.map(lambda key: _parse(key[0], list(key[1])), shown))
  failures = [f"{where}\n  -> {r}" for where, r in zip(shown.values(), results) if r != "ok"]
  assert not failures, "\n".join(failures)
