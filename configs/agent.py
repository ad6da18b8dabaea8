r"""The bundled agent task: a calculator agent (`areal_jax/agents/calculator.py`) calls its tool for two-digit
products that the tiny model cannot work out in its head. The tiny preset of `configs/math.py`, with:

* episodes of the agent (`agent.path`) in place of single-turn answers: the question with the `calc` tool offered,
  the model's tool call, the tool's result, the model's final `\boxed{}` answer; reward 1 when it is the product;
* a warm-start on the agent's demonstrations (one example per assistant turn), one update per batch
  (`warmstart.accumulate`: with an update per packed piece, ~4.75 per step here, the model had not learned to copy
  the operands into the call after 700-1200 steps);
* held-out success (eval/accuracy, and eval/turns_mean) measured by running the agent's episodes at each evaluated
  version.

    python launch/tpu_run.py --config=configs/agent.py --workdir=/tmp/areal_agent

Measured once (seed 0, empty workdir, no compile cache, 2-core CPU; minutes since the process started, the 700-step
warm-start taking 8.2 of them):

    step              0      10     20     30     40
    eval success    0.051  0.133  0.188  0.332  0.379
    turns           1.93   1.91   1.88   1.91   1.96
    min              8.7   12.1   14.6   17.0   19.5

The warm-start ends just as the model learns to copy the operands into the call (loss 0.041 at step 700): nearly
every episode calls the tool, and RL makes the copies reliable at the sampling temperature. Not yet measured: more
seeds, and whether a longer warm-start or fewer RL steps meet +20 points within 15 minutes.

Any field can be overridden, as in configs/math.py: `--config.agent.turn_discount=0.9`.
"""

import importlib.util
import os

import ml_collections


def _math_config() -> ml_collections.ConfigDict:
  spec = importlib.util.spec_from_file_location("_math_config", os.path.join(os.path.dirname(__file__), "math.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config("tiny")


def get_config(preset: str | None = None) -> ml_collections.ConfigDict:
  if preset:
    raise ValueError(f"configs/agent.py has no presets (got {preset!r})")
  c = _math_config()
  c.preset = "agent"
  c.total_steps = 40
  c.agent.path = "areal_jax.agents.calculator:Calculator"
  c.agent.max_turns = 4
  c.agent.timeout_s = 300.0
  c.data.synthetic_task = "products"
  # A solved episode: a 39-token prompt, a 68-token tool call, the result, a 13-token answer (137 tokens in all).
  c.sampler.max_seq_len = 224
  c.sampler.max_new_tokens = 80
  c.learner.max_tokens_per_mb = 512  # three episodes a row (at 256, one: half of each row was padding)
  c.warmstart.steps = 1000  # at most
  c.warmstart.lr = 5e-4
  c.warmstart.target_loss = 0.0
  c.warmstart.target_match = 0.5
  c.warmstart.heldout = 64
  c.warmstart.accumulate = True
  c.eval.every_steps = 10
  c.eval.num_samples = 2
  c.checkpoint.every_steps = 10
  return c
