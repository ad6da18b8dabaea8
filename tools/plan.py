r"""Plans a job: sweeps sampler/learner splits and η in simulation (the run's own orchestration in virtual time,
device calls priced by a cost model) and prints predicted trained tokens/s, step time, busy shares and staleness,
against colocated synchronous RL on all the chips; names the recommended split and writes a plot.

  python tools/plan.py --config=configs/math.py:qwen2.5-1.5b --device=v5p --chips=64 --length_mean=8000
  python tools/plan.py --config=configs/math.py:qwen2.5-1.5b --device=h800 --chips=8 --eta=0,1,4,8 \
      --lengths=run/rollouts.jsonl --json > plan.json

Devices: v4, v5e, v5p, v6e, a100, h100, h800, h200, b200 (published peaks, `areal_jax/hardware.py`). Answer lengths
come from `--lengths` (a run's rollouts.jsonl, or a file of integers) or a log-normal of `--length_mean` cut at
`--length_max`. See `areal_jax.sim`.

`--layout` is how the code would run the sampler chips, and every row is simulated so: `replicas` (default; each
data shard an engine of its own, `mesh.sampler_replicas`), `host` (one engine per host's sampler chips), or
`pathways` (one engine over every sampler chip: one host, or a TPU slice under Pathways). A job larger than one host
runs its samplers as processes, one per host, each pulling every version over the leader's host network. Colocated
sync (`mesh.colocated`, its sampler split as the layout says) needs one controller, so on several GPU hosts there is
no colocated row: each split's η = 0 row is its baseline. `sampler.num_slots` counts one engine's slots, as in a run
(`--slots_per_shard` sets every data shard's instead). The plan prints each efficiency with its source
(`sim.costs.PUBLISHED`, or `--calibration`).

`--spec_accept=A` (repeatable) prices speculative rollout (`sampler.speculation="suffix"`, `sampler.spec_tokens`
drafts per slot and forward) at a measured acceptance: every row is simulated again with it, and a line per row gives
its step time and tokens/s with speculation beside those without (`sim.costs.Acceptance`, `docs/planner.md`).

  python tools/plan.py --config=configs/math.py:qwen2.5-1.5b --device=v5p --chips=64 --sampler_chips=48 --eta=2 \
      --length_mean=8000 --spec_accept=0.6 --spec_accept=0.6,0.4,0.25,0.15

`--check=DIR` holds the planner to measurement instead: it calibrates the cost model on this machine's CPU (the tiny
preset's programs in each role's layout; cached in `--calibration`), predicts every run of a
`tools/bench_async.py --processes` workdir and prints predicted beside measured:

  python tools/bench_async.py --processes --etas=0,2,4 --steps=20 --variant=t1:rollout.target_staleness=1 \
      --workdir=/tmp/bench_async
  python tools/plan.py --config=configs/math.py --check=/tmp/bench_async
"""

import dataclasses
import json

from absl import flags

from areal_jax import cli

_CONFIG = cli.define_config()
_DEVICE = flags.DEFINE_string("device", "v5p", "Accelerator: v4, v5e, v5p, v6e, a100, h100, h800, h200, b200.")
_CHIPS = flags.DEFINE_integer("chips", 64, "Chips for the whole job (sampler + learner).")
_LAYOUT = flags.DEFINE_enum("layout", "replicas", ["replicas", "host", "pathways"],
                            "How the sampler chips run: an engine per data shard, per host, or one over all of them "
                            "(Pathways, or one host); see the module docstring.")
_HOST_NETWORK = flags.DEFINE_float("host_network_gbps", 0, "Gb/s a host sends over the data-centre network; 0 = the "
                                   "device table's (needed where it has none and samplers are processes).")
_SYNC_DELTA = flags.DEFINE_float("sync_delta", 0.0, "Price sync.delta: the share of bf16 elements a version changes "
                                  "(docs/results.md: tools/bench_delta_sync.py); 0 = every version whole. Sampler "
                                  "processes pull beside the learner's next step when the config's sync.overlap is on.")
_MODEL = flags.DEFINE_string("model", "", "A preset of the --config file, or a HF config.json (or its directory); "
                             "'' = the config's model.")
_TENSOR = flags.DEFINE_integer("tensor", 0, "Chips per sampler data shard; 0 = mesh.sampler_tensor.")
_SLOTS = flags.DEFINE_integer("slots_per_shard", 0, "Decode slots per sampler data shard, in every engine of every "
                              "split; 0 = the config's sampler.num_slots per engine (one replica's, as in a run).")
