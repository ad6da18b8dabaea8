"""A run in virtual time: the project's own orchestration with device calls that cost predicted seconds.

Shared with a real run, unchanged: `RolloutBuffer` (η, target staleness), `RolloutController` (admission, one
coroutine per prompt group, its rewards), `Sampler`/`Scheduler` (the pieces of the sampler's loop, driven here on the
virtual clock by `_drive`: slots, pages, preemption, the weight swap with its re-prefill) and `Engine`'s host side.
Simulated: the engine's programs (`engine.SimEngine`), the reward service (an answer is right with probability
`success`, or a recorded group is replayed whole; scored after `reward_s`), and the learner, whose loop below follows
`run/trainer.py:_train` (a batch from the buffer, a train step, the weights published, the new version admitted) with
a step and a transfer that sleep their predicted seconds. The sampler side is `Job.engines` independent engines
(replicas of one process, or sampler processes), each its own `Sampler` and scheduler, a group going whole to the
least loaded one (`dispatch.Dispatcher` over `dispatch.Outstanding`, the rule and accounting `LocalRollout` and
`SamplerHub` apply). Everything runs on one virtual-time loop (`clock.virtual_loop`), so a simulated hour takes seconds
and the same inputs give the same timeline.

    result = simulate(job, costs, lengths)
    result.tokens_per_s(), result.staleness_of(), result.busy()
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses

import numpy as np

from areal_jax.data.records import PromptRecord
from areal_jax.distributed.replicas import summed_stats
from areal_jax.models.config import ModelConfig
from areal_jax.reward.service import RewardResult
from areal_jax.rl.controller import RolloutController, Stalled
from areal_jax.rl.rollout_buffer import RolloutBuffer
from areal_jax.sampler import dispatch
from areal_jax.sampler.config import SamplerConfig
from areal_jax.sampler.dispatch import Outstanding
from areal_jax.sampler.requests import SamplingParams
from areal_jax.sampler.sampler import Sampler
from areal_jax.sampler.sampling import request_key
from areal_jax.sim.clock import virtual_loop
from areal_jax.sim.costs import CostModel
from areal_jax.sim.engine import SimEngine
from areal_jax.sim.lengths import Lengths, RecordedGroups

EOS = 0
_STALL_GROUPS = 100


@dataclasses.dataclass(frozen=True, kw_only=True)
class Job:
  """One simulated run: the model and sampler (real tokens), the batch (`batch_prompts` x `answers`), η and the
  target staleness, and what the rewards look like."""

  model: ModelConfig
  sampler: SamplerConfig  # one engine's: num_slots counts the slots of one engine's mesh, as in a run
  num_shards: int  # data shards of one engine
  batch_prompts: int
  answers: int
  prompt_len: int
  eta: int
  steps: int
  target_staleness: float | None = None
  max_concurrent: int = 0  # rollout.max_concurrent_rollouts; 0 = no limit beyond η
  success: float = 0.5  # chance an answer is right
  recorded: RecordedGroups | None = None  # each group replays a recorded one's lengths and rewards (not success)
  filter_uniform: bool = False
  reward_s: float = 0.0  # seconds to score an answer
  reward_workers: int = 1  # reward.num_workers
  scale: int = 1  # real tokens per simulated one (engine.SimEngine)
  seed: int = 0
  engines: int = 1  # independent sampler engines (mesh.sampler_replicas x sampler processes)

  def __post_init__(self):
    if self.engines < 1 or self.num_shards < 1:
      raise ValueError(f"Job: engines={self.engines} and num_shards={self.num_shards} must be >= 1")


@dataclasses.dataclass
class Result:
  """Per learner step: when it ended, its answers' real tokens and staleness; busy seconds at each step's end."""

  job: Job
  step_end: list[float] = dataclasses.field(default_factory=list)
  tokens: list[int] = dataclasses.field(default_factory=list)  # answer tokens trained
  answers: list[int] = dataclasses.field(default_factory=list)
  staleness: list[list[int]] = dataclasses.field(default_factory=list)  # per trajectory, as the learner counts it
  group_ids: list[list[int]] = dataclasses.field(default_factory=list)  # per trajectory, its group's id
  sampler_busy: list[float] = dataclasses.field(default_factory=list)
  learner_busy: list[float] = dataclasses.field(default_factory=list)
  sync_s: list[float] = dataclasses.field(default_factory=list)  # per step: what the learner waited for its publish
  start: float = 0.0  # when step 1's batch was first awaited (after the starting evaluation: t = 0)
  sampler_stats: dict = dataclasses.field(default_factory=dict)  # the driver's counters at the end, summed
  engine_tokens: list[float] = dataclasses.field(default_factory=list)  # tokens each engine drew, at the end

  def _window(self, warmup: int) -> tuple[int, float]:
    w = min(warmup, len(self.step_end) - 1)
    return w, self.step_end[-1] - (self.step_end[w - 1] if w else self.start)

  def tokens_per_s(self, warmup: int = 2) -> float:
    w, seconds = self._window(warmup)
    return sum(self.tokens[w:]) / seconds

  def answers_per_s(self, warmup: int = 2) -> float:
    w, seconds = self._window(warmup)
    return sum(self.answers[w:]) / seconds

  def step_s(self, warmup: int = 2) -> float:
    w, seconds = self._window(warmup)
    return seconds / (len(self.step_end) - w)

  def busy(self, warmup: int = 2) -> tuple[float, float]:
    """(sampler, learner) seconds busy over the timed window."""
    w, seconds = self._window(warmup)
    before = lambda xs: xs[w - 1] if w else 0.0
    return ((self.sampler_busy[-1] - before(self.sampler_busy)) / seconds,
            (self.learner_busy[-1] - before(self.learner_busy)) / seconds)

  def sync_share(self, warmup: int = 2) -> float:
    """The share of the timed window the learner spent waiting on its weight publishes."""
    w, seconds = self._window(warmup)
    return sum(self.sync_s[w:]) / seconds

  def staleness_of(self, warmup: int = 2) -> np.ndarray:
    w = min(warmup, len(self.staleness) - 1)
    return np.array([s for step in self.staleness[w:] for s in step], np.float64)


def simulate(job: Job, costs: CostModel, lengths: Lengths | None = None) -> Result:
  """Runs `job` to its last learner step on a virtual clock; see the module docstring. Answer lengths come from
  `lengths`, or from `job.recorded`."""
  if (lengths is None) == (job.recorded is None):
    raise ValueError("simulate: give answer lengths or Job.recorded, not both or neither")
  loop = virtual_loop()
  try:
    return loop.run_until_complete(_run(job, costs, lengths))
  finally:
    loop.close()


class _OnLoop:
  """`AsyncThread`'s interface on the running loop: the simulator has one thread."""

  def __init__(self, loop: asyncio.AbstractEventLoop):
    self.loop = loop

  def submit(self, coro):
    return self.loop.create_task(coro)

  def call(self, fn, *args) -> None:
    self.loop.call_soon(fn, *args)

  def stop(self) -> None:
    pass


