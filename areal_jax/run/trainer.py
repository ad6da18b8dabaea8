"""`run(config, workdir, layout)`: the asynchronous RL job, in one controller process or as one of several
(`entry_point(layout)`: `lead`, `follow` or `sample`).

One process (the default) runs these threads and a pool of reward worker processes:
- the sampler loop (sampler slice) generates without pause and takes new weights between decode steps; a second
  thread detokenises finished answers and completes their futures;
- the reward service's dispatcher thread hands answers to the workers (processes) and completes their futures;
- the rollout thread runs the rollout controller's asyncio loop: each prompt group is one coroutine (generate G
  answers, await their rewards, hand the group to the `RolloutBuffer`, the owner of the staleness bound); with an
  agent, its episodes run there too;
- this thread is the learner (learner slice): B groups → PPO step → weights pushed device-to-device → the controller
  admits under the new version.

In a multi-process job (`roles.ProcessLayout`) the same code runs per role. The leader (learner process 0) keeps the
rollout controller, reward workers, rollout buffer, checkpoints and metrics, and drives the sampler processes through a
`SamplerHub` (requests and answers over authenticated connections, weights over `jax.experimental.transfer`).
Its learner is a `LearnerGroup`: other learner processes `follow` it step by step on their shards of one fsdp x tensor
mesh, and the leader's loop is the same for one learner process or many. Sampler processes `sample`
(`sampler_process.run_sampler`).

Resume order (a workdir with checkpoints is resumed automatically): 1. model config from the config; 2. parameters
and optimizer state of the latest checkpoint, straight onto the learner's shardings (`Learner.restore`); 3. learner
step and policy version; 4. dataset iterator position, then the prompts that were drawn but not yet trained on
(generated again first); 5. the next rollout group id (the sampling RNG is keyed by seed and group id);
6. metrics.jsonl, rollouts.jsonl and the TensorBoard events are cut back to the restored step (to nothing when there
is no checkpoint).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import jax
from etils import epath

from areal_jax import faults
from areal_jax import config as config_lib
from areal_jax.checkpoint.store import CheckpointMeta, Checkpointer, check_resumable
from areal_jax.data import build_dataset
from areal_jax.distributed import learner_group, sampler_process
from areal_jax.distributed.control import CONNECT_TIMEOUT_S, ControlServer, Peer, connect
from areal_jax.distributed.learner_group import LearnerGroup
from areal_jax.distributed.roles import ProcessLayout, authkey
from areal_jax.distributed.slices import MeshConfig, build_slices
from areal_jax.learner.learner import Learner
from areal_jax.models import lora, orbax_io
from areal_jax.reward import sandbox
from areal_jax.reward.config import RewardConfig
from areal_jax.rl import step_metrics
from areal_jax.rl.batches import save_batch
from areal_jax.rl.controller import Stalled
from areal_jax.rl.evaluation import heldout_jsonl
from areal_jax.rl.metrics import cut_logs
from areal_jax.run import initial_weights
from areal_jax.run.parts import LeaderParts, leader_parts
from areal_jax.sharding import make_mesh
from areal_jax.tokenizer import load_tokenizer


class _QuietLibraries(logging.Filter):
  """Keeps Orbax's per-save and the HTTP client's per-request (agents' episodes) INFO chatter out of the run's log
  (warnings and errors still show)."""

  def filter(self, record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING or not any(f"/{lib}/" in record.pathname for lib in ("orbax", "httpx2"))




def _learner_mesh(mesh: MeshConfig, layout: ProcessLayout):
  """(learner mesh, in-process sampler replicas' meshes or None): the device split of one process, or every learner
  process's devices in one fsdp x tensor mesh."""
  if layout.multi_process and mesh.colocated:
    raise config_lib.ConfigError("config.mesh.colocated=True: puts both roles on one process's devices; a "
                                 "multi-process job gives them processes of their own (set False)")
  if not layout.multi_process:
    try:
      slices = build_slices(mesh)
    except ValueError as e:
      raise config_lib.ConfigError(f"config.{e}") from e
    return slices.learner, slices.replicas
  try:
    return make_mesh(jax.devices(), mesh.learner_axes()), None
  except ValueError as e:
    raise config_lib.ConfigError(f"config.mesh.learner_tensor={mesh.learner_tensor}, mesh.learner_expert="
                                 f"{mesh.learner_expert}: {e}") from e


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
    learner_mesh, sampler_meshes = _learner_mesh(settings.mesh, layout)
    st = _prepare(config, settings, workdir, layout, learner_mesh, start_time, control, None)
    cut_logs(workdir, st.step if st.latest is not None else None)  # no checkpoint: the killed attempts' rows go too
    return _lead(workdir, layout, control, st, learner_mesh, sampler_meshes)
  finally:
    if control is not None:
      control.close()


def follow(config, workdir: str, layout: ProcessLayout) -> list[dict]:
  """A learner process other than the leader: the leader's steps on this process's shards
  (`learner_group.follow`)."""
  start_time, workdir, settings = _start(config, workdir, layout)
  leader = connect(layout, authkey(), timeout_s=CONNECT_TIMEOUT_S)
  try:
    learner_mesh, _ = _learner_mesh(settings.mesh, layout)
    st = _prepare(config, settings, workdir, layout, learner_mesh, start_time, None, leader)
    try:
      learner_group.follow(leader, st.learner, st.ckpt)
    finally:
      st.ckpt.close()
    return []
  finally:
    leader.close()


def sample(config, workdir: str, layout: ProcessLayout) -> list[dict]:
  """A sampler process: the engine on this process's devices, serving the leader (`sampler_process.run_sampler`)."""
  _, _, settings = _start(config, workdir, layout)
  sampler_process.run_sampler(settings, layout)
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


def _check_code_sandbox(reward: RewardConfig, datasets) -> None:
  """Code problems are scored in the sandbox the config names: refuse to start where the host cannot build it."""
  isolation = reward.code_isolation
  if isolation == "bwrap" and any(r.kind == "code" for d in datasets for r in d.records):
    try:
      sandbox.check_isolation()
    except sandbox.SandboxUnavailable as e:
      raise config_lib.ConfigError(f"config.reward.code_isolation={isolation!r}: {e}") from None


def _prepare(config, settings: config_lib.Settings, workdir: epath.Path, layout: ProcessLayout, learner_mesh,
             start_time: float, control: ControlServer | None, leader: Peer | None) -> _Start:
  """Data, model and learner; the run's directory (leader, which saves `config` there); the latest checkpoint
  restored, or the initial weights. A checkpoint the settings cannot resume is refused before the learner is built or
  anything is written."""
  tokenizer = load_tokenizer(settings.model_source.tokenizer)
  train = build_dataset(settings.data, tokenizer, split="train")
  evalset = build_dataset(settings.data, tokenizer, split="eval")
  logging.info("data: %d train prompts %s, %d eval prompts", len(train), train.stats, len(evalset))
  _check_code_sandbox(settings.reward, [train, evalset])
  model_cfg, learner_cfg = settings.model, settings.learner
  if model_cfg.vocab_size < tokenizer.vocab_size:
    raise config_lib.ConfigError(f"config.model.vocab_size={model_cfg.vocab_size}: smaller than the tokenizer's "
                                 f"{tokenizer.vocab_size} ids")
  ckpt = Checkpointer(str(workdir / "checkpoints"), every_steps=settings.checkpoint.every_steps,
                      max_to_keep=settings.checkpoint.max_to_keep)
  latest = ckpt.latest_step()
  where = f"checkpoint {latest} in {ckpt.directory}"
  followers = control.wait(range(1, layout.num_learners), timeout_s=CONNECT_TIMEOUT_S) if control else {}
  learner_group.agree_on_start(latest, followers=followers, leader=leader, where=where)
  if latest is not None:
    check_resumable(ckpt.read_meta(latest), model_cfg, learner_cfg.critic, where=where)
  learner = Learner(model_cfg=model_cfg, config=learner_cfg, mesh=learner_mesh,
                    temperature=settings.sampler.temperature, seed=settings.seed)
  logging.info("model: %s, %.2fM parameters", model_cfg.family, model_cfg.num_params() / 1e6)
  if layout.is_leader:  # the settings, data, model and checkpoints agree: the run's settings (a refusal keeps the old)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.json").write_text(config.to_json_best_effort(indent=2))
  step, controller_state = 0, None
  if latest is None or model_cfg.lora_rank:  # a LoRA checkpoint holds the adapters alone: the base first
    learner.params = initial_weights.initial_params(settings, learner, train, tokenizer, workdir)
  if latest is not None:
    meta = learner.restore(ckpt, latest)
    if meta.base is not None:
      lora.check_base(meta.base, learner.fns.split(learner.params)[1], where=where)
    if meta.controller is None:
      raise ValueError(f"{where}: its meta holds no rollout controller state (not written by a run's leader)")
    step, controller_state = meta.step, meta.controller
    start_time -= meta.elapsed_s  # time/elapsed_s goes on from the checkpoint's
    train.restore(controller_state["dataset"])
    logging.info("resumed %s at step %d (version %d)", workdir, step, learner.version)
  else:
    learner.opt_state = learner.fns.init_opt_state(learner.params)
    learner.init_critic()
  return _Start(tokenizer=tokenizer, train=train, evalset=evalset, settings=settings, learner=learner, ckpt=ckpt,
                latest=latest, step=step, controller_state=controller_state, start_time=start_time,
                followers=followers)


def _lead(workdir: epath.Path, layout: ProcessLayout, control: ControlServer | None, st: _Start, learner_mesh,
          sampler_meshes) -> list[dict]:
  """The leader: its parts built around the learner group, the loop (`_train`), then the end-of-run summary."""
  learners = LearnerGroup(st.learner, st.followers)
  local = learners.publish()  # the starting weights
  parts = leader_parts(str(workdir), st, layout, control, learners, local, learner_mesh, sampler_meshes)
  try:
    rows = _train(workdir, st, parts, local)
  finally:
    parts.stop()
    st.ckpt.close()
  # Finished (checkpoints written, workers stopped): the summary, printed by the leader alone, which runs this loop.
  parts.metrics.summarize((time.time() - st.start_time) / 60,
                          eval_path=heldout_jsonl(str(workdir), st.settings.data.eval_path, st.evalset.records))
  return rows


def _train(workdir: epath.Path, st: _Start, parts: LeaderParts, local) -> list[dict]:
  """The loop: a batch from the rollout buffer, one train step, the new weights published and admitted under, a
  metrics row, an evaluation and a checkpoint when due."""
  learner, controller, step, settings = st.learner, parts.controller, st.step, st.settings
  r, total_steps = settings.rollout, settings.total_steps
  save = _saver(workdir, st, parts.learners)
  rows, state, stalled = [], None, None
  if step == 0:
    rows.append({"step": 0, "version": 0, **parts.evaluator(local, version=0).metrics(),
                 "time/elapsed_s": time.time() - st.start_time})
    parts.metrics.write(0, rows[-1])
  controller.start()
  timer = step_metrics.Timer(parts.rollout.stats())
  while step < total_steps:
    wait_start = time.time()
    try:
      groups = controller.next_batch(r.batch_size, step, r.stall_timeout_s)
    except Stalled as e:
      stalled = e  # the last step's checkpoint first, below
      break
    trajectories = [t for g in groups for t in g.trajectories]
    if settings.metrics.save_batches:
      save_batch(str(workdir), step + 1, trajectories)
    busy_start = time.time()
    stats = parts.learners.train_step(step + 1, trajectories)
    step += 1
    controller.mark_trained(groups)
    sync_start = time.time()
    local = parts.learners.publish()
    parts.rollout.publish(local, learner.version)
    controller.admit(learner.version)  # the new version's capacity
    row = {"version": learner.version,
           **_row(parts, timer, stats, groups, trajectories, (wait_start, busy_start, sync_start)),
           "time/elapsed_s": time.time() - st.start_time}
    if step % settings.eval.every_steps == 0 or step == total_steps:
      row |= parts.evaluator(local, version=learner.version).metrics()
    parts.metrics.write(step, row)
    state, filtered = controller.snapshot()
    step_metrics.log_rollouts(workdir, step, learner.version, groups, filtered)
    rows.append({"step": step, **row})
    save(step, state)
  if step % settings.checkpoint.every_steps and state is not None:
    save(step, state, force=True)  # the last step, when not on the checkpoint schedule
  if stalled is not None:
    raise stalled
  return rows


def _row(parts: LeaderParts, timer: step_metrics.Timer, stats: dict, groups, trajectories,
         starts: tuple[float, float, float]) -> dict[str, float]:
  """A step's metrics beyond its version and time: the learner's, rewards, the sampler's work, rollout counters.
  `starts`: when the step began waiting for its batch, training, and publishing."""
  controller, rollout = parts.controller, parts.rollout
  wait_start, busy_start, sync_start = starts
  return {**step_metrics.step_metrics(stats, trajectories, controller.take_rewards()),
          **timer.tick(rollout.stats(), wait_start=wait_start, busy_start=busy_start, sync_start=sync_start),
          "rollout/queue_groups": len(parts.buffer),
          "rollout/groups_filtered": controller.counters["groups_filtered"],
          "rollout/reward_failures": controller.counters["reward_failures"],
          "rollout/regenerated_groups": controller.counters["regenerated_groups"],
          **step_metrics.agent_metrics(controller, groups), **rollout.sync_metrics(), **rollout.sampler_metrics()}


def _saver(workdir: epath.Path, st: _Start, learners: LearnerGroup) -> Callable[..., None]:
  """`save(step, controller_state, force=False)`: the checkpoint of every learner process, on the schedule or forced,
  with the leader's meta. Under LoRA it holds the adapters alone and names the base they adapt."""
  learner = st.learner
  base = None
  if st.settings.model.lora_rank:
    base = lora.base_meta(initial_weights.base_source(st.settings, workdir), learner.fns.split(learner.params)[1])

  def save(step: int, controller_state: dict, force: bool = False) -> None:
    meta = CheckpointMeta(step=step, version=learner.version, updates=learner.updates, controller=controller_state,
                          elapsed_s=time.time() - st.start_time,
                          model_config=orbax_io.config_to_json(st.settings.model), critic=learner.config.critic,
                          base=base)
    if learners.save(st.ckpt, step, meta=meta, force=force):
      faults.reach("checkpoint_write")  # the asynchronous write is in flight

  return save


