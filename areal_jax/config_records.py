"""The shared `from_config` of the typed config records (`config.Settings`): one config group onto its frozen
dataclass."""

from __future__ import annotations

import dataclasses


def from_group(cls, group, name: str):
  """`cls` from the config group `name` (an ml_collections ConfigDict or a mapping). Keys the record does not know
  raise, naming them; keys the group lacks (a config saved before the field existed) take the record's defaults."""
  names = {f.name for f in dataclasses.fields(cls)}
  keys = list(group.keys())
  unknown = sorted(set(keys) - names)
  if unknown:
    raise ValueError(f"unknown {name} config keys {unknown}; known: {sorted(names)}")
  return cls(**{k: group[k] for k in keys})