class _Buffer(RolloutBuffer):
  """The run's buffer, telling the simulated learner when a group finished."""

  def __init__(self, changed: asyncio.Event, **kw):
    super().__init__(**kw)
    self.changed = changed

  def finish(self, group_id: int, group=None, *, version: int = 0) -> None:
    super().finish(group_id, group, version=version)
    self.changed.set()


class _Rollout:
  """The controller's samplers: `Sampler`s driven on the virtual clock (`_drive`), never started; a group goes whole
  to one, by `LocalRollout`'s rule and accounting (`dispatch.Dispatcher` over each sampler's `dispatch.Outstanding`:
  an episode's turns where its last went, else the fewest tokens of work outstanding)."""

  def __init__(self, samplers: list[Sampler], replay: _Replay | None):
    self.samplers, self.replay = samplers, replay
    self.wakes = [asyncio.Event() for _ in samplers]
    self.outstanding = [Outstanding() for _ in samplers]
    self.dispatcher = dispatch.Dispatcher()

  def submit(self, request):
    if self.replay is not None:
      self.replay.register(request)
    loads = {i: self.outstanding[i].load(sum(s.engine.slots.free_pages(k) for k in range(s.engine.num_shards)))
             for i, s in enumerate(self.samplers)}
    i = self.dispatcher.choose(request, loads)
    self.outstanding[i].add(request)
    futures = self.samplers[i].submit(request)
    for f in futures:
      f.add_done_callback(lambda _, i=i: self.outstanding[i].answered(request.group_id))
    self.wakes[i].set()
    return futures

  def publish(self, version: int) -> None:
    for sampler, wake in zip(self.samplers, self.wakes):
      sampler.update_params({}, version)
      wake.set()

  def check(self) -> None:
    for sampler in self.samplers:
      sampler.check()

  def stats(self) -> dict[str, float]:
    return summed_stats([s.stats() for s in self.samplers])


