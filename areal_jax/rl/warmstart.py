"""Supervised warm-start: next-token cross-entropy on worked solutions, before RL.

Used by the CPU default (a model trained from scratch has no competence for RL to sharpen). It runs on the learner
mesh with the learner's packing (dynamic micro-batches, bucketed lengths) and a plain AdamW.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from areal_jax.learner.microbatch import assemble, plan_packed
from areal_jax.learner.step import BATCH_INT_KEYS, StepFns, packed_logprobs
from areal_jax.types import Trajectory


_WINDOW = 10  # steps averaged for `target_loss`; `target_match` is checked every _WINDOW steps


def _logprobs_fn(fns: StepFns):
  def logprobs(p, batch):
    model = nnx.merge(fns.graphdef, p)
    return packed_logprobs(model, batch["tokens"], batch["positions"], batch["segment_ids"], temperature=1.0)[0]
  return jax.jit(logprobs)


Examples = Sequence[tuple[Sequence[int], Sequence[int]] | Trajectory]


def _example(pair) -> Trajectory:
  if isinstance(pair, Trajectory):
    return pair
  prompt, response = pair
  return Trajectory(prompt_ids=np.asarray(prompt, np.int32), response_ids=np.asarray(response, np.int32),
                    logprobs=np.zeros(len(response), np.float32), versions=np.zeros(len(response), np.int32),
                    finish_reason="eos")


def _examples(pairs: Examples) -> list[Trajectory]:
  return [_example(pair) for pair in pairs]


def match_probability(fns: StepFns, params: nnx.State, pairs: Examples, *, max_tokens: int) -> float:
  """The mean over `pairs` of the probability that sampling at temperature 1 draws the response token for token
  (a merged transcript's: its assistant tokens, given the context between them).

  On the tiny default it stays close to pass@1 at temperature 1, a worked solution being nearly the only way to the
  answer: 0.49, 0.48, 0.32, 0.52, 0.65, 0.61 on held-out solutions for warm-starts whose eval accuracy was 0.54,
  0.56, 0.36, 0.52, 0.59, 0.58."""
  return _match(_logprobs_fn(fns), fns, params, _examples(pairs), max_tokens)


def _match(logprobs, fns: StepFns, params: nnx.State, examples: list[Trajectory], max_tokens: int) -> float:
  probs = []
  for layout in plan_packed([t.num_tokens for t in examples], max_tokens=max_tokens, rows=fns.rows):
    mb = assemble(layout, examples, [np.ones(len(t.response_ids), np.float32) for t in examples])
    arrays = jax.device_put({k: getattr(mb, k) for k in BATCH_INT_KEYS}, fns.batch_sharding)
    lp = np.asarray(logprobs(params, arrays)) * mb.loss_mask
    for r, row in enumerate(layout.rows):
      sums = np.bincount(mb.segment_ids[r], weights=lp[r], minlength=len(row) + 1)
      probs.extend(np.exp(sums[1:len(row) + 1]))
  return float(np.mean(probs))


def _programs(fns: StepFns, optimizer):
  """(step, grad_sum, add, apply), compiled: one update on a packed micro-batch; or a piece's summed loss and
  gradients, their sum, and one update from the sum (a batch split in pieces with `accumulate`)."""
  graphdef = fns.graphdef

  def loss_sum(p, batch):
    model = nnx.merge(graphdef, p)
    (lp,) = packed_logprobs(model, batch["tokens"], batch["positions"], batch["segment_ids"], temperature=1.0)
    return -(lp * batch["loss_mask"]).sum()

  def loss_fn(p, batch):
    return loss_sum(p, batch) / jnp.maximum(batch["loss_mask"].sum(), 1.0)

  def step(p, o, batch):
    loss, grads = jax.value_and_grad(loss_fn)(p, batch)
    updates, o = optimizer.update(grads, o, p)
    return optax.apply_updates(p, updates), o, loss

  def apply(p, o, grads, tokens):
    updates, o = optimizer.update(jax.tree.map(lambda g: g / tokens, grads), o, p)
    return optax.apply_updates(p, updates), o

  return (jax.jit(step, donate_argnums=(0, 1), out_shardings=(fns.param_shardings, None, None)),
          jax.jit(jax.value_and_grad(loss_sum)), jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b)),
          jax.jit(apply, donate_argnums=(0, 1), out_shardings=(fns.param_shardings, None)))


def _train_batch(programs, fns: StepFns, params, opt_state, batch: list[Trajectory], *, max_tokens: int,
                 accumulate: bool):
  """One batch: normally one micro-batch and one update; a batch too long for one is split, one update per piece
  (or, with `accumulate`, one for the pieces' summed gradients). Returns (params, opt_state, loss)."""
  step, grad_sum, add, apply = programs
  layouts = plan_packed([t.num_tokens for t in batch], max_tokens=max_tokens, rows=fns.rows)
  total, grads, tokens, loss = 0.0, None, 0.0, None
  for layout in layouts:
    mb = assemble(layout, batch, [np.ones(len(t.response_ids), np.float32) for t in batch])
    arrays = jax.device_put({k: getattr(mb, k) for k in BATCH_INT_KEYS + ("loss_mask",)}, fns.batch_sharding)
    if not accumulate:
      params, opt_state, loss = step(params, opt_state, arrays)
      continue
    piece, g = grad_sum(params, arrays)
    grads = g if grads is None else add(grads, g)
    total, tokens = total + piece, tokens + float(mb.loss_mask.sum())
  if accumulate:
    params, opt_state = apply(params, opt_state, grads, tokens)
    loss = total / tokens
  return params, opt_state, loss


def sft(fns: StepFns, params: nnx.State, pairs: Examples, *, steps: int, batch_size: int, lr: float, max_tokens: int,
        seed: int = 0, target_loss: float = 0.0, log_every: int = 50, accumulate: bool = False,
        heldout: Examples = (), target_match: float = 0.0) -> tuple[nnx.State, float, int]:
  """Trains `params` (on `fns.mesh`) to predict each pair's response from its prompt; returns (params, last loss,
  steps taken).

  `pairs` are (prompt ids, response ids incl. eos), or trajectories whose `loss_mask` leaves out the context inside
  the response (an agent's merged transcripts, `agents.demonstration_episodes`); batches are drawn with a seeded
  shuffle, epoch after epoch.
  `target_loss` > 0 stops early once the mean loss of the last `_WINDOW` steps is at or below it: a model trained
  from scratch learns arithmetic in a sudden drop whose timing varies with the seed, so a loss target gives RL a
  starting competence closer across seeds than a step count does (only if the drop comes within `steps`).
  `target_match` > 0 stops once the `heldout` pairs' `match_probability` (checked every `_WINDOW` steps) is at or
  above it: closer still, since equal losses left seeds 0.2 apart in held-out accuracy.

  A batch too long for one packed micro-batch is split. By default each piece is an update of its own, and the
  cosine counts updates (the math preset's measured warm-starts ran so: ~2 pieces per step); with `accumulate` the
  pieces' gradients add up to one update per batch, so the schedule spans `steps` whatever the split.
  """
  warmup = min(50, steps // 10 + 1)
  schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1), lr * 0.1)  # steps >= 1
  optimizer = optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.0)
  opt_state = jax.jit(optimizer.init)(params)
  programs = _programs(fns, optimizer)

  examples, held = _examples(pairs), _examples(heldout)
  if target_match > 0 and not held:
    raise ValueError("warm-start: target_match needs held-out pairs")
  logprobs = _logprobs_fn(fns)
  rng = np.random.default_rng(seed)
  order, pos = rng.permutation(len(examples)), 0
  loss, start, recent = float("nan"), time.time(), []
  for i in range(steps):
    if pos + batch_size > len(order):
      order, pos = rng.permutation(len(examples)), 0
    idx = order[pos:pos + batch_size]
    pos += batch_size
    params, opt_state, loss_arr = _train_batch(programs, fns, params, opt_state, [examples[j] for j in idx],
                                                max_tokens=max_tokens, accumulate=accumulate)
    recent = recent[-(_WINDOW - 1):] + [loss_arr]
    check = (i + 1) % _WINDOW == 0
    match = _match(logprobs, fns, params, held, max_tokens) if check and target_match > 0 else None
    if (i + 1) % log_every == 0 or i + 1 == steps:
      loss = float(loss_arr)
      logging.info("warm-start step %d/%d: loss %.4f%s (%.0fs)", i + 1, steps, loss,
                   "" if match is None else f", held-out match {match:.3f}", time.time() - start)
    if check and target_loss > 0 and float(jnp.mean(jnp.stack(recent))) <= target_loss:
      logging.info("warm-start: mean loss of the last %d steps <= target %.4g at step %d (%.0fs)", _WINDOW,
                   target_loss, i + 1, time.time() - start)
      return params, float(loss_arr), i + 1
    if match is not None and match >= target_match:
      logging.info("warm-start: held-out match %.3f >= target %.4g at step %d (%.0fs)", match, target_match, i + 1,
                   time.time() - start)
      return params, float(loss_arr), i + 1
  return params, loss, steps
