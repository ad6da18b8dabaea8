"""Episode workflows through the rollout controller, with a scripted sampler and verifier: `multi_turn_math`'s
follow-up turn, a workflow of one's own, and how `rollout.workflow` is resolved and checked."""

import asyncio
import collections
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pytest

from areal_jax import config as config_lib
from areal_jax.data import prompts
from areal_jax.data.dataset import PromptDataset
from areal_jax.data.records import PromptRecord
from areal_jax.errors import ConfigError
from areal_jax.reward.service import RewardResult
from areal_jax.rl import workflows
from areal_jax.rl.controller import RolloutController
from areal_jax.rl.rollout_buffer import RolloutBuffer
from areal_jax.sampler.requests import SamplingParams
from areal_jax.tokenizer import CharTokenizer, load_tokenizer
from areal_jax.types import Trajectory
from helpers import write_bpe_tokenizer

TOK = CharTokenizer()
G = 2


class ScriptedSampler:
  """Answers "x=9<eos>" to a prompt without a follow-up turn and "x=7<eos>" to one with it (the reference is 7)."""

  def __init__(self):
    self.requests = []
    self._lock = threading.Lock()

  def submit(self, request):
    with self._lock:
      self.requests.append(request)
    second = "try again" in TOK.decode(request.prompt_ids)
    ids = np.array(TOK.encode("x=7" if second else "x=9") + [TOK.eos_id], np.int32)
    out = []
    for i in range(request.num_answers):
      f = Future()
      f.set_result(Trajectory(prompt_ids=request.prompt_ids, response_ids=ids, logprobs=np.full(len(ids), -0.5, np.float32),
                              versions=np.full(len(ids), 3, np.int32), finish_reason="eos", group_id=request.group_id,
                              response_text=TOK.decode(ids)))
      out.append(f)
    return out

  def check(self):
    pass


class Verifier:
  """Right when the answer is "x=7", in a thread of its own as the reward service scores."""

  def __init__(self):
    self._pool = ThreadPoolExecutor(1)
    self.items = []

  def submit(self, key, kind, completion, reference):
    self.items.append(key)
    ok = completion.endswith("=" + reference)
    return self._pool.submit(lambda: RewardResult(item_id=key, reward=float(ok), reason="correct" if ok else
                                                  "wrong answer", latency_s=0.0, run_s=0.0))


def _record(i: int = 0) -> PromptRecord:
  prompt = f"Q: {i}+7-{i}\nA: "
  return PromptRecord(uid=f"p{i}", prompt=prompt, prompt_ids=np.array(TOK.encode(prompt), np.int32), reference="7")


def _groups(workflow, n=2, turns=workflows.Turns(tokenizer=TOK, max_turns=2, discount=0.9), sampler=None):
  sampler = sampler or ScriptedSampler()
  buffer = RolloutBuffer(batch_size=n, max_offpolicyness=1, max_concurrent=n)
  ctl = RolloutController(dataset=PromptDataset([_record(i) for i in range(8)], seed=0), rollout=sampler,
                          rewards=Verifier(), buffer=buffer, version=0, group_size=G, sampling=SamplingParams(),
                          filter_uniform=False, workflow=workflow, turns=turns).start()
  try:
    return ctl.next_batch(n, 0, stall_timeout_s=30), sampler  # raises what stopped the controller
  finally:
    ctl.stop()


def test_multi_turn_math_answers_a_wrong_answer_with_feedback_and_trains_both_answers():
  batch, sampler = _groups(workflows.multi_turn_math)
  for group in batch:
    gid = group.trajectories[0].group_id
    assert group.turns == (2,) * G and len(group.trajectories) == G  # both turns merged into one sequence each
    first = TOK.encode("x=9") + [TOK.eos_id]
    feedback = TOK.encode(prompts.follow_up(workflows.feedback("wrong answer"), TOK, "plain", ended=True))
    second = TOK.encode("x=7") + [TOK.eos_id]
    for t in group.trajectories:
      assert t.group_id == gid
      np.testing.assert_array_equal(t.prompt_ids, group.record.prompt_ids)
      np.testing.assert_array_equal(t.response_ids, first + feedback + second)
      np.testing.assert_array_equal(t.loss_mask, [1] * len(first) + [0] * len(feedback) + [1] * len(second))
      np.testing.assert_array_equal(t.logprobs[len(first):-len(second)], 0)  # context, not drawn
      assert t.reward == pytest.approx(0.9)  # right on the second try: turn_discount ** 1
    assert "Q: wrong answer. check your work and try again.\nA: " in TOK.decode(t.response_ids)
  # One request per try: the group's first tries under their own streams (ids apart from the group's own).
  gids = {g.trajectories[0].group_id for g in batch}
  ids = [r.group_id for r in sampler.requests if r.group_id % (1 << 44) in gids]
  assert len(ids) == len(set(ids)) == 2 * G * len(batch) and not gids & set(ids)
  assert all(r.num_answers == 1 for r in sampler.requests)
  # Each episode's two tries carry its name (`Request.episode`), so they go to one sampler replica.
  episodes = collections.Counter(r.episode for r in sampler.requests if r.group_id % (1 << 44) in gids)
  assert episodes == {f"{g}/{i}": 2 for g in gids for i in range(G)}


