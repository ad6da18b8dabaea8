"""`run(config, workdir, layout)`: the asynchronous RL job, in one controller process or as one of several
(`entry_point(layout)`: `lead`, `follow` or `sample`).

One process (the default) runs four threads and a pool of reward worker processes:
- the sampler loop (sampler slice) generates without pause and takes new weights between decode steps; a second
  thread detokenises finished answers and completes their futures;
- the reward service's dispatcher thread hands answers to the workers (processes) and completes their futures;
- this thread is the learner (learner slice): B groups → PPO step → weights pushed device-to-device → version + 1.
The rollout controller has no thread: each group is a chain of futures, generate → score → `RolloutBuffer` (the
owner of the staleness bound), run by the threads that complete them.

In a multi-process job (`roles.ProcessLayout`) the same code runs per role. The leader (learner process 0) keeps the
rollout controller, reward workers, rollout buffer, checkpoints and metrics, and drives the sampler processes through a
`SamplerHub` (requests and answers over authenticated connections, weights over `jax.experimental.transfer`).
Other learner processes `follow` the leader step by step on their shards of one fsdp x tensor mesh. Sampler
processes `sample` (`sampler_process.run_sampler`).

Resume order (a workdir with checkpoints is resumed automatically): 1. model config from the config; 2. parameters
and optimizer state of the latest checkpoint, straight onto the learner's shardings; 3. learner step and policy
version; 4. dataset iterator position, then the prompts that were drawn but not yet trained on (generated again
first); 5. the next rollout group id (the sampling RNG is keyed by seed and group id); 6. metrics.jsonl,
rollouts.jsonl and the TensorBoard events are cut back to the restored step (to nothing when there is no checkpoint).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from etils import epath
from flax import nnx

from areal_jax import agents, faults
from areal_jax import config as config_lib
from areal_jax.data import build_dataset, warmstart_pairs
from areal_jax.distributed import sampler_process
from areal_jax.distributed.control import CONNECT_TIMEOUT_S, ControlServer, Peer, connect
from areal_jax.distributed.roles import ProcessLayout, authkey
from areal_jax.distributed.sampler_hub import SamplerHub
from areal_jax.distributed.slices import build_slices
from areal_jax.distributed.weight_transfer import WeightPublisher, local_copy
from areal_jax.learner.learner import Learner
from areal_jax.learner.step import build_step
from areal_jax.models import hf_io, lora, orbax_io, weights
from areal_jax.models.config import ModelConfig
from areal_jax.reward import sandbox
from areal_jax.reward.service import RewardService, score_all
from areal_jax.rl import warmstart
from areal_jax.rl.batches import save_batch
from areal_jax.rl.checkpoint import Checkpointer
from areal_jax.rl.controller import RolloutController, problem
from areal_jax.rl.evaluation import EpisodeEvaluator, Evaluator, heldout_jsonl
from areal_jax.rl.metrics import MetricsWriter, append_lines, cut_logs
from areal_jax.rl.rollout import LocalRollout, Rollout
from areal_jax.rl.rollout_buffer import RolloutBuffer
from areal_jax.sampler.config import SamplerConfig
from areal_jax.sampler.requests import SamplingParams
from areal_jax.sharding import make_mesh
from areal_jax.tokenizer import load_tokenizer


def _initial_params(config, learner: Learner, train, tokenizer, workdir: epath.Path):
  """The initial weights: the base model (`_initial_base`), with the learner's fresh adapters under LoRA."""
  if not learner.model_cfg.lora_rank:
    return _initial_base(config, learner.fns, learner.params, train, tokenizer, workdir)
  if not config.model.init_from and not config.warmstart.steps:
    return learner.params  # the random init, as `evaluate.checkpoints.load_base` rebuilds it
  adapters, base = lora.split(learner.params)
  # The base is loaded or warm-started in model.param_dtype, then stored as learner.lora.quantize_base says.
  base_cfg = learner.model_cfg.without_lora().replace(param_dtype=config.model.param_dtype)
  base_fns = build_step(base_cfg, learner.config, learner.mesh, temperature=learner.temperature)
  start = weights.cast(lora.dequantize_base(base), base_cfg.weight_dtype)
  base = _initial_base(config, base_fns, start, train, tokenizer, workdir)
  base = lora.quantized_onto(weights.cast(base, learner.model_cfg.weight_dtype), learner.model_cfg,
                             lora.split(learner.fns.param_shardings)[1])
  return nnx.merge_state(base, adapters)


