"""Agents: plain async Python written against the OpenAI client, trained unchanged.

    async def run(data: dict, client: openai.AsyncOpenAI) -> float: ...  # or a class with such an async `run`

`data` is the problem (`uid`, `question`, `reference`, `kind`, `solution`, and `prompt`, the run's rendering of it).
The agent calls `client.chat.completions.create(...)` (or `completions`) as often as it likes, with tools, and
returns the episode's reward: a number, or a dict of numbers by response id (`episodes.assign_rewards`). The same
function runs against `tools/serve.py` or any OpenAI endpoint for evaluation. An agent object may also offer
`demonstration(data)`: a chat transcript (`{"messages": [...], "tools": [...]}`) the supervised warm-start trains on
(`demonstrations.py`; `calculator.py` is the bundled example).

Configured by import path (`--config.agent.path=my_agents:MathAgent`), with `agent.options` (keyword arguments for a
class there), `agent.max_turns` (completions per episode), `agent.timeout_s` (per episode) and `agent.turn_discount`.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

AgentFn = Callable[[dict[str, Any], Any], Awaitable[Any]]


@dataclasses.dataclass(frozen=True, kw_only=True)
class AgentConfig:
  path: str = ""  # "module:attribute"; empty = single-turn answers scored by the reward service
  options: dict[str, Any] = dataclasses.field(default_factory=dict)  # keyword arguments for a class at `path`
  max_turns: int = 8
  timeout_s: float = 600.0
  turn_discount: float = 1.0

  def __post_init__(self):
    def bad(field, why):
      raise ValueError(f"agent.{field}={getattr(self, field)!r}: {why}")

    if self.path and (self.path.count(":") != 1 or not all(self.path.split(":"))):
      bad("path", "expected 'module:attribute', e.g. 'my_agents:MathAgent'")
    if self.max_turns < 1:
      bad("max_turns", "must be >= 1")
    if not self.timeout_s > 0:
      bad("timeout_s", "must be > 0")
    if not 0 <= self.turn_discount <= 1:
      bad("turn_discount", "must lie in [0, 1]")

  @classmethod
  def from_config(cls, c) -> AgentConfig:
    """From the `agent` group of an ml_collections config."""
    options = c.get("options") or {}
    return cls(path=c.path, options=options.to_dict() if hasattr(options, "to_dict") else dict(options),
               max_turns=c.max_turns, timeout_s=float(c.timeout_s), turn_discount=float(c.turn_discount))

  def load(self) -> AgentFn | None:
    """The agent at `path` with `options` (`load`); None without a path (single-turn answers)."""
    return load(self.path, self.options) if self.path else None


def load(path: str, options: Mapping[str, Any] | None = None) -> AgentFn:
  """The agent at `path` ("module:attribute"): an async function, an object with an async `run`, or a class whose
  instances have one (instantiated once, with `options` as keyword arguments). Raises ValueError naming what is
  wrong."""
  module_name, _, attr = path.partition(":")
  try:
    module = importlib.import_module(module_name)
  except ImportError as e:
    raise ValueError(f"agent.path={path!r}: cannot import {module_name!r}: {e}") from None
  if not hasattr(module, attr):
    raise ValueError(f"agent.path={path!r}: module {module_name!r} has no {attr!r}")
  obj = getattr(module, attr)
  options = dict(options or {})
  if inspect.isclass(obj):
    try:
      inspect.signature(obj).bind(**options)
    except TypeError as e:
      raise ValueError(f"agent.options={options!r}: {path!r} does not take them ({e})") from None
    obj = obj(**options)
  elif options:
    raise ValueError(f"agent.options={options!r}: only a class at agent.path takes options, and {path!r} is not one")
  fn = obj if inspect.iscoroutinefunction(obj) else getattr(obj, "run", None)
  if not inspect.iscoroutinefunction(fn):
    raise ValueError(f"agent.path={path!r}: {obj!r} is neither an async function nor has an async `run(data, "
                     f"client)` method")
  return fn


def demonstrator(agent: AgentFn) -> Callable[[dict[str, Any]], dict[str, Any]] | None:
  """The `demonstration(data)` method of the object whose `run` `agent` is, if it has one."""
  return getattr(getattr(agent, "__self__", None), "demonstration", None)
