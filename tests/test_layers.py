"""The layers contract (`.importlinter`): no package of `areal_jax` imports one above it, checked by import-linter."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_no_package_imports_a_layer_above_it():
  lint = pathlib.Path(sys.executable).with_name("lint-imports")  # import-linter's command, beside this interpreter
  done = subprocess.run([str(lint), "--config", str(ROOT / ".importlinter"), "--no-cache"], cwd=ROOT,
                        capture_output=True, text=True, timeout=120, check=False)
  assert done.returncode == 0, done.stdout + done.stderr