def _base_source(config, workdir: epath.Path) -> dict:
  """Where a run's base weights come from, for its LoRA checkpoints' `meta` (`_initial_base`'s order)."""
  if config.model.init_from:
    return {"init_from": str(config.model.init_from)}
  if config.warmstart.steps:
    return {"warmstart": str(workdir / "warmstart")}
  return {"random_seed": int(config.seed)}


def _initial_base(config, fns, params, train, tokenizer, workdir: epath.Path):
  """HF or Orbax weights from `model.init_from`; else the random init `params`, warm-started on worked solutions
  (cached) by `fns` (every weight trains, adapters or not)."""
  init = config.model.init_from
  shardings = fns.param_shardings
  if init:
    if epath.Path(init, "config.json").exists():
      model = hf_io.load_hf(init, dtype=config.model.dtype, param_dtype=config.model.param_dtype)
    else:
      model = orbax_io.load_orbax(init, dtype=config.model.dtype)
    return _place(nnx.state(model, nnx.Param), shardings)
  if not config.warmstart.steps:
    return params
  cache = workdir / "warmstart"
  if (cache / "model_config.json").exists():
    logging.info("warm-start: loading cached %s", cache)
    return _place(nnx.state(orbax_io.load_orbax(str(cache)), nnx.Param), shardings)
  agent = agents.load(config.agent.path, config.agent.options) if config.agent.path else None
  demonstration = agents.demonstrator(agent) if agent else None
  if demonstration is not None:  # the agent's transcripts, turns merged as in its recorded episodes
    examples = agents.demonstration_episodes([demonstration(problem(r)) for r in train.records], tokenizer,
                                             max_response_len=config.sampler.max_new_tokens)
  else:
    examples = warmstart_pairs(train.records, tokenizer, max_response_len=config.sampler.max_new_tokens)
  w = config.warmstart
  heldout = []
  if w.target_match > 0:  # the last `heldout` examples are not trained on: they measure the match
    if not 0 < w.heldout < len(examples):
      raise config_lib.ConfigError(f"config.warmstart.heldout={w.heldout}: must be in [1, {len(examples) - 1}] "
                                   f"({len(examples)} warm-start examples) when warmstart.target_match > 0")
    examples, heldout = examples[:-w.heldout], examples[-w.heldout:]
  logging.info("warm-start: up to %d steps on %d %s", w.steps, len(examples),
               "demonstrated episodes" if demonstration else "worked solutions")
  params, loss, taken = warmstart.sft(fns, params, examples, steps=w.steps, batch_size=w.batch_size,
                                      lr=w.lr, max_tokens=config.learner.max_tokens_per_mb, seed=config.seed,
                                      target_loss=w.target_loss, accumulate=w.accumulate, heldout=heldout,
                                      target_match=w.target_match)
  orbax_io.save_orbax(nnx.merge(fns.graphdef, params), str(cache))
  logging.info("warm-start: done after %d steps, loss %.4f, cached in %s", taken, loss, cache)
  return params


def _critic_items(learner: Learner) -> dict:
  """The critic's checkpoint items ({} without one)."""
  if learner.critic is None:
    return {}
  return {"critic_params": learner.critic_params, "critic_opt_state": learner.critic_opt}


def _check_critic(meta: dict, critic: str, *, where: str) -> None:
  """A checkpoint restores only into a run with the same critic setting: else a ConfigError naming both."""
  saved = meta.get("critic", "")
  if saved != critic:
    raise config_lib.ConfigError(f"config.learner.critic={critic!r}: {where} was written by a run with "
                                 f"learner.critic={saved!r}; set it to match, or use another workdir")


def _check_adapters(meta: dict, model_cfg: ModelConfig, *, where: str) -> None:
  """A checkpoint restores only into a run with the same adapters (or none): else a ConfigError naming both."""
  saved = meta.get("model_config", {})
  rank, targets = saved.get("lora_rank", 0), ",".join(saved.get("lora_targets", ()))
  if rank != model_cfg.lora_rank:
    what = f"LoRA adapters of learner.lora.rank={rank}" if rank else "full weights (no adapters)"
    raise config_lib.ConfigError(f"config.learner.lora.rank={model_cfg.lora_rank}: {where} holds {what}; set it "
                                 "to match, or use another workdir")
  if rank and targets != ",".join(model_cfg.lora_targets):
    raise config_lib.ConfigError(f"config.learner.lora.targets={','.join(model_cfg.lora_targets)!r}: {where} holds "
                                 f"adapters on {targets!r}; set it to match, or use another workdir")
  quant = saved.get("lora_base_quant", "")
  if rank and quant != model_cfg.lora_base_quant:
    raise config_lib.ConfigError(f"config.learner.lora.quantize_base={model_cfg.lora_base_quant!r}: {where} holds "
                                 f"adapters trained on a base quantized as {quant!r}; set it to match, or use "
                                 "another workdir")


