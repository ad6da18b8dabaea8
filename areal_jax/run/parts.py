"""The leader's running parts around its learner group: the samplers (in process or sampler processes), reward
workers, the rollout buffer and controller (with an agent's episode runner), the evaluator and the metrics writer;
built from the run's typed settings and the learner's starting state (`leader_parts`), stopped together."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
from absl import logging
from flax import nnx

from areal_jax import agents
from areal_jax.distributed.control import CONNECT_TIMEOUT_S, ControlServer
from areal_jax.distributed.learner_group import LearnerGroup
from areal_jax.distributed.replicas import LocalRollout
from areal_jax.distributed.roles import ProcessLayout
from areal_jax.distributed.sampler_hub import SamplerHub
from areal_jax.distributed.slices import MeshConfig
from areal_jax.distributed.weight_transfer import WeightPublisher
from areal_jax.learner.learner import Learner
from areal_jax.models import weights
from areal_jax.reward.service import RewardService, score_all
from areal_jax.rl.controller import RolloutController
from areal_jax.rl import workflows
from areal_jax.rl.workflows import problem
from areal_jax.rl.evaluation import EpisodeEvaluator, Evaluator
from areal_jax.rl.metrics import MetricsWriter
from areal_jax.rl.rollout import Rollout
from areal_jax.rl.rollout_buffer import RolloutBuffer
from areal_jax.rl.run_config import SyncConfig
from areal_jax.sampler.config import SamplerConfig
from areal_jax.sampler.engine import free_device_bytes
from areal_jax.sharding import make_mesh


@dataclasses.dataclass
class LeaderParts:
  """The leader's running parts, built once and stopped together."""

  learners: LearnerGroup
  rollout: Rollout
  rewards: RewardService
  buffer: RolloutBuffer
  controller: RolloutController
  evaluator: Callable[..., Any]
  metrics: MetricsWriter

  def stop(self) -> None:
    self.learners.stop()
    self.controller.stop()
    if self.controller.episodes is not None:
      self.controller.episodes.stop()
    self.rollout.stop()
    self.rewards.close()
    self.metrics.close()


def leader_parts(workdir: str, st, layout: ProcessLayout, control: ControlServer | None, learners: LearnerGroup,
                 local, learner_mesh, sampler_meshes) -> LeaderParts:
  """Everything the leader's loop drives, the samplers holding `local` (the learner's starting weights). `st` is the
  trainer's start state: data, tokenizer, settings, learner, the checkpoint's controller state."""
  settings = st.settings
  learner_local = [d for d in learner_mesh.devices.flat if d.process_index == jax.process_index()]
  sampler_cfg = settings.sampler.for_tokenizer(st.tokenizer.vocab_size)
  rollout = _start_rollout(settings.mesh, settings.sync, layout, control, sampler_cfg, st.learner, local,
                           sampler_meshes, learner_local, st.tokenizer)
  rewards = RewardService.from_config(settings.reward)
  buffer = RolloutBuffer.from_config(settings.rollout, version=st.learner.version)
  controller = _controller(st, rollout, rewards, buffer)
  return LeaderParts(learners=learners, rollout=rollout, rewards=rewards, buffer=buffer, controller=controller,
                     evaluator=_evaluator(st, controller, sampler_cfg, learner_local, rewards),
                     metrics=MetricsWriter(workdir, total_steps=settings.total_steps,
                                           tensorboard=settings.metrics.tensorboard))


def _controller(st, rollout: Rollout, rewards: RewardService, buffer: RolloutBuffer) -> RolloutController:
  """The rollout controller, continuing from the checkpoint's state (undone prompts first, group ids on)."""
  settings, state = st.settings, st.controller_state
  by_uid = {rec.uid: rec for rec in st.train.records}
  sampling = settings.sampler.sampling(seed=settings.seed)
  episodes = None
  if settings.agent.path:
    episodes = agents.EpisodeRunner(
        agent=settings.agent.load(), config=settings.agent, rollout=rollout, tokenizer=st.tokenizer,
        sampling=sampling, version=lambda: controller.version,
        limits={"max_seq_len": settings.sampler.max_seq_len, "vocab_size": settings.model.vocab_size})
  r = settings.rollout
  turns = workflows.Turns(tokenizer=st.tokenizer, template=settings.data.prompt_template,
                          max_prompt_len=settings.sampler.max_seq_len - 1, max_turns=r.max_turns,
                          discount=r.turn_discount)
  controller = RolloutController(
      dataset=st.train, rollout=rollout, rewards=rewards, buffer=buffer, version=st.learner.version,
      group_size=r.group_size, sampling=sampling, filter_uniform=settings.learner.filter_uniform_groups,
      next_group_id=state["next_group_id"] if state else 0,
      replay=[by_uid[u] for u in state["undone"]] if state else (),
      workflow=workflows.resolve(settings.workflow), turns=turns, episodes=episodes)
  return controller


