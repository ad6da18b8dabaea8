"""The README's layout table against the tree, read at test time: every module it names exists, and every module of
every package, `configs/`, `launch/` and `tools/` is named, so the front door cannot drift from the code; and every
test file the README and the docs name exists."""

import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _without_parentheses(text: str) -> str:
  """`text` with every parenthesised part (nested too) removed: descriptions, whose backticks name no module."""
  out, depth = [], 0
  for ch in text:
    depth += ch == "("
    if not depth:
      out.append(ch)
    depth -= ch == ")" and depth > 0
  return "".join(out)


def layout_table(readme: str) -> dict[str, set[str]]:
  """{folder: module names} from the README's `## Layout` table: a row's first cell names folders, its second their
  modules (backticked names outside parentheses; `.py` dropped)."""
  section = readme.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
  table = {}
  for line in section.splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) != 2 or not cells[0].startswith("`"):
      continue
    names = {n.removesuffix(".py") for n in re.findall(r"`([^`]+)`", _without_parentheses(cells[1]))}
    for folder in re.findall(r"`([^`]+/)`", cells[0]):
      table.setdefault(folder, set()).update(names)
  return table


def tree() -> dict[str, set[str]]:
  """{folder: module names} on disk: the package and each subpackage of areal_jax (without `__init__`), configs/,
  launch/ and tools/ (their Python files)."""
  folders = ["areal_jax/"] + sorted(os.path.relpath(os.path.dirname(p), ROOT) + "/"
                                    for p in glob.glob(os.path.join(ROOT, "areal_jax", "*", "__init__.py")))
  out = {}
  for folder in folders + ["configs/", "launch/", "tools/"]:
    out[folder] = {os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, folder, "*.py"))} - {"__init__"}
  return out


def test_the_tables_parser_reads_names_outside_descriptions():
  readme = ("# x\n\n## Layout\n\n| package | modules |\n|---|---|\n"
            "| `a/` | `one` (the `One` class, `(nested)`), `two` and `three.py` |\n| `b/`, `c/` | `four`; `five` |\n"
            "\n## Next\n\n| `d/` | `six` |\n")
  assert layout_table(readme) == {"a/": {"one", "two", "three"}, "b/": {"four", "five"}, "c/": {"four", "five"}}


def test_readme_layout_table_matches_the_tree():
  with open(os.path.join(ROOT, "README.md")) as f:
    table = layout_table(f.read())
  disk = tree()
  problems = []
  for folder in sorted(set(table) | set(disk)):
    named, there = table.get(folder, set()), disk.get(folder, set())
    if folder not in disk:
      problems.append(f"the table has a row for {folder}, which is not a package here")
    elif folder not in table:
      problems.append(f"the table has no row for {folder} ({sorted(there)})")
    if named - there and folder in disk:
      problems.append(f"{folder}: the table names {sorted(named - there)}, which do not exist")
    if there - named and folder in table:
      problems.append(f"{folder}: the table omits {sorted(there - named)}")
  assert not problems, "README.md's layout table:\n" + "\n".join(problems)


def test_the_docs_name_only_test_files_that_exist():
  named = {}
  for path in [os.path.join(ROOT, "README.md"), *glob.glob(os.path.join(ROOT, "docs", "*.md"))]:
    with open(path) as f:
      for name in re.findall(r"\btests/[\w/]+\.py\b", f.read()):
        named.setdefault(name, os.path.relpath(path, ROOT))
  missing = [f"{where} names {name}" for name, where in sorted(named.items())
             if not os.path.exists(os.path.join(ROOT, name))]
  assert not missing, missing
