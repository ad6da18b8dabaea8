"""Held-out evaluation: generate answers with given parameters and score them with the math/code verifiers.

`Evaluator` keeps one sampling engine (compiled once) and reuses it for every evaluation. It evaluates the policy as
the sampler serves it: weights in `sampler_cfg.param_dtype` (bfloat16 in the real-size presets), like the answers
the learner trains on. With `num_samples = 1`
answers are greedy; with k > 1 they are sampled at `temperature` (and `top_p`) and accuracy is pass@1 averaged over the
k samples. A call may name other records and sampling settings (several benchmarks, a greedy and a sampled pass) and
still use the same compiled engine; `EvalResult.correct` holds every (question, sample) score for pass@k.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence

import numpy as np
from flax import nnx
from etils import epath
from jax.sharding import Mesh

from areal_jax import faults
from areal_jax.data.records import PromptRecord
from areal_jax.distributed import weight_transfer
from areal_jax.models.config import ModelConfig
from areal_jax.models.transformer import Transformer
from areal_jax.sampler.config import SamplerConfig
from areal_jax.sampler.drafts import SuffixDrafter
from areal_jax.sampler.sampler import Sampler
from areal_jax.sampler.engine import Engine
from areal_jax.sampler.requests import Request, SamplingParams

def heldout_jsonl(workdir: str, eval_path: str, records: Sequence[PromptRecord]) -> str:
  """A JSONL of the run's held-out problems for `tools/evaluate.py --benchmarks`: `eval_path` when the config names
  one, else `<workdir>/heldout.jsonl`, written here from the math `records` the run evaluated on (held out of a
  synthetic, TFDS or JSONL source); "" when they are code problems (their tests have no row form to write back)."""
  if eval_path:
    return eval_path
  if not records or any(r.kind != "math" for r in records):
    return ""
  path = epath.Path(workdir) / "heldout.jsonl"
  path.write_text("".join(json.dumps({"id": r.uid, "question": r.question, "answer": r.reference}) + "\n"
                          for r in records))
  return str(path)


# score(items) -> rewards, items being (kind, completion text, reference).
Scorer = Callable[[Sequence[tuple[str, str, str]]], list[float]]


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalResult:
  accuracy: float  # mean reward over all (question, sample) pairs: greedy accuracy or pass@1
  correct: np.ndarray  # [questions, samples] rewards
  mean_length: float  # generated tokens per answer
  seconds: float
  lengths: np.ndarray | None = None  # [questions, samples] generated tokens per answer (EOS included)
  turns: float | None = None  # an agent's completions per episode

  def metrics(self, prefix: str = "eval") -> dict[str, float]:
    out = {f"{prefix}/accuracy": self.accuracy, f"{prefix}/mean_length": self.mean_length,
           f"{prefix}/seconds": self.seconds}
    return out if self.turns is None else out | {f"{prefix}/turns_mean": self.turns}


class Evaluator:

  def __init__(self, *, model_cfg: ModelConfig, records: Sequence[PromptRecord], mesh: Mesh,
               sampler_cfg: SamplerConfig, eos_ids: Sequence[int], detokenize: Callable[[Sequence[int]], str],
               score: Scorer, num_samples: int = 1, temperature: float = 1.0, top_p: float = 1.0, seed: int = 0):
    self.records = list(records)
    self.eos_ids, self.detokenize, self.score = tuple(eos_ids), detokenize, score
    self.num_samples = num_samples
    self.sampling = SamplingParams(temperature=0.0 if num_samples == 1 else temperature, top_p=top_p,
                                   max_new_tokens=sampler_cfg.max_new_tokens, seed=seed)
    abstract = nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0)))
    self.engine = Engine(model=abstract, config=sampler_cfg, mesh=mesh)
    # With speculation, one drafter for every evaluation: the same held-out prompts come back, and the last
    # evaluation's answers draft this one's (the policy has moved little since).
    self.drafter = SuffixDrafter(max_draft=sampler_cfg.draft_width) if sampler_cfg.speculation == "suffix" else None

  def __call__(self, params, *, version: int = 0, records: Sequence[PromptRecord] | None = None,
               num_samples: int | None = None, temperature: float | None = None,
               top_p: float | None = None) -> EvalResult:
    """Answers every record (the constructor's, or `records`) and scores the answers.

    `num_samples`, `temperature` (0 = greedy) and `top_p` replace the constructor's settings for this call only.
    """
    start = time.perf_counter()
    records = self.records if records is None else list(records)
    num_samples = self.num_samples if num_samples is None else num_samples
    sampling = dataclasses.replace(self.sampling, **{k: v for k, v in (("temperature", temperature), ("top_p", top_p))
                                                     if v is not None})
    params = weight_transfer.transfer(params, self.engine.param_shardings, dtype=self.engine.param_dtype)
    sampler = Sampler(engine=self.engine, params=params, version=version, eos_ids=self.eos_ids, warmup=False,
                      drafter=self.drafter)
    faults.reach("evaluation")
    finished = sampler.run([Request(group_id=i, prompt_ids=r.prompt_ids, num_answers=num_samples, sampling=sampling)
                           for i, r in enumerate(records)])
    answers = {(i, j): list(seq.tokens) for i, row in enumerate(finished) for j, seq in enumerate(row)}
    keys = sorted(answers)
    texts = [self.detokenize([t for t in answers[k] if t not in self.eos_ids]) for k in keys]
    rewards = self.score([(records[i].kind, text, records[i].reference) for (i, _), text in zip(keys, texts)])
    correct = np.zeros((len(records), num_samples))
    lengths = np.zeros((len(records), num_samples), np.int32)
    for (i, j), reward in zip(keys, rewards):
      correct[i, j] = reward
      lengths[i, j] = len(answers[(i, j)])
    return EvalResult(accuracy=float(correct.mean()), correct=correct, mean_length=float(lengths.mean()),
                      seconds=time.perf_counter() - start, lengths=lengths)


class EpisodeEvaluator:
  """An agent's held-out success rate: its episodes on `problems` (what the agent is handed), run through the
  training sampler (the run's sampling settings) at the learner's current version, and not trained on. Called
  between learner steps, as `Evaluator` is: the version cannot move while it runs. `accuracy` is the mean episode
  reward over `num_samples` episodes per problem; `mean_length` counts generated tokens per episode."""

  def __init__(self, *, runner, problems: Sequence[dict], num_samples: int = 1):
    self.runner, self.problems, self.num_samples = runner, list(problems), num_samples

  def __call__(self, params=None, *, version: int = 0) -> EvalResult:
    start = time.perf_counter()
    futures = [[self.runner.submit(p, group_id=-1 - i, index=j, min_version=version)
                for j in range(self.num_samples)] for i, p in enumerate(self.problems)]
    faults.reach("evaluation")
    results = [[f.result() for f in row] for row in futures]
    correct = np.array([[e.reward for e in row] for row in results], np.float64)
    lengths = np.array([[sum(len(c.tokens) for c in e.completions) for e in row] for row in results], np.int32)
    return EvalResult(accuracy=float(correct.mean()), correct=correct, mean_length=float(lengths.mean()),
                      seconds=time.perf_counter() - start, lengths=lengths,
                      turns=float(np.mean([[e.turns for e in row] for row in results])))