_BATCH = flags.DEFINE_integer("batch_prompts", 0, "Prompts per learner step; 0 = rollout.batch_size.")
_ANSWERS = flags.DEFINE_integer("answers", 0, "Answers per prompt; 0 = rollout.group_size.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 0, "Prompt tokens; 0 = data.max_prompt_len / 2.")
_MEAN = flags.DEFINE_float("length_mean", 0, "Mean answer tokens (log-normal); 0 = sampler.max_new_tokens / 4.")
_MAX = flags.DEFINE_integer("length_max", 0, "Longest answer; 0 = sampler.max_new_tokens.")
_LENGTHS = flags.DEFINE_string("lengths", "", "A run's rollouts.jsonl (its groups replayed whole: answer lengths with "
                               "their rewards) or a file of answer lengths (integers).")
_ETA = flags.DEFINE_string("eta", "0,1,2,4,8", "η (max head off-policyness) to try, comma-separated.")
_TARGET = flags.DEFINE_float("target_staleness", -1, "rollout.target_staleness for the asynchronous rows; -1 = off.")
_SPLITS = flags.DEFINE_string("sampler_chips", "", "Sampler chip counts to try, comma-separated; '' = every eighth.")
_STEPS = flags.DEFINE_integer("steps", 10, "Learner steps simulated per layout (the first --warmup not timed; "
                              "--check simulates the bench's own).")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Learner steps not timed.")
_SUCCESS = flags.DEFINE_float("success", 0.5, "Chance an answer is right (uniform groups are kept).")
_SCALE = flags.DEFINE_integer("token_scale", 0, "Real tokens per simulated token; 0 = a mean answer of 8-16.")
_PROGRAMS = flags.DEFINE_string("learner_programs", "", "A TPU topology (v5p:2x2x2): count the learner's FLOPs per "
                                 "token in its programs traced for it (libtpu, no TPU) instead of the analytic count.")
_SCRATCH = flags.DEFINE_float("learner_scratch_gib", -1, "GiB per chip the learner step's programs need beyond its "
                               "state, which a colocated run's KV pool leaves free; -1 = compiled with "
                               "--learner_programs, else not counted (printed so).")
_SPEC_ACCEPT = flags.DEFINE_multi_string(
    "spec_accept", [], "Price speculative rollout (sampler.speculation=suffix) too, at this acceptance: a (each draft "
    "token accepted with probability a, independently) or a1,...,ak, k = sampler.spec_tokens (aj: of the drafted "
    "slot-forwards, the share whose first j drafts were all accepted; with --spec_drafted=1, tools/bench_sampler.py "
    "--speculation's 'accepted per slot-forward by position'); repeat for several. Every row "
    "is simulated again with it and its step time printed beside the one without.")
_SPEC_DRAFTED = flags.DEFINE_float("spec_drafted", 1.0, "With --spec_accept: the share of slot-forwards that carry a "
                                   "draft at all (each taken as sampler.spec_tokens long).")
_JSON = flags.DEFINE_bool("json", False, "Print the result as one JSON object instead of the table.")
_PLOT = flags.DEFINE_string("plot", "plan.png", "PNG of throughput against split per η ('' = none).")
_CHECK = flags.DEFINE_string("check", "", "A tools/bench_async.py --processes workdir: predict its runs from this "
                             "machine's calibrated costs, beside the measured figures.")
_CALIBRATION = flags.DEFINE_string("calibration", "", "A tools/device_check.py device_check.json: its measured decode "
                                   "share of the HBM roofline and learner MFU replace --device's default efficiencies. "
                                   "With --check: this machine's CPU calibration JSON, read if it exists, else "
                                   "measured and written ('' = <--check>/calibration.json).")


def _ints(text: str, flag: str) -> list[int]:
  try:
    return [int(v) for v in text.split(",") if v.strip()]
  except ValueError:
    raise SystemExit(f"FATAL --{flag}={text!r}: expected comma-separated integers") from None


def _setup():
  """(where each efficiency not at its default came from, the plan's `Setup`) from the flags and the config."""
  from areal_jax import config as config_lib  # pylint: disable=g-import-not-at-top  # after the flags
  from areal_jax.models import hf_io  # pylint: disable=g-import-not-at-top
  from areal_jax import hardware  # pylint: disable=g-import-not-at-top
  from areal_jax.sim import costs, lengths, plan  # pylint: disable=g-import-not-at-top

  settings = config_lib.validate(_CONFIG.value, data=False)
  model = settings.model
  if _MODEL.value.endswith(".json") or "/" in _MODEL.value:
    model = hf_io.read_config(_MODEL.value.removesuffix("config.json"), dtype=model.dtype,
                              param_dtype=model.param_dtype, remat=model.remat)
    _refuse_toy_settings(model, settings)
  elif _MODEL.value:
    path = flags.FLAGS["config"].config_filename
    model = config_lib.validate(config_lib.load_config(f"{path}:{_MODEL.value}"), data=False).model
  s = settings.sampler
  max_len = _MAX.value or s.max_new_tokens
  recorded = None
  if _LENGTHS.value.endswith(".jsonl"):  # a run's groups, replayed whole
    recorded = lengths.RecordedGroups.from_rollouts([_LENGTHS.value])
    dist = recorded.lengths()
  elif _LENGTHS.value:
    dist = lengths.Lengths.from_file(_LENGTHS.value)
  else:
    dist = lengths.Lengths.parametric(_MEAN.value or max_len / 4, max_len)
  s = s.replace(max_new_tokens=max(s.max_new_tokens, dist.max))
  if _SPEC_ACCEPT.value:  # the table without speculation, `--spec_accept`'s lines with it
    s = s.replace(speculation="off")
  prompt_len = _PROMPT_LEN.value or max(1, settings.data.max_prompt_len // 2)
  s = s.replace(max_seq_len=max(s.max_seq_len, prompt_len + s.max_new_tokens))
  remat = {"none": 0.0, "dots": 0.5, "full": 1.0}[model.remat]
  passes = {}  # the analytic count, unless counted in the learner's programs
  if _PROGRAMS.value:
    from areal_jax.sim import programs  # pylint: disable=g-import-not-at-top  # imports libtpu's topologies
    counted = programs.learner_passes(settings, _PROGRAMS.value, int(prompt_len + dist.mean), model)
    passes = dict(passes=counted.total, proximal=counted.proximal)
    remat = 0.0  # in the counted passes
  scratch = _SCRATCH.value * 2**30 if _SCRATCH.value >= 0 else (counted.scratch_bytes if _PROGRAMS.value else 0.0)
  device = hardware.device(_DEVICE.value)
  eff, sources = costs.published(device)
  if _CALIBRATION.value:
    with open(_CALIBRATION.value) as f:
      measured = costs.from_device_check(json.load(f), device, eff, where=f"--calibration={_CALIBRATION.value}")
    sources |= {k: f"measured, {_CALIBRATION.value}" for k in ("decode_bw", "learner_mfu")
                if getattr(measured, k) != getattr(eff, k)}
    eff = measured
  return sources, plan.Setup(model=model, device=device, chips=_CHIPS.value, sampler=s, slots_per_shard=_SLOTS.value, eff=eff,
                    tensor=_TENSOR.value or settings.mesh.sampler_tensor, layout=_LAYOUT.value,
                    host_network=_HOST_NETWORK.value * 1e9 / 8, sync_delta=_SYNC_DELTA.value,
                    sync_overlap=settings.sync.overlap,
                    eval_answers=settings.data.eval_size * settings.eval.num_samples,
                    eval_every=settings.eval.every_steps, checkpoint_every=settings.checkpoint.every_steps,
                    learner_scratch=scratch,
                    batch_prompts=_BATCH.value or settings.rollout.batch_size,
                    answers=_ANSWERS.value or settings.rollout.group_size, prompt_len=prompt_len, lengths=dist,
                    recorded=recorded,
                    steps=_STEPS.value, warmup=_WARMUP.value,
                    target_staleness=None if _TARGET.value < 0 else _TARGET.value, success=_SUCCESS.value,
                    max_concurrent=settings.rollout.max_concurrent_rollouts,
                    max_tokens_per_mb=settings.learner.max_tokens_per_mb,
                    minibatches=settings.learner.ppo_n_minibatches, remat=remat, scale=_SCALE.value, seed=settings.seed,
                    **passes)


TOY_RATIO = 100  # a model this many times the preset's own is not planned with the preset's settings


def _refuse_toy_settings(model, settings) -> None:
  """A HF model far larger than the preset's own model would be planned with that preset's sampler and learner
  settings (slots, pages, micro-batch tokens, batch sizes made for a toy): refused, naming what to pass."""
  ours, theirs = settings.model.num_params(), model.num_params()
  if theirs > TOY_RATIO * ours:
    preset = _CONFIG.value.get("preset", "tiny")
    raise SystemExit(
        f"FATAL --model={_MODEL.value}: {theirs / 1e9:.2f}B parameters, planned with the `{preset}` preset's sampler "
        f"and learner settings (made for its {ours / 1e6:.1f}M-parameter model: sampler.num_slots="
        f"{settings.sampler.num_slots}, learner.max_tokens_per_mb={settings.learner.max_tokens_per_mb}, "
        f"rollout.batch_size={settings.rollout.batch_size}); pass --config=configs/math.py:PRESET with a real-size "
        "preset (qwen2.5-1.5b, r1-distill-qwen-7b, qwen3-30b-a3b) or set those fields")


def _check() -> None:
  """`--check`: the bench's runs predicted beside measured."""
  import os  # pylint: disable=g-import-not-at-top

  from areal_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  from areal_jax.sim import calibrate, check  # pylint: disable=g-import-not-at-top

  path = _CALIBRATION.value or os.path.join(_CHECK.value, "calibration.json")
  if os.path.exists(path):
    with open(path) as f:
      cals = {k: calibrate.Calibration.from_json(v) for k, v in json.load(f).items()}
  else:
    cals = calibrate.calibrate(_CONFIG.value, calibrate.LAYOUTS)
    with open(path, "w") as f:
      json.dump({k: v.to_json() for k, v in cals.items()}, f, indent=2)
  settings = config_lib.validate(_CONFIG.value, data=False)
  rows = check.predict(_CHECK.value, settings, cals,
                       prompt_len=_PROMPT_LEN.value or check.mean_prompt_len(settings))
  if _JSON.value:
    print(json.dumps({"rows": rows, "calibration": {k: v.to_json() | {"samples": None} for k, v in cals.items()}}))
    return
  for name, cal in cals.items():
    print(f"calibration {name}: fit error " + ", ".join(f"{k} {v:.0%}" for k, v in cal.error.items()))
  print(check.format_check(rows))


def main(argv):
  del argv
  from areal_jax.sim import plan  # pylint: disable=g-import-not-at-top

  if _CHECK.value:
    _check()
    return

  from areal_jax.sim.costs import Acceptance  # pylint: disable=g-import-not-at-top

  try:
    sources, setup = _setup()
    acceptances = [Acceptance.parse(a, setup.sampler.spec_tokens, _SPEC_DRAFTED.value) for a in _SPEC_ACCEPT.value]
    result = plan.plan(setup, etas=_ints(_ETA.value, "eta"), sampler_chips=_ints(_SPLITS.value, "sampler_chips"))
    if acceptances:
      result["speculation"] = [plan.speculation(setup, result, a) for a in acceptances]
  except ValueError as e:
    raise SystemExit(f"FATAL {e}") from None
  if _PLOT.value:
    plan.plot(result, _PLOT.value)
  if _JSON.value:
    print(json.dumps(result))
    return
  print(f"{setup.model.num_params() / 1e9:.2f}B parameters on {setup.device.describe(setup.chips)}; "
        f"{setup.batch_prompts} x {setup.answers} answers per step, lengths {result['lengths']['source']} "
        f"(mean {result['lengths']['mean']:.0f}); {setup.steps} steps per layout, 1 simulated token = "
        f"{result['token_scale']} real; learner {setup.passes + setup.remat:.2f} forward passes' FLOPs per token "
        + (f"(counted in its programs for {_PROGRAMS.value})" if _PROGRAMS.value else "(analytic)"))
  from areal_jax.sim.costs import UNSOURCED  # pylint: disable=g-import-not-at-top

  if _SCRATCH.value >= 0:
    scratch = f"{_SCRATCH.value:g} GiB per chip (--learner_scratch_gib)"
  elif _PROGRAMS.value:
    scratch = f"{setup.learner_scratch / 2**30:.2f} GiB per chip (compiled for {_PROGRAMS.value})"
  else:
    scratch = "not counted (--learner_programs or --learner_scratch_gib)"
  print(f"colocated KV pool beside the learner's state and its step's scratch: {scratch}")

  eff = setup.eff
  print("efficiencies and fixed costs:\n" + "\n".join(
      f"  {f.name} {getattr(eff, f.name):g} ({sources.get(f.name, UNSOURCED)})"
      for f in dataclasses.fields(eff)))
  if result["sync_refused"]:
    print(f"no colocated sync row: {result['sync_refused']}")
  print(plan.format_table(result))
  r = result["recommended"]
  vs = ("" if r["speedup_vs_colocated_sync"] is None else f"{r['speedup_vs_colocated_sync']:.2f}x colocated sync, ")
  print(f"recommended: {r['sampler_chips']} sampler + {r['learner_chips']} learner chips at eta={r['eta']} "
        f"({r['layout']}): {vs}{r['speedup_vs_split_sync']:.2f}x sync on the same split, staleness "
        f"{r['staleness_mean']:.2f}"
        + (f"; plot: {_PLOT.value}" if _PLOT.value else ""))
  for spec in result.get("speculation", []):
    print(plan.format_speculation(spec))


if __name__ == "__main__":
  cli.run(main)
