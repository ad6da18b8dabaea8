"""Shared test fixtures: a tiny model config and fast random weights."""

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import tokenizers
from flax import nnx

from areal_jax.models import ModelConfig, create

TINY = ModelConfig(family="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=8, attention_bias=True, max_position_embeddings=256)


def tiny_model(cfg: ModelConfig = TINY, seed: int = 0):
  """Random weights from numpy (eager NNX init compiles one RNG program per shape: slow on CPU)."""
  graphdef, state = nnx.split(nnx.eval_shape(lambda: create(cfg)))
  rng = np.random.default_rng(seed)

  def fill(path, x):
    name = jax.tree_util.keystr(path)
    if "scale" in name:
      return jnp.asarray(1 + 0.1 * rng.normal(size=x.shape), x.dtype)
    stacked = name.startswith(("['layers']", "['dense_layers']"))
    experts = stacked and "['mlp']" in name and x.ndim == 4  # [layers, experts, in, out]
    fan_in = x.shape[2] if experts else x.shape[1] if stacked else x.shape[0]  # past the layers (and experts) axes
    return jnp.asarray(rng.normal(size=x.shape) / np.sqrt(fan_in), x.dtype)

  return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(fill, state))


# An answer sympy grinds on for ~15 s (each (n!)! about 1.4 s), far longer than any timeout in the tests; a single
# (9999!)! finishes in about a second, so racing it against a 1 s timeout was flaky.
SLOW_MATH = r"\boxed{" + "+".join(f"({n}!)!" for n in range(9999, 9989, -1)) + "}"


CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
          "'\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


# ChatML with tools in the Hermes format (what Qwen2.5's template renders), written for the tests.
TOOLS_CHATML = (
    "{% if tools %}<|im_start|>system\nTools:\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}</tool_response><|im_end|>\n"
    "{% elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{{ m.content }}"
    "{% for c in m.tool_calls %}<tool_call>{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_bpe_tokenizer(directory: str, texts, vocab_size: int = 300, template: str = CHATML) -> str:
  """A tiny byte-level BPE tokenizer trained on `texts`, with a ChatML chat template, as a HF directory."""
  tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token=None))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>",
                                                                                 "<|im_end|>"],
                                           initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(texts, trainer)
  os.makedirs(directory, exist_ok=True)
  tok.save(os.path.join(directory, "tokenizer.json"))
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": template}, f)
  return directory


# LLVM's optimisation back on for a compute-bound program (tests/conftest.py turns it off for the compile-bound rest).
OPTIMIZED = {"xla_backend_optimization_level": 3}


def memorize(model, pairs, steps: int = 600, check_every: int = 50):
  """A copy of `model` trained until its greedy answer to each prompt of `pairs` ((prompt ids, answer ids), ...) is
  that answer: a scripted policy for tests. `check_every` Adam steps run in one compiled loop between checks,
  compiled with LLVM's optimisation on: it is compute-bound (the calculator's 48 demonstrations took 53 s a step at
  a time, unoptimised, and 24 s so)."""
  graphdef, params, rest = nnx.split(nnx.clone(model), nnx.Param, ...)
  length = max(len(p) + len(a) for p, a in pairs)
  seqs, mask = np.zeros((len(pairs), length), np.int32), np.zeros((len(pairs), length - 1), np.float32)
  for i, (p, a) in enumerate(pairs):
    seqs[i, :len(p) + len(a)] = list(p) + list(a)
    mask[i, len(p) - 1:len(p) + len(a) - 1] = 1
  seqs, mask = jnp.asarray(seqs), jnp.asarray(mask)
  tx = optax.adam(3e-3)

  def predictions(p):
    return jax.nn.log_softmax(nnx.merge(graphdef, p, rest)(seqs)[:, :-1], axis=-1)

  def loss_fn(p):
    lp = jnp.take_along_axis(predictions(p), seqs[:, 1:, None], axis=-1)[..., 0]
    return -jnp.sum(lp * mask) / jnp.sum(mask)

  @functools.partial(jax.jit, compiler_options=OPTIMIZED)
  def train(p, opt_state):
    def step(_, carry):
      p, opt_state = carry
      updates, opt_state = tx.update(jax.grad(loss_fn)(p), opt_state, p)
      return optax.apply_updates(p, updates), opt_state

    p, opt_state = jax.lax.fori_loop(0, check_every, step, (p, opt_state))
    return p, opt_state, jnp.all((jnp.argmax(predictions(p), -1) == seqs[:, 1:]) | (mask == 0))

  opt_state = tx.init(params)
  for _ in range(steps // check_every):
    params, opt_state, learned = train(params, opt_state)
    if learned:
      return nnx.merge(graphdef, params, rest)
  raise AssertionError(f"the answers were not learned in {steps} steps")
