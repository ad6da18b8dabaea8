"""The configs reference, generated from the code: every field of the bundled configs with its defaults per preset,
its doc (the comment beside or above its line in the config file) and what `config.validate` says to a bad value.

The docs site builds its page with `reference_markdown()` (`docs/hooks.py`); a test fails when a field has no doc.
"""

from __future__ import annotations

import ast
import io
import json
import os
import tokenize

import ml_collections

from areal_jax import config as config_lib

# (column, config spec) of the configs the reference covers; docs come from these files, the first that has one.
CONFIGS = (("tiny", "configs/math.py:tiny"), ("qwen2.5-1.5b", "configs/math.py:qwen2.5-1.5b"),
           ("r1-distill-qwen-7b", "configs/math.py:r1-distill-qwen-7b"), ("agent", "configs/agent.py"))
_PROBE_SPEC = "configs/math.py:tiny"  # the preset bad values are tried on (it needs no dataset or weights)
_PROBE_DEVICES = 4


def leaves(config: ml_collections.ConfigDict, prefix: str = "") -> dict[str, object]:
  """Every leaf field as `{"group.name": value}` (an empty group, such as `agent.options`, is a leaf)."""
  out = {}
  for key, value in config.items():
    if isinstance(value, ml_collections.ConfigDict) and len(value):
      out.update(leaves(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value.to_dict() if isinstance(value, ml_collections.ConfigDict) else value
  return out


def field_docs(path: str) -> dict[str, str]:
  """`{"group.name": doc}` from a config file's source: the comment ending an assignment's line, after the block of
  comment lines right above it. Assignments in a helper whose result `get_config` assigns to a group
  (`c.model = _model(preset)`) are that group's."""
  with open(path) as f:
    source = f.read()
  comments = {t.start[0]: t.string.lstrip("#").strip()
              for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT}
  lines = source.splitlines()
  tree = ast.parse(source)
  functions = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}
  prefixes = {"get_config": ""}  # function -> group of its assignments
  for node in ast.walk(functions["get_config"]):
    if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name)
        and node.value.func.id in functions):
      prefixes[node.value.func.id] = _chain(node.targets[0]) + "."
  docs = {}
  for name, prefix in prefixes.items():
    for node in ast.walk(functions[name]):
      if not isinstance(node, ast.Assign) or not isinstance(node.targets[0], ast.Attribute):
        continue
      above, line = [], node.lineno - 1
      while line >= 1 and lines[line - 1].strip().startswith("#"):
        above.insert(0, comments[line])
        line -= 1
      doc = " ".join(above + ([comments[node.end_lineno]] if node.end_lineno in comments else []))
      if doc:
        docs[prefix + _chain(node.targets[0])] = doc
  return docs


def _chain(target: ast.expr) -> str:
  """`c.learner.lora.rank` -> "learner.lora.rank" (the root variable dropped)."""
  names = []
  while isinstance(target, ast.Attribute):
    names.insert(0, target.attr)
    target = target.value
  return ".".join(names)


def _doc_for(key: str, docs: dict[str, str]) -> str:
  """The field's doc, or its group's for a field set as a whole dict (`model.rope_scaling.factor`)."""
  while key:
    if key in docs:
      return docs[key]
    key = key.rpartition(".")[0]
  return ""


def _probes(value) -> list:
  if isinstance(value, bool):
    return []
  if isinstance(value, (int, float)) or value is None:
    return [0, -1]
  if isinstance(value, str):
    return ["?"]
  return []


def checks(key: str, default, root: str = ".") -> list[str]:
  """What `config.validate` answers when the tiny preset's `key` is set to a bad value (0, -1, an unknown string),
  as `value: message` for the messages that name `key`."""
  out = []
  for value in _probes(default):
    try:
      c = config_lib.load_config(os.path.join(root, _PROBE_SPEC))
      c.unlock()
      node = c
      *parents, leaf = key.split(".")
      for p in parents:
        node = node[p]
      node[leaf] = type(default)(value) if default is not None and not isinstance(default, str) else value
      config_lib.validate(c, num_devices=_PROBE_DEVICES)
    except ValueError as e:
      message = str(e)
      head = f"config.{key}="
      if message.startswith(head):
        out.append(f"{value!r}: {message.split(': ', 1)[1] if ': ' in message else message}")
    except Exception:  # pylint: disable=broad-except  # a probe the field's type rejects tells nothing
      pass
  return out


def reference(root: str = ".") -> list[dict]:
  """One record per field: key, defaults per config column, doc, checks (in the order of the tiny preset)."""
  configs = {column: leaves(config_lib.load_config(os.path.join(root, spec)))
             for column, spec in CONFIGS}
  docs = {}
  for path in sorted({spec.partition(":")[0] for _, spec in CONFIGS}, key=lambda p: "math" not in p):
    for key, doc in field_docs(os.path.join(root, path)).items():
      docs.setdefault(key, doc)
  keys = list(configs["tiny"])
  keys += [k for values in configs.values() for k in values if k not in keys]
  return [{"key": k, "defaults": {col: values.get(k, "—") for col, values in configs.items()},
           "doc": _doc_for(k, docs), "checks": checks(k, configs["tiny"][k], root) if k in configs["tiny"] else []}
          for k in keys]


def _cell(value) -> str:
  text = value if isinstance(value, str) and value == "—" else json.dumps(value)
  return "`" + text.replace("|", "\\|") + "`"


def reference_markdown(root: str = ".") -> str:
  """The reference page: one table per group."""
  out = ["# Configs reference", "",
         "Every field of `configs/math.py` (presets `tiny`, `qwen2.5-1.5b`, `r1-distill-qwen-7b`) and "
         "`configs/agent.py`, generated from the code: defaults per preset (one value when all agree), the field's "
         "comment in `configs/math.py`, and what `areal_jax.config.validate` answers when the tiny preset gets "
         "a bad value (0, -1 or an unknown string). Override any field with `--config.GROUP.FIELD=VALUE`.", ""]
  group = None
  for row in reference(root):
    g = row["key"].split(".")[0] if "." in row["key"] else "top level"
    if g != group:
      group = g
      out += ["", f"## {g}", "", "| field | default | what it does | a bad value |", "|---|---|---|---|"]
    values = row["defaults"]
    if len({json.dumps(v) for v in values.values()}) == 1:
      default = _cell(values["tiny"])
    else:
      default = "<br>".join(f"{col}: {_cell(v)}" for col, v in values.items())
    bad = "<br>".join(c.replace("|", "\\|") for c in row["checks"]) or "—"
    out.append(f"| `{row['key']}` | {default} | {row['doc'].replace('|', chr(92) + '|')} | {bad} |")
  return "\n".join(out) + "\n"