class _QuietLibraries(logging.Filter):
  """Keeps Orbax's per-save and the HTTP client's per-request (agents' episodes) INFO chatter out of the run's log
  (warnings and errors still show)."""

  def filter(self, record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING or not any(f"/{lib}/" in record.pathname for lib in ("orbax", "httpx2"))




def _place(tree, shardings):
  """Host-loaded weights onto the learner's shardings (through the host when the mesh spans processes)."""
  if all(s.is_fully_addressable for s in jax.tree.leaves(shardings)):
    return jax.device_put(tree, shardings)
  return jax.device_put(jax.device_get(tree), shardings)


def _learner_mesh(config, layout: ProcessLayout):
  """(learner mesh, in-process sampler mesh or None): the device split of one process, or every learner
  process's devices in one fsdp x tensor mesh."""
  if not layout.multi_process:
    slices = build_slices(config.mesh)
    return slices.learner, slices.sampler
  try:
    return make_mesh(jax.devices(), {"fsdp": -1, "tensor": config.mesh.learner_tensor}), None
  except ValueError as e:
    raise config_lib.ConfigError(f"config.mesh.learner_tensor={config.mesh.learner_tensor}: {e}") from e


def run(config, workdir: str, layout: ProcessLayout | None = None) -> list[dict]:
  """Trains until `config.total_steps` learner steps: this process's part of the job (`entry_point`; one process:
  all of it). Returns the metrics rows written by this invocation (the leader's; other processes return [])."""
  layout = layout or ProcessLayout.single()
  return entry_point(layout)(config, workdir, layout)


def entry_point(layout: ProcessLayout) -> Callable[..., list[dict]]:
  """What a process of `layout` runs, `(config, workdir, layout) -> rows`: `lead` (the single process, or learner
  process 0), `follow` (another learner process) or `sample` (a sampler process)."""
  if layout.role == "sampler":
    return sample
  return lead if layout.is_leader else follow


def _start(config, workdir: str, layout: ProcessLayout) -> tuple[float, epath.Path, config_lib.Settings]:
  """(start time, workdir, the typed settings): the library log filter installed and the config checked, before
  anything is written."""
  start_time = time.time()
  for handler in logging.getLogger().handlers:
    handler.addFilter(_QuietLibraries())
  settings = config_lib.validate(config, num_devices=None if layout.multi_process else jax.device_count())
  return start_time, epath.Path(workdir), settings


def lead(config, workdir: str, layout: ProcessLayout) -> list[dict]:
  """The leader: data, the rollout controller, reward workers, checkpoints and metrics, and the learner loop (in one
  process, the sampler too)."""
  start_time, workdir, settings = _start(config, workdir, layout)
  # It listens at once, so the other processes can connect while it compiles.
  control = ControlServer(layout, authkey()) if layout.multi_process else None
  try:
    learner_mesh, sampler_mesh = _learner_mesh(config, layout)
    st = _prepare(config, settings, workdir, layout, learner_mesh, start_time, control, None)
    cut_logs(workdir, st.step if st.latest is not None else None)  # no checkpoint: the killed attempts' rows go too
    return _lead(config, workdir, layout, control, st, learner_mesh, sampler_mesh)
  finally:
    if control is not None:
      control.close()


def follow(config, workdir: str, layout: ProcessLayout) -> list[dict]:
  """A learner process other than the leader: the leader's steps on this process's shards (`_follow`)."""
  start_time, workdir, settings = _start(config, workdir, layout)
  leader = connect(layout, authkey(), timeout_s=CONNECT_TIMEOUT_S)
  try:
    learner_mesh, _ = _learner_mesh(config, layout)
    st = _prepare(config, settings, workdir, layout, learner_mesh, start_time, None, leader)
    try:
      _follow(leader, st.learner, st.ckpt, st.step)
    finally:
      st.ckpt.close()
    return []
  finally:
    leader.close()


def sample(config, workdir: str, layout: ProcessLayout) -> list[dict]:
  """A sampler process: the engine on this process's devices, serving the leader (`sampler_process.run_sampler`)."""
  _, workdir, settings = _start(config, workdir, layout)
  sampler_process.run_sampler(config, settings, str(workdir), layout)
  return []


@dataclasses.dataclass
class _Start:
  """What a learner process starts from: data, model, learner (restored or initialised) and checkpoint position."""

  tokenizer: Any
  train: Any
  evalset: Any
  settings: config_lib.Settings
  learner: Learner
  ckpt: Checkpointer
  latest: int | None  # the checkpoint resumed, or None
  step: int
  controller_state: dict | None
  start_time: float  # time/elapsed_s counts from here (moved back by the checkpoint's elapsed time)
  followers: dict[int, Peer]


def _check_code_sandbox(reward, datasets) -> None:
  """Code problems are scored in the sandbox the config names: refuse to start where the host cannot build it."""
  isolation = reward.code_isolation
  if isolation == "bwrap" and any(r.kind == "code" for d in datasets for r in d.records):
    try:
      sandbox.check_isolation()
    except sandbox.SandboxUnavailable as e:
      raise config_lib.ConfigError(f"config.reward.code_isolation={isolation!r}: {e}") from None


def _prepare(config, settings: config_lib.Settings, workdir: epath.Path, layout: ProcessLayout, learner_mesh,
             start_time: float, control: ControlServer | None, leader: Peer | None) -> _Start:
  """Data, model and learner; the run's directory (leader); the latest checkpoint restored, or the initial weights.
  A checkpoint the settings cannot resume is refused before the learner is built or anything is written."""
  tokenizer = load_tokenizer(config.model.tokenizer)
  train = build_dataset(config.data, tokenizer, split="train")
  evalset = build_dataset(config.data, tokenizer, split="eval")
  logging.info("data: %d train prompts %s, %d eval prompts", len(train), train.stats, len(evalset))
  _check_code_sandbox(config.reward, [train, evalset])
  model_cfg, learner_cfg = settings.model, settings.learner
  if model_cfg.vocab_size < tokenizer.vocab_size:
    raise config_lib.ConfigError(f"config.model.vocab_size={model_cfg.vocab_size}: smaller than the tokenizer's "
                                 f"{tokenizer.vocab_size} ids")
  ckpt = Checkpointer(str(workdir / "checkpoints"), every_steps=config.checkpoint.every_steps,
                      max_to_keep=config.checkpoint.max_to_keep)
  step, controller_state = 0, None
  latest = ckpt.latest_step()
  followers = _agree_on_start(layout, control, leader, latest, ckpt.directory)
  if latest is not None:
    saved_meta, where = ckpt.read_meta(latest), f"checkpoint {latest} in {ckpt.directory}"
    if "model_config" in saved_meta:  # the leader's meta (followers' carry the step alone)
      _check_adapters(saved_meta, model_cfg, where=where)
      _check_critic(saved_meta, learner_cfg.critic, where=where)
  learner = Learner(model_cfg=model_cfg, config=learner_cfg, mesh=learner_mesh, temperature=config.sampler.temperature,
                    seed=config.seed)
  logging.info("model: %s, %.2fM parameters", model_cfg.family, model_cfg.num_params() / 1e6)
  if layout.is_leader:  # the settings, data, model and checkpoints agree: the run's settings (a refusal keeps the old)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.json").write_text(config.to_json_best_effort(indent=2))
  if latest is not None:
    if model_cfg.lora_rank:  # the checkpoint holds the adapters alone: the base first
      learner.params = _initial_params(config, learner, train, tokenizer, workdir)
    trained, frozen = learner.fns.split(learner.params)
    trained, learner.opt_state, meta = ckpt.restore(latest, params=trained, opt_state=learner.opt_state)
    learner.params = nnx.merge_state(trained, frozen)
    if learner.critic is not None:
      params, opt = learner.critic.abstract_state()
      saved = ckpt.restore_extra(latest, {"critic_params": params, "critic_opt_state": opt})
      learner.critic_params, learner.critic_opt = saved["critic_params"], saved["critic_opt_state"]
    if "base" in meta:
      lora.check_base(meta["base"], frozen, where=f"checkpoint {latest} in {ckpt.directory}")
    step, controller_state = meta["step"], meta["controller"]
    learner.restore_counters(version=meta["version"], updates=meta["updates"])
    start_time -= meta.get("elapsed_s", 0.0)  # time/elapsed_s goes on from the checkpoint's
    train.restore(controller_state["dataset"])
    logging.info("resumed %s at step %d (version %d)", workdir, step, learner.version)
  else:
    learner.params = _initial_params(config, learner, train, tokenizer, workdir)
    learner.opt_state = learner.fns.init_opt_state(learner.params)
    learner.init_critic()
  return _Start(tokenizer=tokenizer, train=train, evalset=evalset, settings=settings, learner=learner, ckpt=ckpt,
                latest=latest, step=step, controller_state=controller_state, start_time=start_time,
                followers=followers)


def _lead(config, workdir: epath.Path, layout: ProcessLayout, control: ControlServer | None, st: _Start,
          learner_mesh, sampler_mesh) -> list[dict]:
  """The leader's loop: a batch from the rollout buffer, one train step, the new weights published, a metrics row,
  an evaluation and a checkpoint when due."""
  learner, ckpt, followers, step, r = st.learner, st.ckpt, st.followers, st.step, config.rollout
  local = local_copy(learner.params, learner_mesh)  # a collective when the learner spans processes
  learner_local = [d for d in learner_mesh.devices.flat if d.process_index == jax.process_index()]
  sampler_cfg = st.settings.sampler.for_tokenizer(st.tokenizer.vocab_size)
  rollout = _start_rollout(config, layout, control, sampler_cfg, learner, local, sampler_mesh, learner_local,
                           st.tokenizer)
  rewards = RewardService.from_config(config.reward)
  buffer = RolloutBuffer.from_config(r, version=learner.version)
  controller = _controller(config, st, rollout, rewards, buffer)
  evaluator = _evaluator(config, st, controller, sampler_cfg, learner_local, rewards)
  metrics = MetricsWriter(str(workdir), total_steps=config.total_steps, tensorboard=config.metrics.tensorboard)

  checkpoint = _saver(config, workdir, st)
  rows = []
  followers_done = threading.Event()
  for peer in followers.values():
    threading.Thread(target=_watch_follower, args=(peer, followers_done), name=f"watch-{peer.name}",
                     daemon=True).start()
  try:
    if step == 0:
      rows.append({"step": 0, "version": 0, **evaluator(local, version=0).metrics(),
                   "time/elapsed_s": time.time() - st.start_time})
      metrics.write(0, rows[-1])
    controller.start()
    timer = _Timer(rollout.stats())
    controller_state, stalled = None, None
    while step < config.total_steps:
      try:
        groups = _take_batch(buffer, controller, rollout, r.batch_size, learner.version, step, r.stall_timeout_s)
      except Stalled as e:
        stalled = e  # the last step's checkpoint first, below
        break
      trajectories = [t for g in groups for t in g.trajectories]
      if config.metrics.save_batches:
        save_batch(str(workdir), step + 1, trajectories)
      busy_start = time.time()
      for peer in followers.values():
        peer.send("step", {"step": step + 1, "trajectories": trajectories})
      stats = learner.train_step(trajectories)
      step += 1
      controller.mark_trained(groups)
      sync_start = time.time()
      local = local_copy(learner.params, learner_mesh)
      rollout.publish(local, learner.version)
      controller.admit()  # the new version's capacity
      row = {"version": learner.version, **_step_metrics(stats, trajectories, controller.take_rewards()),
             **timer.tick(rollout.stats(), busy_start=busy_start, sync_start=sync_start),
             "rollout/queue_groups": len(buffer),
             "rollout/groups_filtered": controller.counters["groups_filtered"],
             "rollout/reward_failures": controller.counters["reward_failures"], **_agent_metrics(controller, groups),
             "time/elapsed_s": time.time() - st.start_time, **rollout.sync_metrics()}
      if step % config.eval.every_steps == 0 or step == config.total_steps:
        row |= evaluator(local, version=learner.version).metrics()
      metrics.write(step, row)
      controller_state, filtered = controller.snapshot()
      _log_rollouts(workdir, step, learner.version, groups, filtered)
      rows.append({"step": step, **row})
      checkpoint(step, controller_state)
    if step % config.checkpoint.every_steps and controller_state is not None:
      for peer in followers.values():
        peer.send("save", {"step": step})
      checkpoint(step, controller_state, force=True)  # the last step, when not on the checkpoint schedule
    if stalled is not None:
      raise stalled
  finally:
    followers_done.set()
    _send_all(followers, "stop")
    controller.stop()
    if controller.episodes is not None:
      controller.episodes.stop()
    rollout.stop()
    rewards.close()
    ckpt.close()
    metrics.close()
  # Finished (checkpoints written, workers stopped): the summary, printed by the leader alone, which runs this loop.
  metrics.summarize((time.time() - st.start_time) / 60,
                    eval_path=heldout_jsonl(str(workdir), config.data.eval_path, st.evalset.records))
  return rows


def _saver(config, workdir: epath.Path, st: _Start) -> Callable[..., None]:
  """`save(step, controller_state, force=False)`: the leader's checkpoint, on the schedule or forced. Under LoRA it
  holds the adapters alone and names the base they adapt; a critic's state goes beside the policy's."""
  learner, ckpt = st.learner, st.ckpt
  base = {}
  if st.settings.model.lora_rank:
    base = {"base": lora.base_meta(_base_source(config, workdir), learner.fns.split(learner.params)[1])}

  def save(step: int, controller_state: dict, force: bool = False) -> None:
    if ckpt.save(step, params=learner.fns.split(learner.params)[0], opt_state=learner.opt_state, force=force, meta={
        "step": step, "version": learner.version, "updates": learner.updates, "controller": controller_state,
        "elapsed_s": time.time() - st.start_time, "model_config": orbax_io.config_to_json(st.settings.model),
        "critic": learner.config.critic, **base}, extra=_critic_items(learner)):
      faults.reach("checkpoint_write")  # the asynchronous write is in flight

  return save


def _controller(config, st: _Start, rollout: Rollout, rewards: RewardService,
                buffer: RolloutBuffer) -> RolloutController:
  """The rollout controller, continuing from the checkpoint's state (undone prompts first, group ids on)."""
  s, state = config.sampler, st.controller_state
  by_uid = {rec.uid: rec for rec in st.train.records}
  sampling = SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_new_tokens=s.max_new_tokens,
                            seed=config.seed)
  episodes = None
  if config.agent.path:
    episodes = agents.EpisodeRunner(
        agent=agents.load(config.agent.path, config.agent.options), config=st.settings.agent, rollout=rollout,
        tokenizer=st.tokenizer, sampling=sampling,
        limits={"max_seq_len": s.max_seq_len, "vocab_size": st.settings.model.vocab_size},
        version=lambda: st.learner.version)
  return RolloutController(
      dataset=st.train, loop=rollout, rewards=rewards, buffer=buffer, version=lambda: st.learner.version,
      group_size=config.rollout.group_size, sampling=sampling, filter_uniform=config.learner.filter_uniform_groups,
      next_group_id=state["next_group_id"] if state else 0,
      replay=[by_uid[u] for u in state["undone"]] if state else (), episodes=episodes)