def _evaluator(st, controller: RolloutController, sampler_cfg: SamplerConfig, learner_local,
               rewards: RewardService) -> Evaluator | EpisodeEvaluator:
  """With an agent, its episodes on the eval problems; else evaluation on the leader's learner devices (a data x
  tensor mesh), scored by the run's reward workers."""
  settings = st.settings
  if controller.episodes is not None:
    return EpisodeEvaluator(runner=controller.episodes, problems=[problem(r) for r in st.evalset.records],
                            num_samples=settings.eval.num_samples)
  return Evaluator(model_cfg=settings.model, records=st.evalset.records,
                   mesh=make_mesh(learner_local, {"data": -1, "expert": settings.mesh.learner_expert,
                                                  "tensor": settings.mesh.learner_tensor}),
                   sampler_cfg=sampler_cfg.replace(num_pages=0, memory_fraction=0.5), eos_ids=[st.tokenizer.eos_id],
                   detokenize=st.tokenizer.decode, score=functools.partial(score_all, rewards),
                   num_samples=settings.eval.num_samples, temperature=settings.eval.temperature, seed=settings.seed)


def learner_reserve(learner: Learner, sampler_cfg: SamplerConfig, sampler_meshes) -> int:
  """Per device, what a sampler sharing the learner's devices (`mesh.colocated`) leaves free beside its KV pool:
  the learner step's working memory (`Learner.working_bytes`), where the pool is sized from the devices' free memory
  (sampler.num_pages = 0, on devices that report their memory: not a CPU, whose pool comes from the host's). Else 0."""
  shared = {d.id for d in learner.mesh.devices.flat} & {d.id for m in sampler_meshes for d in m.devices.flat}
  sized_from_free = not sampler_cfg.num_pages and free_device_bytes(sampler_meshes[0].devices.flat[0]) is not None
  if not (shared and sized_from_free):
    return 0
  reserve = learner.working_bytes()
  logging.info("colocated: the KV pool leaves %.2f GiB per device for the learner's step", reserve / 2**30)
  return reserve


def _start_rollout(mesh: MeshConfig, sync: SyncConfig, layout: ProcessLayout, control: ControlServer | None,
                   sampler_cfg: SamplerConfig, learner: Learner, local, sampler_meshes, learner_local,
                   tokenizer) -> Rollout:
  """The samplers, holding the learner's current weights: a `SamplerHub` over the sampler processes of a
  multi-process job (their model copies `mesh.sampler_expert` x `mesh.sampler_tensor` devices), else a `LocalRollout` on this process's sampler slice."""
  if not layout.multi_process:
    abstract_model = nnx.eval_shape(lambda: nnx.merge(learner.fns.graphdef, learner.fns.abstract_params))
    return LocalRollout(abstract_model=abstract_model, config=sampler_cfg, meshes=sampler_meshes, params=local,
                        version=learner.version, eos_ids=[tokenizer.eos_id], detokenize=tokenizer.decode,
                        reserved_bytes=learner_reserve(learner, sampler_cfg, sampler_meshes))
  publisher = WeightPublisher(abstract_params=weights.with_dtype(learner.fns.abstract_params, sampler_cfg.weight_dtype),
                              tensor=mesh.sampler_tensor, expert=mesh.sampler_expert, devices=learner_local,
                              host=layout.host)
  peers = control.wait(range(layout.num_learners, layout.num_processes), timeout_s=CONNECT_TIMEOUT_S)
  hub = SamplerHub(peers=peers, publisher=publisher, heartbeat_s=mesh.sampler_heartbeat_s, delta=sync.delta,
                   overlap=sync.overlap).start()
  hub.publish(local, learner.version)
  control.on_sampler(hub.join)  # samplers that restart, or more of them, join the running job
  return hub