async def _drive(sampler: Sampler, engine: SimEngine, wake: asyncio.Event, busy: _Busy) -> None:
  """A sampler's loop in virtual time, made of the pieces its wall-clock loop steps (`take`, `step`, `record`,
  `account`): a decode call lasts what the cost model charged for it (busy while it runs), its results recorded once
  it has run or, with `sampler.overlap` (the previous call's), while it runs; an idle sampler waits until the rollout
  wakes it (a request, new weights). An error fails the sampler's open futures and ends the task with it; a cancel
  ends them as a stop."""
  loop = asyncio.get_running_loop()

  async def device() -> None:
    spent = engine.take_spent()
    busy.add(spent)
    await asyncio.sleep(spent)

  try:
    while True:
      sampler.take(block=False)
      if sampler.idle:
        wake.clear()
        await wake.wait()
        continue
      start = loop.time()
      finished = sampler.step()
      overlap = sampler.scheduler.overlap
      if not overlap:
        await device()
      sampler.record(finished)
      if overlap:
        await device()
      sampler.account(loop.time() - start)
  except asyncio.CancelledError:  # the run ended
    sampler.stop()
    raise
  except BaseException as e:  # pylint: disable=broad-except  # surfaced by sampler.check() and the task
    sampler.fail(e)
    raise


class _Replay:
  """`Job.recorded` replayed: group g takes the recorded group its id draws, whole. Its answers' lengths are
  registered by their PRNG keys when the group is submitted (the engine knows an answer only by its key)."""

  def __init__(self, recorded: RecordedGroups, seed: int):
    self.groups, self.by_id, self.seed = recorded.groups, recorded.by_id, seed
    self.by_key: dict[tuple[int, int], int] = {}

  def pick(self, group_id: int) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """The run's own group `group_id` where it was recorded, else the recorded group that `group_id` draws."""
    i = self.by_id.get(group_id)
    return self.groups[i if i is not None else int(request_key(self.seed + 2, group_id)[1]) % len(self.groups)]

  def register(self, request) -> None:
    lengths, _ = self.pick(request.group_id)
    for i in range(request.num_answers):
      key = request_key(request.sampling.seed, request.group_id, i)
      self.by_key[int(key[0]), int(key[1])] = lengths[i % len(lengths)]

  def lengths(self, keys: np.ndarray) -> np.ndarray:
    keys = np.asarray(keys)
    flat = [self.by_key.get((int(a), int(b)), 1) for a, b in keys.reshape(-1, 2)]  # padding rows: 1
    return np.array(flat, np.int64).reshape(keys.shape[:-1])

  def reward(self, group_id: int, index: int) -> float:
    _, rewards = self.pick(group_id)
    return rewards[index % len(rewards)]


class _Rewards:
  """The reward service: answer i of group g is right with chance `success` (or replays its recorded reward);
  everything fixed by the seed. Its `reward_workers` score answers in the order they come, `reward_s` each."""

  def __init__(self, loop: asyncio.AbstractEventLoop, job: Job, replay: _Replay | None):
    self.loop, self.latency_s, self.seed, self.success, self.replay = loop, job.reward_s, job.seed, job.success, replay
    self.free_at = [0.0] * job.reward_workers

  def _reward(self, group: int, index: int, turn: int = 0) -> float:
    del turn  # one turn per answer here
    if self.replay is not None:
      return self.replay.reward(group, index)
    u = int(request_key(self.seed + 1, group, index)[1]) / 2**32  # [0] is the seed itself
    return float(u < self.success)

  def submit(self, item_id, kind, text, reference) -> concurrent.futures.Future:
    del kind, text, reference
    future = concurrent.futures.Future()
    now = self.loop.time()
    w = int(np.argmin(self.free_at))
    done = self.free_at[w] = max(now, self.free_at[w]) + self.latency_s
    result = RewardResult(item_id=item_id, reward=self._reward(*item_id), reason="simulated",
                          latency_s=done - now, run_s=self.latency_s)
    if done > now:
      self.loop.call_at(done, future.set_result, result)
    else:  # in submission order (timers due at one instant may fire in any order)
      self.loop.call_soon(future.set_result, result)
    return future


