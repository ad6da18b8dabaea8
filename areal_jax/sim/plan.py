"""Sizing a job: how many chips should sample, how many learn, and at which η, by simulating each choice
(`job.simulate`: the run's own orchestration in virtual time) against colocated synchronous RL on all the chips.

    setup = Setup(model=..., device=hardware.device("v5p"), chips=64, sampler=..., batch_prompts=512, answers=16,
                  layout="replicas", ...)
    result = plan(setup, etas=(0, 1, 2, 4, 8))   # {"rows": [...], "sync": {...}, "recommended": {...}}
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from areal_jax.models.config import ModelConfig
from areal_jax.sampler.config import SamplerConfig
from areal_jax.sim.costs import Acceptance, CostModel, Efficiency
from areal_jax.hardware import Device
from areal_jax.sim.job import Job, Result, simulate
from areal_jax.sim.lengths import Lengths, RecordedGroups


@dataclasses.dataclass(frozen=True, kw_only=True)
class Setup:
  """What stays fixed across the sweep: the model, the chips, the sampler per data shard, the batch, the lengths."""

  model: ModelConfig
  device: Device
  chips: int
  sampler: SamplerConfig  # the config's: num_slots counts one engine's slots (one replica's), as in a run
  tensor: int = 1  # chips per sampler data shard
  slots_per_shard: int = 0  # > 0: every engine holds this many slots per data shard instead of sampler.num_slots
  batch_prompts: int
  answers: int
  prompt_len: int
  lengths: Lengths
  recorded: RecordedGroups | None = None  # a run's groups, replayed whole (then `lengths` only sets the token scale)
  steps: int = 10
  warmup: int = 2  # learner steps not timed (the pipeline filling)
  target_staleness: float | None = None
  max_concurrent: int = 0
  success: float = 0.5
  max_tokens_per_mb: int = 32768
  minibatches: int = 4
  passes: float = 4.0  # learner forward passes' FLOPs per token with the decoupled loss (backward = 2)
  proximal: float = 1.0  # of which the proximal policy's pass: η = 0 trains plain PPO without it
  remat: float = 0.0
  eff: Efficiency = Efficiency()
  scale: int = 0  # real tokens per simulated one; 0 = chosen from the lengths (a mean answer of ~8-16)
  seed: int = 0
  layout: str = "replicas"  # LAYOUTS
  host_network: float = 0.0  # bytes/s per host; 0 = the device table's
  sync_delta: float = 0.0  # sync.delta: the share of elements a version changes (docs/results); 0 = whole copies
  sync_overlap: bool = True  # sync.overlap
  eval_answers: int = 0  # data.eval_size x eval.num_samples (0 = no evaluation priced)
  eval_every: int = 0  # eval.every_steps
  checkpoint_every: int = 0  # checkpoint.every_steps (0 = no checkpoint priced)
  learner_scratch: float = 0.0  # bytes per chip a learner step's programs need beyond its state (colocated pool)
  acceptance: Acceptance | None = None  # with sampler.speculation: the drafts' measured acceptance (`speculation`)

  @property
  def token_scale(self) -> int:
    if self.scale:
      return self.scale
    return max(1, 1 << int(math.log2(max(1.0, self.lengths.mean / 8))))


LAYOUTS = ("replicas", "host", "pathways")


@dataclasses.dataclass(frozen=True)
class Layout:
  """How the code runs `sampler_chips` sampling chips: `engines` independent engines of `engine_shards` data shards
  each, in `processes` sampler processes on hosts of their own (0: in the learner's process, one host or one
  controller)."""

  name: str
  engines: int
  engine_shards: int
  processes: int

  def describe(self) -> str:
    where = f"{self.processes} sampler processes" if self.processes else "one process"
    return f"{self.name}: {self.engines} engine(s) of {self.engine_shards} data shard(s), {where}"


def layout(setup: Setup, sampler_chips: int, *, colocated: bool = False) -> Layout:
  """The layout `setup.layout` names for `sampler_chips`, as the launcher would run it; a ValueError for one the
  code cannot run on this hardware.

  - `replicas`: every data shard (`tensor` chips) its own engine (`mesh.sampler_replicas`); a job larger than one
    host runs its samplers as one process per host of sampler chips, behind the hub (`launch/local.py`'s roles);
  - `host`: one engine per sampler process, its host's chips in lockstep (`mesh.sampler_replicas=1`);
  - `pathways`: one engine over every sampler chip, in one controller: one host, or a TPU slice under Pathways.
  Colocated (both roles on every chip, `mesh.colocated`) needs one controller (one host, or a TPU slice), and splits
  its sampler the way the layout names (`mesh.sampler_replicas`), in the learner's process."""
  d, shards = setup.device, sampler_chips // setup.tensor
  one_host = setup.chips <= d.chips_per_host
  if colocated or setup.layout == "pathways":
    if not one_host and not d.tpu:
      what = "colocated sync" if colocated else "--layout=pathways"
      raise ValueError(f"{what} on {setup.chips} {d.name} chips: one controller over several GPU hosts is not a "
                       f"layout the code runs ({d.chips_per_host} per host); sampler processes are")
  if setup.layout == "pathways":
    return Layout("colocated" if colocated else "pathways", 1, shards, 0)
  processes = 0 if one_host or colocated else -(-sampler_chips // d.chips_per_host)
  if setup.layout == "replicas":
    return Layout("colocated" if colocated else "replicas", shards, 1, processes)
  if setup.layout == "host":
    hosts = max(1, -(-sampler_chips // d.chips_per_host))
    if shards % hosts:
      raise ValueError(f"--layout=host: {shards} data shards do not split over {hosts} hosts")
    return Layout("colocated" if colocated else "host", hosts, shards // hosts, processes)
  raise ValueError(f"--layout={setup.layout!r}: choose one of {LAYOUTS}")


def slots_per_engine(setup: Setup, lay: Layout) -> int:
  """One engine's decode slots: `sampler.num_slots` (per engine, as the code counts them), or `slots_per_shard`
  times its data shards; a ValueError, as the run's config check would give, when they do not divide its shards."""
  if setup.slots_per_shard:
    return setup.slots_per_shard * lay.engine_shards
  n = setup.sampler.num_slots
  if n % lay.engine_shards:
    raise ValueError(f"sampler.num_slots={n} (one engine's) over {lay.describe()}: not divisible by its "
                     f"{lay.engine_shards} data shards (the run's config check refuses it too); pass "
                     "--slots_per_shard")
  return n


def splits(chips: int, tensor: int) -> list[int]:
  """Sampler chip counts to try: about every eighth of the chips, whole data shards, at least one chip per role."""
  shards = chips // tensor
  counts = {max(1, round(shards * k / 8)) * tensor for k in range(1, 8)}
  return sorted(c for c in counts if 0 < c < chips)


def cost_model(setup: Setup, sampler_chips: int, eta: int, *, colocated: bool = False) -> CostModel:
  """The cost model of one layout (see `simulate_split`)."""
  learner_chips = setup.chips if colocated else setup.chips - sampler_chips
  lay = layout(setup, sampler_chips, colocated=colocated)
  return CostModel(model=setup.model, device=setup.device, sampler_chips=sampler_chips, learner_chips=learner_chips,
                   sampler_shards=sampler_chips // setup.tensor, engines=lay.engines, colocated=colocated,
                   sampler_processes=lay.processes,
                   host_network=setup.host_network or setup.device.host_network or 0.0,
                   sync_delta=setup.sync_delta, sync_overlap=setup.sync_overlap,
                   weight_bytes=_bytes(setup.sampler.param_dtype),
                   kv_bytes=_bytes(setup.model.dtype), passes=setup.passes if eta else setup.passes - setup.proximal,
                   remat=setup.remat,
                   max_tokens_per_mb=setup.max_tokens_per_mb, minibatches=setup.minibatches,
                   eval_answers=setup.eval_answers, eval_every=setup.eval_every, eval_len=setup.lengths.mean,
                   eval_prompt=setup.prompt_len, eval_slots=setup.sampler.num_slots,
                   eval_decode_steps=setup.sampler.decode_steps, eval_overlap=setup.sampler.overlap,
                   checkpoint_every=setup.checkpoint_every, learner_scratch=setup.learner_scratch,
                   acceptance=setup.acceptance, eff=setup.eff)


def simulate_split(setup: Setup, sampler_chips: int, eta: int, *, colocated: bool = False) -> Result:
  """One layout: `sampler_chips` sampling and the rest learning (all of them doing both when `colocated`)."""
  lay = layout(setup, sampler_chips, colocated=colocated)
  costs = cost_model(setup, sampler_chips, eta, colocated=colocated)
  cfg = setup.sampler
  pages = costs.pages_per_shard(cfg.page_size, cfg.memory_fraction)
  if pages < cfg.pages_per_seq + 1:  # the engine refuses a pool that cannot hold one sequence
    what = "colocated sync" if colocated else f"{sampler_chips} sampler chips"
    raise ValueError(f"{what}: a KV pool of {pages} pages per data shard cannot hold one sequence of "
                     f"sampler.max_seq_len={cfg.max_seq_len} ({cfg.pages_per_seq} pages of {cfg.page_size} plus one "
                     "scratch page); the engine refuses it")
  job = Job(model=setup.model, sampler=setup.sampler.replace(num_slots=slots_per_engine(setup, lay)),
            num_shards=lay.engine_shards, engines=lay.engines, batch_prompts=setup.batch_prompts,
            answers=setup.answers, prompt_len=setup.prompt_len,
            eta=eta, steps=setup.steps, target_staleness=setup.target_staleness if eta else None,
            max_concurrent=setup.max_concurrent, success=setup.success, recorded=setup.recorded,
            scale=setup.token_scale, seed=setup.seed)
  return simulate(job, costs, None if setup.recorded else setup.lengths)


def _bytes(dtype: str) -> int:
  return 2 if dtype == "bfloat16" else 4


def _figures(setup: Setup, r: Result) -> dict:
  sampler_busy, learner_busy = r.busy(setup.warmup)
  stale = r.staleness_of(setup.warmup)
  return {"tokens_per_s": r.tokens_per_s(setup.warmup), "answers_per_s": r.answers_per_s(setup.warmup),
          "step_s": r.step_s(setup.warmup), "sampler_busy": sampler_busy, "learner_busy": learner_busy,
          "sync_share": r.sync_share(setup.warmup),
          "staleness_mean": float(stale.mean()), "staleness_p99": float(np.percentile(stale, 99))}


def plan(setup: Setup, etas=(0, 1, 2, 4, 8), sampler_chips=None) -> dict:
  """Every split x η in `setup.layout`, and colocated sync on all the chips where the code runs it (one host, or a
  TPU slice under one controller, with room for a KV pool; else `sync` is None and `sync_refused` says why);
  `recommended` is the row that trains the most tokens/s (the
  least staleness among equals)."""
  if setup.chips < 2 * setup.tensor:
    raise ValueError(f"--chips={setup.chips}: a split needs at least two sampler data shards' worth "
                     f"({2 * setup.tensor} chips at --tensor={setup.tensor})")
  sync, sync_refused = None, None
  try:  # where the code cannot colocate (several hosts, a pool too small), each split's own sync row is the baseline
    sync_layout = layout(setup, setup.chips, colocated=True)
    sync = {"sampler_chips": setup.chips, "learner_chips": setup.chips, "eta": 0, "layout": sync_layout.describe(),
            **_figures(setup, simulate_split(setup, setup.chips, 0, colocated=True))}
  except ValueError as e:
    sync_refused = str(e)
  rows = []
  for s in sampler_chips or splits(setup.chips, setup.tensor):
    split_sync = None
    for eta in sorted(set(etas) | {0}):  # each split's own sync row, for its speed-up
      row = {"sampler_chips": s, "learner_chips": setup.chips - s, "eta": eta,
             "layout": layout(setup, s).describe(), **_figures(setup, simulate_split(setup, s, eta))}
      split_sync = split_sync or row
      row["speedup_vs_colocated_sync"] = None if sync is None else row["tokens_per_s"] / sync["tokens_per_s"]
      row["speedup_vs_split_sync"] = row["tokens_per_s"] / split_sync["tokens_per_s"]
      if eta in etas:
        rows.append(row)
  best = max(rows, key=lambda r: (round(r["tokens_per_s"], 6), -r["staleness_mean"]))
  return {"rows": rows, "sync": sync, "sync_refused": sync_refused, "recommended": best,
          "token_scale": setup.token_scale,
          "learner_passes": setup.passes + setup.remat,
          "lengths": {"source": setup.lengths.source, "mean": setup.lengths.mean, "max": setup.lengths.max}}


def speculation(setup: Setup, result: dict, acceptance: Acceptance) -> dict:
  """`plan`'s rows (and its colocated sync) simulated again with speculative rollout (`sampler.speculation`) whose
  drafts are accepted at `acceptance`: each row's step time and trained tokens/s with it, beside those without."""
  spec = dataclasses.replace(setup, sampler=setup.sampler.replace(speculation="suffix"), acceptance=acceptance)
  rows = []
  for r in ([result["sync"]] if result["sync"] else []) + result["rows"]:
    colocated = r is result["sync"]
    figures = _figures(spec, simulate_split(spec, r["sampler_chips"], r["eta"], colocated=colocated))
    rows.append({"sampler_chips": r["sampler_chips"], "learner_chips": r["learner_chips"], "eta": r["eta"],
                 "colocated": colocated, "step_s_off": r["step_s"], "tokens_per_s_off": r["tokens_per_s"],
                 "sampler_busy_off": r["sampler_busy"], **figures})
  return {"accepted": list(acceptance.accepted), "drafted": acceptance.drafted,
          "tokens_per_forward": acceptance.tokens_per_forward(), "describe": acceptance.describe(), "rows": rows}


def format_speculation(spec: dict) -> str:
  lines = [f"with speculation ({spec['describe']}):"]
  for r in spec["rows"]:
    name = (f"colocated sync ({r['sampler_chips']})" if r["colocated"]
            else f"{r['sampler_chips']}+{r['learner_chips']} eta={r['eta']}")
    lines.append(f"  {name}: step {r['step_s_off']:.1f} s -> {r['step_s']:.1f} s, tokens/s "
                 f"{r['tokens_per_s_off']:,.0f} -> {r['tokens_per_s']:,.0f} "
                 f"({r['tokens_per_s'] / r['tokens_per_s_off']:.2f}x), sampler busy {r['sampler_busy_off']:.0%} -> "
                 f"{r['sampler_busy']:.0%}")
  return "\n".join(lines)


def format_table(result: dict) -> str:
  head = ("split (sampler+learner)", "eta", "layout", "tokens/s", "step s", "sampler busy", "learner busy",
          "weight sync", "staleness mean", "staleness p99", "x colocated sync", "x split sync")
  s = result["sync"]
  lines = [" | ".join(head), " | ".join("---" for _ in head)]
  if s is not None:
    lines.append(f"colocated sync ({s['sampler_chips']}) | 0 | {s['layout']} | {s['tokens_per_s']:,.0f} | "
                 f"{s['step_s']:.1f} | {s['sampler_busy']:.0%} | {s['learner_busy']:.0%} | {s['sync_share']:.1%} | "
                 "0.00 | 0 | 1.00x | -")
  for r in result["rows"]:
    mark = " *" if r is result["recommended"] else ""
    vs = "-" if r["speedup_vs_colocated_sync"] is None else f"{r['speedup_vs_colocated_sync']:.2f}x"
    lines.append(f"{r['sampler_chips']}+{r['learner_chips']}{mark} | {r['eta']} | {r['layout']} | "
                 f"{r['tokens_per_s']:,.0f} | {r['step_s']:.1f} | {r['sampler_busy']:.0%} | {r['learner_busy']:.0%} | "
                 f"{r['sync_share']:.1%} | {r['staleness_mean']:.2f} | {r['staleness_p99']:.0f} | {vs} | {r['speedup_vs_split_sync']:.2f}x")
  return "\n".join(lines)


def plot(result: dict, path: str) -> None:
  """Trained tokens/s against the sampler's share of the chips, one line per η, colocated sync dashed."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, ax = plt.subplots(figsize=(7, 4.5))
  for eta in sorted({r["eta"] for r in result["rows"]}):
    rows = [r for r in result["rows"] if r["eta"] == eta]
    ax.plot([r["sampler_chips"] for r in rows], [r["tokens_per_s"] for r in rows], marker="o", label=f"split, η={eta}")
  if result["sync"] is not None:
    ax.axhline(result["sync"]["tokens_per_s"], color="k", linestyle="--", label="colocated sync, all chips")
  ax.set_xlabel("sampler chips (the rest learn)")
  ax.set_ylabel("trained tokens/s (predicted)")
  ax.legend()
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