class Stalled(RuntimeError):
  """No prompt group was accepted for `rollout.stall_timeout_s`: the run cannot learn as configured."""


def _evaluator(config, st: _Start, controller: RolloutController, sampler_cfg: SamplerConfig, learner_local,
               rewards: RewardService) -> Evaluator | EpisodeEvaluator:
  """With an agent, its episodes on the eval problems; else evaluation on the leader's learner devices (a data x
  tensor mesh), scored by the run's reward workers."""
  if controller.episodes is not None:
    return EpisodeEvaluator(runner=controller.episodes, problems=[problem(r) for r in st.evalset.records],
                            num_samples=config.eval.num_samples)
  return Evaluator(model_cfg=st.settings.model, records=st.evalset.records,
                   mesh=make_mesh(learner_local, {"data": -1, "tensor": config.mesh.learner_tensor}),
                   sampler_cfg=sampler_cfg.replace(num_pages=0, memory_fraction=0.5), eos_ids=[st.tokenizer.eos_id],
                   detokenize=st.tokenizer.decode, score=functools.partial(score_all, rewards),
                   num_samples=config.eval.num_samples, temperature=config.eval.temperature, seed=config.seed)


def _send_all(peers: dict[int, Peer], kind: str, payload=None) -> None:
  """Best effort: a peer whose connection is gone is skipped."""
  for peer in peers.values():
    try:
      peer.send(kind, payload)
    except OSError:
      pass