def _prompts(job: Job):
  n = max(1, -(-job.prompt_len // job.scale))
  i = 0
  while True:
    yield PromptRecord(uid=f"sim-{i}", prompt="", prompt_ids=np.full(n, 2, np.int32), reference="")
    i += 1


class _Busy:
  """Seconds a serial worker has been busy: each piece of work counted as it elapses, not when it starts."""

  def __init__(self, loop: asyncio.AbstractEventLoop):
    self.loop, self.total, self.until = loop, 0.0, 0.0

  def add(self, seconds: float) -> None:
    self.total += seconds
    self.until = self.loop.time() + seconds

  def now(self) -> float:
    return self.total - max(0.0, self.until - self.loop.time())


async def _run(job: Job, costs: CostModel, lengths: Lengths | None) -> Result:
  loop = asyncio.get_running_loop()
  replay = _Replay(job.recorded, job.seed) if job.recorded is not None else None
  engines = [SimEngine(model_cfg=job.model, cfg=job.sampler, num_shards=job.num_shards,
                       pages_per_shard=costs.pages_per_shard(job.sampler.page_size, job.sampler.memory_fraction),
                       costs=costs, lengths=replay.lengths if replay else lengths, eos_id=EOS, scale=job.scale,
                       seed=(job.seed, i))
             for i in range(job.engines)]
  rollout = _Rollout([Sampler(engine=e, params={}, version=0, eos_ids=[EOS], warmup=False, name=f"sampler{i}")
                      for i, e in enumerate(engines)], replay)
  changed = asyncio.Event()
  b = job.batch_prompts
  buffer = _Buffer(changed, batch_size=b, max_offpolicyness=job.eta, target_staleness=job.target_staleness,
                   max_concurrent=job.max_concurrent or (job.eta + 1) * b)
  sampling = SamplingParams(max_new_tokens=engines[0].cfg.max_new_tokens, seed=job.seed)
  controller = RolloutController(dataset=_prompts(job), rollout=rollout, rewards=_Rewards(loop, job, replay),
                                 buffer=buffer, version=0, group_size=job.answers, sampling=sampling,
                                 filter_uniform=job.filter_uniform, thread=_OnLoop(loop))
  result, busy = Result(job=job), [_Busy(loop) for _ in engines]
  samplers = [loop.create_task(_drive(s, e, wake, b))
              for s, e, wake, b in zip(rollout.samplers, engines, rollout.wakes, busy)]
  controller.start()
  version, learner_busy, in_flight = 0, 0.0, None
  try:
    for _ in range(job.steps):
      groups = await _next_batch(controller, buffer, rollout, samplers, b)
      trajectories = [t for g in groups for t in g.trajectories]
      seconds = costs.train_step(np.array([(len(t.prompt_ids) + len(t.response_ids)) * job.scale
                                           for t in trajectories]))
      result.staleness.append([version - t.version_start for t in trajectories])
      result.group_ids.append([t.group_id for t in trajectories])
      await asyncio.sleep(seconds)
      controller.mark_trained(groups)
      transfer = costs.transfer()
      version += 1
      if costs.transfer_overlaps:  # sync.overlap: the pull runs beside the next step, one version in flight
        waited = loop.time()
        if in_flight is not None:
          await in_flight
        waited = loop.time() - waited
        in_flight = loop.create_task(_publish_after(transfer, rollout, version))
      else:
        await asyncio.sleep(transfer)  # the learner's publish: the sampler swaps at its next step
        rollout.publish(version)
        waited = transfer
      after = costs.after_step()  # the host's work before it awaits the next batch (the evaluation)
      if costs.colocated:  # on the sampler's chips too: they would share them, so it goes before generation resumes
        await asyncio.sleep(after)
      controller.admit(version)
      learner_busy += seconds + waited
      result.sync_s.append(waited)
      result.step_end.append(loop.time())
      result.tokens.append(sum(len(t.response_ids) for t in trajectories) * job.scale)
      result.answers.append(len(trajectories))
      result.sampler_busy.append(sum(x.now() for x in busy) / len(busy))  # the engines' mean
      result.learner_busy.append(learner_busy)
      if not costs.colocated:
        await asyncio.sleep(after)
    result.sampler_stats = rollout.stats()
    result.engine_tokens = [float(x.stats()["tokens"]) for x in rollout.samplers]
  finally:
    controller.stop()
    for task in samplers:
      task.cancel()
    await asyncio.gather(*(t for t in asyncio.all_tasks() if t is not asyncio.current_task()),
                         return_exceptions=True)
  return result


async def _publish_after(seconds: float, rollout, version: int) -> None:
  await asyncio.sleep(seconds)
  rollout.publish(version)


async def _next_batch(controller, buffer: _Buffer, rollout: _Rollout, samplers: list[asyncio.Task], n: int) -> list:
  """`RolloutController.next_batch` on the virtual clock: waits for a group to finish instead of polling; raises
  `Stalled` when `_STALL_GROUPS` x n groups in a row were dropped as uniform."""
  accepted, filtered = buffer.accepted, controller.counters["groups_filtered"]
  while True:
    buffer.changed.clear()
    groups = buffer.take_batch(n, controller.version, timeout=0)
    if groups is not None:
      return groups
    controller.check()
    rollout.check()
    for task in samplers:
      if task.done():
        task.result()  # its error
    if buffer.accepted != accepted:
      accepted, filtered = buffer.accepted, controller.counters["groups_filtered"]
    elif controller.counters["groups_filtered"] - filtered > _STALL_GROUPS * n:
      raise Stalled(f"the last {_STALL_GROUPS * n} groups all scored uniformly and were dropped: no batch can form "
                    "(the success rates are all 0 or 1?)")
    await buffer.changed.wait()
