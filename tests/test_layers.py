"""The layers contract (`.importlinter`): no package of `areal_jax` imports one above it, checked by import-linter;
no module imports one that imports it back."""

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_no_package_imports_a_layer_above_it():
  lint = pathlib.Path(sys.executable).with_name("lint-imports")  # import-linter's command, beside this interpreter
  done = subprocess.run([str(lint), "--config", str(ROOT / ".importlinter"), "--no-cache"], cwd=ROOT,
                        capture_output=True, text=True, timeout=120, check=False)
  assert done.returncode == 0, done.stdout + done.stderr


def _imports(path: pathlib.Path, module: str, modules: set[str]) -> set[str]:
  """The modules of `modules` that `path` (module `module`) imports, under `TYPE_CHECKING` too."""
  package = module if path.name == "__init__.py" else module.rpartition(".")[0]
  out = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      out |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
      out |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
  return (out & modules) - {module}


def test_no_module_imports_one_that_imports_it_back():
  """No import circle between the modules of `areal_jax` (one under `TYPE_CHECKING` counts: it says the two are one
  piece)."""
  files = {".".join(f.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): f
           for f in (ROOT / "areal_jax").rglob("*.py")}
  graph = {m: _imports(f, m, set(files)) for m, f in files.items()}
  state: dict[str, int] = {}  # 1: on the path being walked, 2: done

  def walk(m: str, path: list[str]) -> None:
    state[m] = 1
    for n in sorted(graph[m]):
      if state.get(n) == 1:
        raise AssertionError("import circle: " + " -> ".join(path[path.index(n):] + [n]))
      if n not in state:
        walk(n, path + [n])
    state[m] = 2

  for m in sorted(graph):
    if m not in state:
      walk(m, [m])