def _take_batch(buffer: RolloutBuffer, controller: RolloutController, rollout: Rollout, n: int, version: int,
                step: int, stall_timeout_s: float) -> list:
  """The next batch; raises what stopped the controller or the samplers meanwhile, or `Stalled` when no group has
  been accepted for `stall_timeout_s`; warns every 2 minutes."""
  waiting_since = last_accept = time.time()
  accepted, filtered = buffer.accepted, controller.counters["groups_filtered"]
  while True:
    controller.check()
    rollout.check()
    groups = buffer.take_batch(n, version, timeout=1.0)
    if groups is not None:
      return groups
    if buffer.accepted != accepted:
      accepted, filtered, last_accept = buffer.accepted, controller.counters["groups_filtered"], time.time()
    if time.time() - last_accept > stall_timeout_s:
      dropped = controller.counters["groups_filtered"] - filtered
      why = (f"the {dropped} groups that finished were all dropped because every answer scored the same "
             "(learner.filter_uniform_groups): the policy solves none of these prompts (or all of them). Warm-start "
             "longer (warmstart.steps), lower rollout.max_head_offpolicyness, or use an easier data mix" if dropped
             else "no group finished at all: if answers take this long, raise rollout.stall_timeout_s")
      raise Stalled(f"step {step + 1}: no prompt group accepted for {stall_timeout_s:.0f} s "
                    f"(rollout.stall_timeout_s; {len(buffer)} of the batch's {n} groups are ready); {why}")
    if time.time() - waiting_since > 120:
      logging.warning("step %d: no batch of %d groups after %.0fs (%d finished; %s); groups whose answers all "
                      "score the same are dropped (learner.filter_uniform_groups)", step + 1, n,
                      time.time() - waiting_since, len(buffer), dict(controller.counters))
      waiting_since = time.time()


