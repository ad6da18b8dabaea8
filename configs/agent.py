r"""The bundled agent task: a calculator agent (`areal_jax/agents/calculator.py`) calls its `calc` tool for two-digit
products that the tiny model cannot work out in its head. The tiny preset of `configs/math.py` with the agent's
episodes (`agent.path`) in place of single-turn answers, a warm-start on the agent's demonstrations, and held-out
success (eval/accuracy, eval/turns_mean) measured by running the agent's episodes:

    python launch/tpu_run.py --config=configs/agent.py --workdir=/tmp/areal_agent

About 15-18 minutes on a 2-core CPU; held-out success from 0.27-0.35 at step 0 to 0.50-0.57 at step 30 across the
measured seeds. Measured figures: docs/results.md. Any field can be overridden: `--config.agent.turn_discount=0.9`.
"""

import importlib.util
import os

import ml_collections


def _math_config():
  spec = importlib.util.spec_from_file_location("_math_config", os.path.join(os.path.dirname(__file__), "math.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def get_config(preset: str | None = None) -> ml_collections.ConfigDict:
  """No preset: the task as measured. `fast`: `configs/math.py:fast`'s changes on top (the end-to-end test)."""
  if preset not in (None, "", "fast"):
    raise ValueError(f"configs/agent.py has one preset, 'fast' (got {preset!r})")
  math = _math_config()
  c = math.get_config("tiny")
  c.preset = "agent"
  c.total_steps = 30
  c.agent.path = "areal_jax.agents.calculator:Calculator"
  c.agent.options.demo_tool_share = 0.75  # a quarter of the demonstrations answer in their head: RL unlearns it
  # 2: a wrong answer is told so and asked again (AReaL's multi-turn rule; with sampler.max_seq_len=320).
  c.agent.options.attempts = 1
  c.agent.options.retry_discount = 1.0
  c.agent.max_turns = 4
  c.agent.timeout_s = 300.0
  c.data.synthetic_task = "products"
  # A solved episode is 137 tokens: a 39-token prompt, a 68-token tool call, the result, a 13-token answer.
  c.sampler.max_seq_len = 224
  c.sampler.max_new_tokens = 80
  # Off: fewer prefilled tokens here, but longer compiles and no faster steps (docs/results.md).
  c.sampler.prefix_cache = False
  c.learner.max_tokens_per_mb = 512  # three episodes a row
  c.warmstart.steps = 1000  # at most
  c.warmstart.lr = 5e-4
  c.warmstart.target_match = 0.2
  c.warmstart.heldout = 64
  c.warmstart.accumulate = True
  c.eval.every_steps = 10
  c.eval.num_samples = 2
  c.checkpoint.every_steps = 10
  if preset == "fast":
    c = math.apply(c, math.FAST)
    c.sampler.update(max_seq_len=224, max_new_tokens=80)  # a solved episode's length
    c.preset = "agent-fast"
  return c