def test_multi_turn_math_stops_when_a_follow_up_would_not_fit():
  record = _record()
  turns = workflows.Turns(tokenizer=TOK, max_turns=3, discount=0.9, max_prompt_len=len(record.prompt_ids) + 8)
  batch, _ = _groups(workflows.multi_turn_math, turns=turns)
  for group in batch:
    assert group.turns == (1,) * G and all(t.reward == 0 and t.loss_mask is None for t in group.trajectories)


async def best_of_two(sampler: workflows.GroupSampler, item: PromptRecord) -> workflows.Episodes:
  """A workflow of one's own: G answers, each rewarded 1 when it is right or the group's other answer is."""
  trajs = await asyncio.gather(*sampler.generate(item.prompt_ids))
  verdicts = await asyncio.gather(*(sampler.verify(item, t.response_text, index=i) for i, t in enumerate(trajs)))
  best = max(v.reward for v in verdicts)
  return workflows.Episodes(trajectories=tuple(t.replace(reward=best) for t in trajs), rewards=(best,) * len(trajs))


def test_a_workflow_of_ones_own_by_path_runs_in_the_controller():
  fn = workflows.resolve(f"{__name__}:best_of_two")
  assert fn is best_of_two
  batch, sampler = _groups(fn)
  assert [r.group_id for r in sampler.requests][:len(batch)] == sorted(g.trajectories[0].group_id for g in batch)
  assert all(len(g.trajectories) == G and g.turns == () for g in batch)


def test_a_workflow_that_returns_something_else_stops_the_controller_naming_it():
  async def bad(sampler, item):
    return [1, 2]

  with pytest.raises(RuntimeError) as e:
    _groups(bad)
  assert "'bad' returned list, not workflows.Episodes" in str(e.value.__cause__)


@pytest.mark.parametrize("spec, why", [
    ("nope", "choose one of ['agent', 'multi_turn_math', 'rlvr']"),
    ("no_such_module_x:fn", "cannot load it (ModuleNotFoundError"),
    ("areal_jax.rl.workflows:problem", "must be an `async def episode(sampler, item)`"),
])
def test_bad_workflows_are_named(spec, why):
  with pytest.raises(ValueError, match=r"rollout.workflow=") as e:
    workflows.resolve(spec)
  assert why in str(e.value)


def test_the_config_names_a_bad_workflow_and_the_agent_workflow_without_an_agent():
  with pytest.raises(ConfigError, match="config.rollout.workflow='nope'"):
    config_lib.validate(config_lib.load_config("configs/math.py:tiny", **{"rollout.workflow": "nope"}), data=False)
  with pytest.raises(ConfigError, match="rollout.workflow='agent'.*set it"):
    config_lib.validate(config_lib.load_config("configs/math.py:tiny", **{"rollout.workflow": "agent"}), data=False)
  settings = config_lib.validate(config_lib.load_config("configs/math.py:tiny"), data=False)
  assert settings.workflow == "rlvr"


def test_a_chat_template_follow_up_continues_after_the_drawn_end_of_turn(tmp_path):
  tok = load_tokenizer(write_bpe_tokenizer(str(tmp_path), ["what is 2+2? it is 4. wrong answer, try again."]))
  after = prompts.follow_up("wrong answer", tok, "chat", ended=True)
  chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
  drawn = tok.apply_chat_template(chat[:1]) + "a" + "<|im_end|>"  # the answer's tokens end with the end-of-turn
  assert drawn + after == tok.apply_chat_template(chat + [{"role": "user", "content": "wrong answer"}])
  assert prompts.follow_up("x", tok, "chat", ended=False).startswith("<|im_end|>")


def test_the_docs_workflow_example_runs_in_the_controller():
  """docs/objectives.md's "Adding a workflow" sketch, as written there."""
  with open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "objectives.md")) as f:
    page = f.read()
  code = page.split("### Adding a workflow", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
  namespace = {}
  exec(compile(code, "docs/objectives.md", "exec"), namespace)  # pylint: disable=exec-used
  batch, sampler = _groups(namespace["self_check"])
  assert all(len(g.trajectories) == G for g in batch)
  assert len(sampler.requests) >= len(batch) * (1 + G)  # each group: its answers, then one check per answer