def _agent_metrics(controller: RolloutController, groups) -> dict[str, float]:
  """With an agent: completions per episode in the step's groups, and episodes failed since the start."""
  if controller.episodes is None:
    return {}
  return {"agent/turns_mean": float(np.mean([n for g in groups for n in g.turns])),
          "agent/episode_failures": controller.counters["episode_failures"]}


def _step_metrics(stats: dict, trajectories, finished_rewards: list[float]) -> dict[str, float]:
  """The learner's step statistics with the rewards: every answer scored since the last step, and the trained ones."""
  stats = dict(stats)
  return {"reward/mean": float(np.mean(finished_rewards)) if finished_rewards else float("nan"),
          "reward/trained_mean": float(np.mean([t.reward for t in trajectories])),
          "staleness/mean": stats.pop("learner/staleness_mean"),
          "staleness/max": stats.pop("learner/staleness_max"), **stats}


class _Timer:
  """Per-step timing: sampler throughput and work since the last step, busy seconds of both sides, the weight sync.

  The sampler's work in the step: `decode_steps`, `tokens_per_decode_step` (about the mean number of live slots),
  `prefill_rows` (prompts started, one row for all the answers that share it, or answers resumed), `prefill_tokens`
  (the tokens those rows prefilled), `cached_tokens` (tokens they found in the prefix cache instead) and `recomputed`
  (answers whose keys/values were computed again under new weights), summed over the samplers."""

  def __init__(self, sampler_stats: dict):
    self.last_t, self.last_stats, self.learner_busy = time.time(), sampler_stats, 0.0

  def tick(self, sampler_stats: dict, *, busy_start: float, sync_start: float) -> dict[str, float]:
    now = time.time()
    self.learner_busy += now - busy_start
    done = {k: sampler_stats.get(k, 0) - self.last_stats.get(k, 0)
            for k in ("tokens", "decode_steps", "prefill_rows", "prefill_tokens", "cached_tokens", "recomputed")}
    out = {"sampler/tokens_per_s": done["tokens"] / max(now - self.last_t, 1e-9),
           "sampler/decode_steps": done["decode_steps"],
           "sampler/tokens_per_decode_step": done["tokens"] / done["decode_steps"] if done["decode_steps"] else 0.0,
           **{f"sampler/{k}": done[k] for k in ("prefill_rows", "prefill_tokens", "cached_tokens", "recomputed")},
           "sampler/busy_s": sampler_stats.get("busy_s", 0.0), "learner/busy_s": self.learner_busy,
           "sync/seconds": now - sync_start}
    self.last_t, self.last_stats = now, sampler_stats
    return out


