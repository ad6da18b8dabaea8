"""Every `python launch/...` and `python tools/...` command shown in the README and the docs still parses: its flags
are the script's own (absl or argparse) and, for a script with a `--config`, the config loads with its overrides and
passes `config.validate` (`data=False` for the AOT check and the planner, which read no dataset). Each command runs
in a child process (forked from one that imported JAX and the config once) that stops once its arguments are parsed;
the runs themselves are covered by the whole-run tests (`tests/rl/test_trainer.py`, `tests/test_faults.py`,
`tests/tools/`)."""

import glob
import multiprocessing
import os
import re
import shlex
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]
SCRIPTS = ("launch/", "tools/")
# keyword arguments of `config.validate` per script: the AOT check and the planner read no dataset
VALIDATE = {"tools/aot_check.py": {"data": False}, "tools/plan.py": {"data": False}}

# Imported once by the fork server that each command's child process is forked from (most of a command's cost).
PRELOAD = ["numpy", "jax", "flax.nnx", "optax", "absl.app", "absl.flags", "ml_collections.config_flags",
           "areal_jax.config"]


class _Parsed(BaseException):
  pass


def parse_only(script: str, args: list[str], validate_kw: dict) -> str:
  """In a fresh child process: runs SCRIPT as __main__ with `args`, stopped right after they are parsed (absl's
  `app.run` and argparse's `parse_args` are replaced here alone), then validates the parsed `--config`, if any.
  Returns "ok", or why the script rejected them (its last line on stderr, or the exception)."""
  import argparse, contextlib, io, runpy  # pylint: disable=g-import-not-at-top,multiple-imports
  from absl import app, flags  # pylint: disable=g-import-not-at-top

  def parse_flags(main, argv=None, flags_parser=None, **unused):
    (flags_parser or flags.FLAGS)(sys.argv)
    raise _Parsed()

  def parse_args(self, *a, parse=argparse.ArgumentParser.parse_args, **k):
    parse(self, *a, **k)
    raise _Parsed()

  os.chdir(ROOT)  # as `python SCRIPT ...` from the repository's root
  sys.path.insert(0, ROOT)
  app.run, argparse.ArgumentParser.parse_args = parse_flags, parse_args
  sys.argv = [script, *args]  # ml_collections registers --config.* overrides from sys.argv
  err = io.StringIO()
  try:
    with contextlib.redirect_stderr(err):
      try:
        runpy.run_path(script, run_name="__main__")
      except _Parsed:
        pass
      else:
        return "the script ended without parsing its arguments"
      if "config" in flags.FLAGS:
        from areal_jax.config import validate  # pylint: disable=g-import-not-at-top
        validate(flags.FLAGS["config"].value, **validate_kw)
  except SystemExit as e:  # argparse's error after its message; absl's with its message
    return (err.getvalue().strip().splitlines() or [e.code if isinstance(e.code, str) else f"exit status {e.code}"])[-1]
  except Exception as e:  # pylint: disable=broad-except
    return f"{type(e).__name__}: {e}"
  return "ok"


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


def test_the_recipe_shows_every_step_of_a_real_run():
  """docs/recipes.md: data prepared, a run on one TPU VM (v5p-8, v6e-8) and one 8-GPU host, each from a checkpoint
  and its tokenizer, then evaluation with pass@k, serving and export (each command parsed and validated below)."""
  shown = [shlex.split(c) for where, c in documented_commands() if where == os.path.join("docs", "recipes.md")]
  scripts = [words[1] for words in shown]
  assert {"tools/prepare_data.py", "tools/aot_check.py", "launch/local.py", "tools/evaluate.py", "tools/serve.py",
          "tools/convert_hf.py"} <= set(scripts) and scripts.count("launch/tpu_run.py") == 2, scripts
  for words in shown:
    if words[1].startswith("launch/"):
      assert any(w.startswith("--config.model.init_from=") for w in words), words
      assert any(w.startswith("--config.model.tokenizer=") for w in words), words
  assert any(w.startswith("--pass_k=") for words in shown if words[1] == "tools/evaluate.py" for w in words)


@pytest.mark.slow
def test_every_documented_command_parses_and_its_config_validates():
  shown = {}  # (script, args) -> where it is shown
  for where, command in documented_commands():
    words = shlex.split(command)
    assert os.path.exists(os.path.join(ROOT, words[1])), f"{where}: {words[1]} does not exist"
    shown.setdefault((words[1], tuple(words[2:])), f"{where}: {command}")
  # Each command in its own process (a script's flags are global), forked from a server that imported PRELOAD once.
  ctx = multiprocessing.get_context("forkserver")
  ctx.set_forkserver_preload(PRELOAD)
  with ctx.Pool(2, maxtasksperchild=1) as pool:
    # A bounded wait: a script that hangs, or a child that dies mid-task (a pool never hears of it), fails the test.
    results = pool.starmap_async(parse_only, [(script, list(args), VALIDATE.get(script, {}))
                                              for script, args in shown], chunksize=1).get(timeout=600)
  failures = [f"{where}\n  -> {r}" for where, r in zip(shown.values(), results) if r != "ok"]
  assert not failures, "\n".join(failures)