def _start_rollout(config, layout: ProcessLayout, control: ControlServer | None, sampler_cfg: SamplerConfig,
                   learner: Learner, local, sampler_mesh, learner_local, tokenizer) -> Rollout:
  """The samplers, holding the learner's current weights: a `SamplerHub` over the sampler processes of a
  multi-process job, else a `LocalRollout` on this process's sampler slice."""
  if not layout.multi_process:
    abstract_model = nnx.eval_shape(lambda: nnx.merge(learner.fns.graphdef, learner.fns.abstract_params))
    return LocalRollout(abstract_model=abstract_model, config=sampler_cfg, mesh=sampler_mesh, params=local,
                        version=learner.version, eos_ids=[tokenizer.eos_id], detokenize=tokenizer.decode)
  publisher = WeightPublisher(abstract_params=weights.with_dtype(learner.fns.abstract_params, sampler_cfg.weight_dtype),
                              tensor=config.mesh.sampler_tensor, devices=learner_local, host=layout.host)
  peers = control.wait(range(layout.num_learners, layout.num_processes), timeout_s=CONNECT_TIMEOUT_S)
  hub = SamplerHub(peers=peers, publisher=publisher).start()
  hub.publish(local, learner.version)
  return hub


def _agree_on_start(layout: ProcessLayout, control: ControlServer | None, leader: Peer | None, latest: int | None,
                    directory) -> dict[int, Peer]:
  """Learner processes check that they resume the same checkpoint (a workdir on a disk they do not share would have
  them run different programs and hang in a collective). Returns the leader's follower connections."""
  if layout.num_learners == 1:
    return {}
  if leader is not None:
    kind, payload = leader.recv()
    if kind != "start" or payload["checkpoint"] != latest:
      raise RuntimeError(f"{layout.name}: the leader starts from checkpoint {payload.get('checkpoint')}, this process "
                         f"found {latest} in {directory}; every learner process must see the same workdir")
    return {}
  followers = control.wait(range(1, layout.num_learners), timeout_s=CONNECT_TIMEOUT_S)
  for peer in followers.values():
    peer.send("start", {"checkpoint": latest})
  return followers


def _watch_follower(peer: Peer, done: threading.Event) -> None:
  """Followers send nothing: a message here means the connection ended. Before the run's end that is a dead learner
  process, and the leader may be waiting for it inside a collective it cannot leave: exit."""
  try:
    peer.recv()
  except ConnectionError as e:
    if not done.is_set():
      logging.error("%s; stopping (a restart resumes from the last checkpoint)", e)
      for handler in logging.getLogger().handlers:
        handler.flush()
      os._exit(1)  # pylint: disable=protected-access


def _follow(leader: Peer, learner: Learner, ckpt: Checkpointer, step: int) -> None:
  """A learner process other than the leader: the leader's train steps, copies and saves, on this process's shards.

  Every call that runs a program over the learner mesh is made here in the leader's order (SPMD across processes).
  """
  local_copy(learner.params, learner.mesh)  # the initial publication
  while True:
    kind, payload = leader.recv()
    if kind == "stop":
      return
    if kind == "step":
      step = payload["step"]
      learner.train_step(payload["trajectories"])
      local_copy(learner.params, learner.mesh)
      force = False
    elif kind == "save":
      force = True
    else:
      raise RuntimeError(f"learner follower: unknown message {kind!r}")
    ckpt.save(step, params=learner.fns.split(learner.params)[0], opt_state=learner.opt_state, force=force,
              meta={"step": step}, extra=_critic_items(learner))


def _log_rollouts(workdir: epath.Path, step: int, version: int, trained, filtered) -> None:
  """One line per finished group: the prompt, whether it was trained on at `step` or filtered (uniform rewards)
  since the previous step, its rewards and the policy versions of its answers."""
  append_lines(workdir / "rollouts.jsonl", [
      json.dumps({"step": step, "version": version, "uid": g.record.uid, "filtered": was_filtered,
                  "rewards": g.rewards.tolist(),
                  "version_start": [t.version_start for t in g.trajectories],
                  "version_end": [t.version_end for t in g.trajectories],
                  "lengths": [len(t.response_ids) for t in g.trajectories], **({"turns": g.turns} if g.turns else {})})
      for g, was_filtered in [(g, False) for g in trained] + [(g, True) for g in filtered]])
