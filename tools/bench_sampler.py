r"""Sampler throughput: the paged continuous-batching engine vs a dense static-batch generate, and optionally vs
Hugging Face `transformers` generate on PyTorch (`--peer=hf`), side by side in one run.

Workloads (`--workload`), random prompts of 16-32 tokens, temperature 1.0, EOS ignored so every variant does the same
work:

* `longtail` (default): `--requests` answers whose lengths are log-normal, capped at 3x `--mean-len` (as long
  chain-of-thought outputs are), forced with per-request `max_new_tokens`;
* `equal`: every answer `--new-tokens` long.

Variants, on the same weights (`--shape`: the `tiny` preset's, or `100m`: hidden 1024, 8 layers, vocab 32000), the
same number of slots (`--slots`, the static batch size):

* engine: `Scheduler` over the paged engine, one per `--decode-steps` value (decode steps per device call); a slot is
  refilled as soon as its answer ends;
* static: batches of `--slots` prompts in arrival order, one jitted prefill + decode loop with a dense KV cache per
  batch; every batch runs until its longest answer ends;
* hf: the same batches through `transformers` `model.generate` (KV cache, sampling; torch's default CPU threads).

Prints useful (generated, unpadded) tokens/s of each and their ratios, where the engine's step time goes (host work vs
waiting for the device), and the engine's fraction of a memory-bandwidth roofline measured here: bandwidth from timing
a large on-device reduction; a decode step must read the parameters and each live sequence's keys/values once.
Compiles are excluded (each variant is warmed up first); rounds alternate between variants and the best round counts.
Defaults take about 2 minutes on a 2-core CPU:

    python tools/bench_sampler.py [--slots 32] [--requests 256] [--mean-len 48]
    python tools/bench_sampler.py --peer=hf --workload=equal --slots=64 --requests=64 --new-tokens=128

`--host_slots=256,2048,8192` instead times the scheduler's host work per decode call with no device at all: the
simulator's engine (`sim.engine.SimEngine`, 256 slots per data shard) under the real `Scheduler`, every slot drawing
`--decode-steps` tokens a call (the last value). A second pass gives every decode call a fixed device time equal to
the host time just measured (results ready that long after dispatch, one call after another, as a device queue
runs them), and `hidden` is the share of that run's host time (wall - waiting for results) that overlapped a device
call: (device - waiting) / host (serial host work waits for every whole call: 0%). One line per count,
`host per decode call at S slots: X ms, hidden Y%`.

`--replicas=1,2,4` instead runs the long-tail workload on 8 emulated CPU devices split into that many independent
engines (`mesh.sampler_replicas`, `distributed.replicas.LocalRollout`; `--slots` in all, split between them),
publishing new weights every `--swap_every` decode calls per replica (each replica recomputes its running answers at
its own next step). One line per count, `replicas=N: tokens/s X, stall per swap Y s, learner's wait per publish Z s`:
useful tokens over the wall time, the seconds replicas spent swapping per version over the replicas (the whole
sampler's stop it equals: one replica's swap stops only its share), and the seconds `publish` held the publishing
thread per version (`sync/learner_seconds`). Each count runs the workload once untimed first (compiles, with
`sampler.warmup`), then `--repeats` times; the fastest counts.

`--speculation` instead runs speculative rollout off vs `sampler.speculation="suffix"` (drafts from the rollouts
drawn so far, `sampler/drafts.py`; verified exactly on the device) side by side: the same weights, requests, slots
and `--decode-steps` (the last value), temperature 1.0, one untimed round of each first (compiles), then `--repeats`
alternating rounds, the best counting. Workloads (`--spec_workload`, default both):

* `revisit`, RL's pattern, where drafts from history are honest: `--prompts` prompts of the tiny preset's data (its
  prompt template and char tokenizer) x `--group` answers each, submitted as groups, for `--epochs` epochs (an epoch's
  prompts again once the last epoch's answers are in: its answers are drafts for the next), EOS ending an answer
  (at most the preset's `sampler.max_new_tokens`). The policy has learned something: the tiny preset's model
  warm-started on the synthetic arithmetic worked solutions as a run warm-starts (`--warm_steps`, kept in
  `--warm_cache`), or `--init_from` (e.g. a run's `<workdir>/warmstart`). Answers differ between the variants
  (verification draws from other keys than sampling does), so each counts its own tokens;
* `longtail`: the default workload above on random weights (`--shape`), EOS ignored. Little to draft from there:
  random prompts and near-uniform random answers, so drafts are few and mostly rejected; it shows what speculation
  costs where it cannot help.

Per variant, `<workload> speculation=<off|suffix>: tokens N, seconds S, tokens/s R, decode calls C, host s H
(drafter D), device wait s W, tokens per slot-forward F` (host: the wall time not spent waiting for results, the
drafter's indexing and matching part of it; on a CPU the "device" shares the host's cores, so host work hidden behind
a call in flight still slows it; tokens emitted per slot and forward of the loop, `spec_tokens / spec_forwards`; 1 without
speculation), and with it the slot-forwards of the calls that verified drafts and the share of them that carried one
(`spec_drafted_at[0] / spec_forwards`), the drafts verified and accepted, the acceptance overall and by draft position
(`spec_accepted_at / spec_drafted_at`: of the slot-forwards whose draft reached that position) and accepted per
slot-forward by position (`spec_accepted_at / spec_forwards`, P(L >= j) of a forward's L accepted drafts: what
`tools/plan.py --spec_accept` takes with `--spec_drafted=1`), on `revisit` also by epoch (of how many drafts); then
`<workload> ratio suffix / off tokens/s`.
A forward over `--spec_tokens` + 1 positions costs more than a decode step (on CPU, compute-bound, much more), so
wall time may be worse even where tokens per forward rise. Compiling the speculative program takes minutes on a
loaded 2-core CPU (2.5 at load 13: the first round); the timed rounds then take about a minute:

    python tools/bench_sampler.py --speculation [--init_from /tmp/run/warmstart] [--prompts 16 --group 8 --epochs 3]
"""

from __future__ import annotations

import argparse
import itertools
import os
import pathlib
import tempfile
import time


def parse_args():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--slots", type=int, default=32, help="decode slots (batch size of the static and hf baselines)")
  p.add_argument("--requests", type=int, default=None, help="prompts, one answer each (default 256; 96 with "
                 "--speculation)")
  p.add_argument("--workload", choices=("longtail", "equal"), default="longtail")
  p.add_argument("--mean-len", type=int, default=48, help="longtail: mean answer length; the longest is 3x this")
  p.add_argument("--new-tokens", type=int, default=128, help="equal: every answer's length")
  p.add_argument("--shape", choices=("tiny", "100m"), default="tiny", help="model shape (random weights)")
  p.add_argument("--peer", choices=("none", "hf"), default="none", help="also time transformers generate on torch")
  p.add_argument("--page-size", type=int, default=16)
  p.add_argument("--decode-steps", default="1,8",
                 help="comma-separated decode steps per device call to compare (sampler.decode_steps); the last one "
                      "is the engine the ratios use")
  p.add_argument("--repeats", type=int, default=2, help="timed runs per variant, alternating; the best counts")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--host_slots", default="",
                 help="comma-separated slot counts: time the scheduler's host work per decode call (no device)")
  p.add_argument("--replicas", default="",
                 help="comma-separated replica counts: throughput and swap stall on 8 emulated CPU devices")
  p.add_argument("--swap_every", type=int, default=4, help="--replicas: decode calls per replica between versions")
  p.add_argument("--host_calls", type=int, default=64,
                 help="--host_slots: decode calls timed per count (enough that every answer's buffered tokens move "
                      "into its lists at least once: every 32 calls)")
  p.add_argument("--speculation", action="store_true",
                 help="instead: sampler.speculation off vs suffix, side by side (see the module docstring)")
  p.add_argument("--spec_workload", choices=("both", "revisit", "longtail"), default="both",
                 help="--speculation: the workloads to run")
  p.add_argument("--spec_tokens", type=int, default=4, help="--speculation: sampler.spec_tokens")
  p.add_argument("--prompts", type=int, default=16, help="--speculation revisit: prompts (P)")
  p.add_argument("--group", type=int, default=8, help="--speculation revisit: answers per prompt (G)")
  p.add_argument("--epochs", type=int, default=3, help="--speculation revisit: passes over the same prompts (E)")
  p.add_argument("--init_from", default="",
                 help="--speculation revisit: the tiny-shaped policy (an Orbax policy or checkpoint directory such as "
                      "a run's <workdir>/warmstart, or a HF directory); default: warm-start one (--warm_steps)")
  p.add_argument("--warm_steps", type=int, default=300, help="--speculation revisit: warm-start steps (no --init_from)")
  p.add_argument("--warm_cache", default=os.path.join(tempfile.gettempdir(), "areal_jax_bench_warmstart"),
                 help="--speculation revisit: where the warm-start is kept for the next run ('' = not kept)")
  args = p.parse_args()
  if args.requests is None:
    args.requests = 96 if args.speculation else 256
  return args


def workload(args, vocab: int):
  """(prompts, answer lengths) for `args.workload`."""
  import numpy as np

  rng = np.random.default_rng(args.seed)
  n, mean = args.requests, args.mean_len
  if args.workload == "equal":
    lengths = np.full(n, args.new_tokens)
  else:
    raw = rng.lognormal(0.0, 1.0, n)
    for _ in range(20):  # rescale to the mean, cap at 3x, repeat until both hold
      raw = np.minimum(raw / raw.mean() * mean, 3 * mean)
    lengths = np.maximum(np.round(raw), 1).astype(int)
  prompts = [rng.integers(2, vocab, int(rng.integers(16, 33))).astype(np.int32) for _ in range(n)]
  return prompts, lengths


def model_config(shape: str):
  from areal_jax.config import load_config
  from areal_jax.models import ModelConfig

  path = pathlib.Path(__file__).resolve().parent.parent / "configs" / "math.py"
  c = load_config(f"{path}:tiny").model
  if shape == "100m":
    c.update(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_layers=8, num_heads=16, num_kv_heads=4,
             head_dim=64)
  return ModelConfig.from_config(c)


def make_hf_generate(model, seed: int, *, device: str = "cpu", dtype: str = "float32"):
  """`run(prompts, new_tokens)`: one left-padded batch through transformers `generate` (sampling at temperature 1,
  EOS ignored), on a torch copy of `model`'s weights (on torch `device`, in `dtype`)."""
  import numpy as np
  import torch
  import transformers

  from areal_jax.models.hf_io import save_hf

  transformers.utils.logging.disable_progress_bar()
  with tempfile.TemporaryDirectory() as d:
    save_hf(model, d)
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=getattr(torch, dtype)).to(device).eval()
  hf.generation_config.eos_token_id = None
  torch.manual_seed(seed)

  def run(prompts, new_tokens: int):
    width = max(map(len, prompts))
    ids = np.zeros((len(prompts), width), np.int64)
    mask = np.zeros_like(ids)
    for i, p in enumerate(prompts):
      ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
    with torch.inference_mode():
      out = hf.generate(torch.from_numpy(ids).to(device), attention_mask=torch.from_numpy(mask).to(device),
                        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                        min_new_tokens=new_tokens, pad_token_id=0)
    assert out.shape[1] == width + new_tokens, out.shape

  return run, torch.get_num_threads()


def make_static_generate(graphdef, slots: int, cache_len: int):
  """Jitted dense static-batch generation: prefill [S, P] prompts, then `steps` decode steps for every row."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from areal_jax.models.modules import dense_attention, gqa_attention
  from areal_jax.sampler.sampling import sample

  @jax.jit
  def run(params, prompts, lengths, keys, steps):
    model = nnx.merge(graphdef, params)
    s, p = prompts.shape
    rows = jnp.arange(s)
    ones, off = jnp.ones(s), -jnp.ones(s, jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(p), (s, p))
    attend = dense_attention((pos < lengths[:, None]).astype(jnp.int32))
    h, kv = model.run_layers(model.embed_tokens(prompts), pos, lambda i, q, k, v: (attend(q, k, v)[0], (k, v)),
                             unroll=True)
    pad = lambda x: jnp.zeros((s, cache_len) + x.shape[2:], x.dtype).at[:, :p].set(x)
    cache = [(pad(k), pad(v)) for k, v in kv]
    tok, _ = sample(model.logits(h[rows, lengths - 1]), keys, jnp.zeros(s, jnp.int32), ones, ones, off)
    out = jnp.zeros((s, cache_len), jnp.int32)

    def body(i, carry):
      tok, cache, out = carry
      at = lengths + i
      visible = (jnp.arange(cache_len)[None, :] <= at[:, None])[:, None, :]

      def att(layer, q, k, v):
        ck = cache[layer][0].at[rows, at].set(k[:, 0])
        cv = cache[layer][1].at[rows, at].set(v[:, 0])
        return gqa_attention(q, ck, cv, visible), (ck, cv)

      h, cache = model.run_layers(model.embed_tokens(tok[:, None]), at[:, None], att, unroll=True)
      nxt, _ = sample(model.logits(h[:, 0]), keys, jnp.full(s, i + 1), ones, ones, off)
      return nxt, cache, out.at[:, i].set(tok)

    _, _, out = jax.lax.fori_loop(0, steps, body, (tok, cache, out))
    return out

  return run


class _Ready:
  """A fake device result: `value` once `at` (time.perf_counter) has passed; reading it earlier waits."""

  def __init__(self, value, at: float):
    self.value, self.at = value, at

  def __array__(self, dtype=None, copy=None):
    del copy
    wait = self.at - time.perf_counter()
    if wait > 0:
      time.sleep(wait)
    return self.value if dtype is None else self.value.astype(dtype)


def host_engine(slots: int, decode_steps: int, calls: int):
  """A device-free engine of `slots` slots (256 per data shard) whose decode calls draw every slot's whole budget;
  `device_s`, settable, is each call's device time (results are `_Ready` that long after the previous call's)."""
  import numpy as np

  from areal_jax.sampler import SamplerConfig
  from areal_jax.sampler.state import DecodeSteps
  from areal_jax.sim import engine as sim_engine
  from areal_jax.sim.costs import CostModel
  from areal_jax.hardware import DEVICES

  class Engine(sim_engine.SimEngine):

    device_s, _free_at = 0.0, 0.0

    def decode(self, params, state, budget, stop_eos, eos, grow, refill_at):
      del params, stop_eos, eos, grow, refill_at
      count = budget.astype(np.int32)
      tokens = np.where(np.arange(self.cfg.decode_steps)[None, :] < count[:, None], sim_engine.FILLER, -1)
      self._free_at = max(time.perf_counter(), self._free_at) + self.device_s
      ready = lambda x: _Ready(x, self._free_at)
      return state, DecodeSteps(tokens=ready(tokens.astype(np.int32)),
                                log_prob=ready(np.zeros(tokens.shape, np.float32)), count=ready(count))

  model_cfg = model_config("tiny")
  length = decode_steps * (calls + 8)  # no answer ends while timed
  cfg = SamplerConfig(num_slots=slots, page_size=16, max_seq_len=length + 64, max_new_tokens=length,
                      decode_steps=decode_steps, max_prefill_tokens=1 << 16)
  shards = max(1, slots // 256)
  costs = CostModel(model=model_cfg, device=DEVICES["h100"], sampler_chips=shards, learner_chips=1,
                    sampler_shards=shards)
  return Engine(model_cfg=model_cfg, cfg=cfg, num_shards=shards, pages_per_shard=slots // shards * cfg.pages_per_seq + 1,
                costs=costs, lengths=lambda keys: np.full(keys.shape[:-1], 10 * length), eos_id=0)


def host_per_call(slots: int, decode_steps: int, calls: int, device_s: float) -> tuple[float, float]:
  """(wall seconds, seconds waiting for the device) per decode call of the real `Scheduler` over `host_engine`, once
  every slot runs (admission and the calls that start the answers are not timed)."""
  import numpy as np

  from areal_jax.sampler import Request, SamplingParams, Scheduler

  engine = host_engine(slots, decode_steps, calls)
  sched = Scheduler(engine=engine, params={}, eos_ids=[0])
  sampling = SamplingParams(max_new_tokens=engine.cfg.max_new_tokens, ignore_eos=True)
  for g in range(slots // 8):
    sched.submit(Request(group_id=g, prompt_ids=np.arange(2, 34), num_answers=8, sampling=sampling))
  for _ in range(3):  # admits every answer, reads the first tokens
    sched.step()
  assert len(sched.running) == slots, (len(sched.running), slots)
  engine.device_s = device_s
  waited = sched.seconds["device_wait"]
  start = time.perf_counter()
  for _ in range(calls):
    sched.step()
  return (time.perf_counter() - start) / calls, (sched.seconds["device_wait"] - waited) / calls


def host_main(args) -> None:
  """Host time per call with no device; then, under a device call of that length, the share of the host time that
  ran while the device did: (device - waiting) / host, the host time taken from that same run (wall - waiting)."""
  k = int(args.decode_steps.split(",")[-1])
  for slots in [int(s) for s in args.host_slots.split(",")]:
    host, _ = host_per_call(slots, k, args.host_calls, 0.0)
    wall, waited = host_per_call(slots, k, args.host_calls, host)
    hidden = min(1.0, max(0.0, (host - waited) / (wall - waited)))
    print(f"host per decode call at {slots} slots: {host * 1e3:.1f} ms, hidden {hidden:.0%}", flush=True)


def replicas_run(model, params, prompts, lengths, replicas: int, slots: int, swap_every: int, seed: int):
  """(useful tokens, wall seconds, seconds swapping summed over replicas, versions published, seconds the publisher
  waited in `publish`, summed) of one pass of the workload through `replicas` engines on the 8 devices."""
  import threading

  import jax
  from flax import nnx

  from areal_jax.distributed.slices import MeshConfig, replica_meshes
  from areal_jax.distributed.replicas import LocalRollout
  from areal_jax.sampler import Request, SamplerConfig, SamplingParams
  from areal_jax.sharding import make_mesh

  meshes = replica_meshes(make_mesh(jax.devices()[:8], {"data": -1, "tensor": 1}),
                          MeshConfig(sampler_replicas=replicas))
  longest = int(lengths.max())
  max_seq_len = max(map(len, prompts)) + longest
  per = slots // replicas
  cfg = SamplerConfig(num_slots=per, page_size=16, max_seq_len=max_seq_len, max_new_tokens=longest,
                      num_pages=(per * -(-max_seq_len // 16) + 8 // replicas), max_prefill_tokens=4096, warmup=True)
  rollout = LocalRollout(abstract_model=nnx.eval_shape(lambda: model), config=cfg, meshes=meshes, params=params,
                         version=0, eos_ids=[], detokenize=None)
  done, versions, waited = threading.Event(), [0], [0.0]

  def publisher():  # a new version every `swap_every` decode calls per replica
    next_at = swap_every * replicas
    while not done.wait(0.002):
      if rollout.stats()["decode_calls"] >= next_at:
        versions[0] += 1
        t = time.perf_counter()
        rollout.publish(params, versions[0])
        waited[0] += time.perf_counter() - t
        next_at += swap_every * replicas

  try:
    start = time.perf_counter()
    thread = threading.Thread(target=publisher, daemon=True)
    thread.start()
    futures = [f for g, (p, n) in enumerate(zip(prompts, lengths)) for f in rollout.submit(Request(
        group_id=g, prompt_ids=p, sampling=SamplingParams(max_new_tokens=int(n), ignore_eos=True, seed=seed)))]
    tokens = sum(len(f.result(timeout=3600).response_ids) for f in futures)
    wall = time.perf_counter() - start
    done.set()
    thread.join()
    swapping = sum(r.sampler.scheduler.seconds["weight_swap"] for r in rollout.replicas)
  finally:
    done.set()
    rollout.stop()
  return tokens, wall, swapping, versions[0], waited[0]


def replicas_main(args) -> None:
  import jax
  from flax import nnx

  from areal_jax.models import create

  if jax.device_count() < 8:
    raise SystemExit(f"--replicas needs 8 devices; {jax.device_count()} here (XLA_FLAGS set before jax loads?)")
  model_cfg = model_config(args.shape)
  model = nnx.jit(lambda: create(model_cfg, seed=args.seed))()
  params = nnx.state(model, nnx.Param)
  prompts, lengths = workload(args, model_cfg.vocab_size)
  print(f"workload {args.workload}: {args.requests} answers, mean {lengths.mean():.1f} / max {int(lengths.max())} "
        f"tokens, {args.slots} slots in all, new weights every {args.swap_every} decode calls per replica",
        flush=True)
  for n in [int(r) for r in args.replicas.split(",")]:
    replicas_run(model, params, prompts, lengths, n, args.slots, args.swap_every, args.seed)  # compiles
    runs = [replicas_run(model, params, prompts, lengths, n, args.slots, args.swap_every, args.seed)
            for _ in range(args.repeats)]
    tokens, wall, swapping, versions, waited = min(runs, key=lambda r: r[1])
    print(f"replicas={n}: tokens/s {tokens / wall:.0f}, stall per swap {swapping / n / max(1, versions):.3f} s, "
          f"learner's wait per publish {waited / max(1, versions):.4f} s", flush=True)


def spec_policy(args, data, records, tok):
  """(the tiny preset's model, how it was made): `--init_from`'s weights (a policy or checkpoint directory, or a HF
  model directory), else the random init warm-started as a run warm-starts (`rl.warmstart.sft` on the worked
  solutions of `records`, `--warm_steps` steps at the tiny preset's learning rate and batch), kept in
  `--warm_cache` under a key of everything that decides it."""
  import hashlib

  import jax
  from flax import nnx

  from areal_jax.data.dataset import warmstart_pairs
  from areal_jax.learner.config import LearnerConfig
  from areal_jax.learner.step import build_step, make_learner_mesh
  from areal_jax.models import hf_io, orbax_io
  from areal_jax.rl import warmstart

  if args.init_from:
    if os.path.exists(os.path.join(args.init_from, "config.json")):
      return hf_io.load_hf(args.init_from), f"HF weights from {args.init_from}"
    return orbax_io.load_orbax(args.init_from), f"weights from {args.init_from}"
  model_cfg = model_config("tiny")
  lr, batch_size, max_tokens = data["lr"], data["batch_size"], data["max_tokens"]
  decides = (model_cfg, [r.uid for r in records], args.warm_steps, lr, batch_size, max_tokens, args.seed)
  where = None
  if args.warm_cache:
    where = os.path.join(args.warm_cache, "tiny-" + hashlib.sha256(repr(decides).encode()).hexdigest()[:16])
    if os.path.exists(os.path.join(where, "model_config.json")):
      return orbax_io.load_orbax(where), f"the warm-start kept in {where}"
  pairs = warmstart_pairs(records, tok, max_response_len=data["max_new_tokens"])
  fns = build_step(model_cfg, LearnerConfig(max_tokens_per_mb=max_tokens, min_bucket=64),
                   make_learner_mesh(jax.devices()[:1]))
  start = time.perf_counter()
  params, loss, steps = warmstart.sft(fns, fns.init_params(args.seed), pairs, steps=args.warm_steps,
                                      batch_size=batch_size, lr=lr, max_tokens=max_tokens, seed=args.seed)
  model = nnx.merge(fns.graphdef, jax.device_get(params))
  if where is not None:
    orbax_io.save_orbax(model, where)
  return model, (f"warm-started {steps} steps on {len(pairs)} worked solutions (loss {loss:.3f}, "
                 f"{time.perf_counter() - start:.0f} s)" + (f", kept in {where}" if where else ""))


def spec_figures(counters: dict, drafted_at, accepted_at) -> str:
  """A variant's speculation figures from a scheduler's counters (summed over replicas): `, tokens per slot-forward
  1.00` without speculation; with it `, tokens per slot-forward F, slot-forwards N (drafted share d), drafted D,
  accepted A, acceptance X, by position a1 .. ak, accepted per slot-forward by position p1 .. pk` (see the module
  docstring). bench_agents.py prints the same."""
  import numpy as np

  if "spec_forwards" not in counters:
    return ", tokens per slot-forward 1.00"
  at = accepted_at / np.maximum(drafted_at, 1)
  forwards = max(1, counters["spec_forwards"])
  return (f", tokens per slot-forward {counters['spec_tokens'] / forwards:.2f}, slot-forwards "
          f"{counters['spec_forwards']} (drafted share {drafted_at[0] / forwards:.3f}), drafted "
          f"{counters['spec_drafted']}, accepted {counters['spec_accepted']}, acceptance "
          f"{counters['spec_accepted'] / max(1, counters['spec_drafted']):.3f}, by position "
          + " ".join(f"{a:.3f}" for a in at) + ", accepted per slot-forward by position "
          + " ".join(f"{a / forwards:.3f}" for a in accepted_at))


def by_epoch_line(name: str, variant: str, by_epoch) -> str:
  """`<name> speculation=<variant>: acceptance by epoch a of d, ...` from (accepted, drafted) per epoch."""
  return f"{name} speculation={variant}: acceptance by epoch " + ", ".join(
      f"{a / max(1, d):.3f} of {d}" for a, d in by_epoch)


def best_rounds(run, variants, repeats: int) -> dict:
  """Each variant's fastest round: one untimed round of each first (it compiles what the rounds run), then `repeats`
  rounds alternating between them. `run(v)` returns a round's figures, its seconds second."""
  for v in variants:
    run(v)
  rounds = [(v, run(v)) for _ in range(repeats) for v in variants]
  return {v: min((r for w, r in rounds if w == v), key=lambda r: r[1]) for v in variants}


def speculation_main(args) -> None:
  """Speculation off vs `suffix` on the revisited-prompts workload (warm-started tiny model, its own prompts) and the
  long-tail one (random weights): see the module docstring."""
  import jax
  import numpy as np
  from flax import nnx

  from areal_jax.config import load_config
  from areal_jax.data.config import DataConfig
  from areal_jax.data.dataset import build_dataset
  from areal_jax.models import create
  from areal_jax.sampler import Engine, Request, SamplerConfig, SamplingParams, Scheduler
  from areal_jax.tokenizer import load_tokenizer

  k = int(args.decode_steps.split(",")[-1])
  variants = ("off", "suffix")
  workloads = ("revisit", "longtail") if args.spec_workload == "both" else (args.spec_workload,)

  def measure(name, model, groups, *, max_new, eos_ids, ignore_eos):
    """Times `groups` (a list of epochs, each a list of (prompt, answers, max_new_tokens)) under both variants:
    an untimed round of each, then `--repeats` alternating rounds; prints each variant's best."""
    max_prompt = max(len(p) for epoch in groups for p, _, _ in epoch)
    max_seq_len = max_prompt + max_new
    engines, params = {}, None
    for v in variants:
      cfg = SamplerConfig(num_slots=args.slots, page_size=args.page_size, max_seq_len=max_seq_len,
                          max_new_tokens=max_new, num_pages=args.slots * -(-max_seq_len // args.page_size) + 1,
                          max_prefill_tokens=4096, decode_steps=k, speculation=v, spec_tokens=args.spec_tokens)
      engines[v] = Engine(model=model, config=cfg)
      params = engines[v].load_params(model) if params is None else params

    def run(v):
      sched = Scheduler(engine=engines[v], params=params, eos_ids=eos_ids)
      jax.block_until_ready(sched.state)
      tokens, by_epoch, t = 0, [], time.perf_counter()
      group = itertools.count()
      for epoch in groups:  # an epoch's prompts once its predecessor's answers are all in (as RL's epochs are)
        before = dict(sched.counters)
        for prompt, n, m in epoch:
          sched.submit(Request(group_id=next(group), prompt_ids=prompt, num_answers=n, sampling=SamplingParams(
              temperature=1.0, max_new_tokens=int(m), ignore_eos=ignore_eos, seed=args.seed)))
        while not sched.idle:
          tokens += sum(len(x.tokens) for x in sched.step())
        if v != "off":
          by_epoch.append((sched.counters["spec_accepted"] - before["spec_accepted"],
                           sched.counters["spec_drafted"] - before["spec_drafted"]))
      jax.block_until_ready(sched.state)
      return tokens, time.perf_counter() - t, sched, by_epoch

    best = best_rounds(run, variants, args.repeats)  # the same requests draw the same tokens: the same shapes
    rate = {}
    for v in variants:
      tokens, seconds, sched, by_epoch = best[v]
      rate[v] = tokens / seconds
      part = sched.seconds
      line = (f"{name} speculation={v}: tokens {tokens}, seconds {seconds:.2f}, tokens/s {rate[v]:.0f}, decode calls "
              f"{sched.counters['decode_calls']}, host s {seconds - part['device_wait']:.2f} (drafter "
              f"{part['drafts']:.2f}), device wait s {part['device_wait']:.2f}")
      print(line + spec_figures(sched.counters, getattr(sched, "spec_drafted_at", None),
                                getattr(sched, "spec_accepted_at", None)), flush=True)
      if len(by_epoch) > 1:
        print(by_epoch_line(name, v, by_epoch), flush=True)
    print(f"{name} ratio suffix / off tokens/s: {rate['suffix'] / rate['off']:.2f}x", flush=True)

  print(f"decode_steps {k}, spec_tokens {args.spec_tokens}, {args.slots} slots, temperature 1.0; "
        f"{jax.devices()[0].platform}", flush=True)
  if "revisit" in workloads:
    path = pathlib.Path(__file__).resolve().parent.parent / "configs" / "math.py"
    c = load_config(f"{path}:tiny")
    tok = load_tokenizer(c.model.tokenizer)
    dataset = build_dataset(DataConfig.from_config(c.data), tok)
    records = list(dataset.records)
    model, made = spec_policy(args, {"lr": c.warmstart.lr, "batch_size": c.warmstart.batch_size,
                                     "max_tokens": c.learner.max_tokens_per_mb,
                                     "max_new_tokens": c.sampler.max_new_tokens}, records, tok)
    picked = [records[i].prompt_ids for i in range(args.prompts)]
    print(f"revisit: {args.prompts} prompts of the tiny preset's data x {args.group} answers x {args.epochs} epochs, "
          f"EOS ends an answer (at most {c.sampler.max_new_tokens} tokens); policy: {made}", flush=True)
    measure("revisit", model, [[(p, args.group, c.sampler.max_new_tokens) for p in picked]] * args.epochs,
            max_new=c.sampler.max_new_tokens, eos_ids=[tok.eos_id], ignore_eos=False)
  if "longtail" in workloads:
    model_cfg = model_config(args.shape)
    model = nnx.jit(lambda: create(model_cfg, seed=args.seed))()
    args.workload = "longtail"
    prompts, lengths = workload(args, model_cfg.vocab_size)
    print(f"longtail: {args.requests} answers, mean {lengths.mean():.1f} / max {int(lengths.max())} tokens, EOS "
          f"ignored; random weights ({args.shape})", flush=True)
    measure("longtail", model, [[(p, 1, n) for p, n in zip(prompts, lengths)]], max_new=int(lengths.max()),
            eos_ids=[], ignore_eos=True)


def main():
  args = parse_args()
  if args.speculation:
    return speculation_main(args)
  if args.host_slots:
    return host_main(args)
  if args.replicas:
    import os
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    return replicas_main(args)
  import jax
  import numpy as np
  from flax import nnx

  from areal_jax.learner.flops import measure_bandwidth
  from areal_jax.models import create
  from areal_jax.sampler import Engine, Request, SamplerConfig, SamplingParams, Scheduler
  from areal_jax.sampler.sampling import request_key

  model_cfg = model_config(args.shape)
  model = nnx.jit(lambda: create(model_cfg, seed=args.seed))()
  prompts, lengths = workload(args, model_cfg.vocab_size)
  total = int(lengths.sum())
  max_prompt, longest = max(map(len, prompts)), int(lengths.max())
  max_seq_len = max_prompt + longest
  s = args.slots
  print(f"model: {model_cfg.num_layers} layers, hidden {model_cfg.hidden_size}, vocab {model_cfg.vocab_size}, "
        f"{sum(x.size for x in jax.tree.leaves(nnx.state(model))) / 1e6:.1f}M params; {jax.devices()[0].platform}")
  print(f"workload {args.workload}: {args.requests} answers, mean {lengths.mean():.1f} / max {longest} tokens "
        f"({longest / lengths.mean():.2f}x the mean), {s} slots")

  # --- engine, one per decode_steps value ---
  ks = [int(k) for k in args.decode_steps.split(",")]
  engines = {}
  for k in ks:
    cfg = SamplerConfig(num_slots=s, page_size=args.page_size, max_seq_len=max_seq_len, max_new_tokens=longest,
                        num_pages=s * -(-max_seq_len // args.page_size) + 1, max_prefill_tokens=4096, decode_steps=k)
    engines[k] = Engine(model=model, config=cfg)
  params = engines[ks[-1]].load_params(model)

  def run_engine(k, items):
    sched = Scheduler(engine=engines[k], params=params)
    sched.state = engines[k].warmup(params, sched.state, max_context=max_prompt)
    for g, (p, n) in enumerate(items):
      sched.submit(Request(group_id=g, prompt_ids=p, sampling=SamplingParams(max_new_tokens=int(n), seed=args.seed)))
    jax.block_until_ready(sched.state)
    done, t = 0, time.perf_counter()
    while not sched.idle:
      done += sum(len(x.tokens) for x in sched.step())
    jax.block_until_ready(sched.state)
    return done, time.perf_counter() - t, sched

  for k in ks:
    run_engine(k, [(p, 2) for p in prompts[:s]])  # compiles

  # --- static batches (and the same batches through transformers) ---
  graphdef, _ = nnx.split(model)
  static = make_static_generate(graphdef, s, cache_len=32 + longest)
  batches = [list(range(i, min(i + s, args.requests))) for i in range(0, args.requests, s)]

  def static_batch(batch, steps=None):
    toks = np.zeros((s, 32), np.int32)
    lens = np.ones(s, np.int32)
    keys = np.zeros((s, 2), np.uint32)
    for row, j in enumerate(batch):
      toks[row, :len(prompts[j])], lens[row], keys[row] = prompts[j], len(prompts[j]), request_key(args.seed, j, 0)
    steps = int(max(lengths[j] for j in batch)) if steps is None else steps
    return static(params, toks, lens, keys, steps)

  static_batch(batches[0], steps=2).block_until_ready()  # compile

  def run_static():
    t = time.perf_counter()
    for batch in batches:
      static_batch(batch).block_until_ready()
    return time.perf_counter() - t

  variants = {f"engine (paged, decode_steps={k})": k for k in ks}
  variants["static batches (dense JAX)"] = "static"
  if args.peer == "hf":
    hf_generate, threads = make_hf_generate(model, args.seed)
    hf_generate([prompts[0]], 2)  # first-call setup

    def run_hf():
      t = time.perf_counter()
      for batch in batches:
        hf_generate([prompts[j] for j in batch], int(max(lengths[j] for j in batch)))
      return time.perf_counter() - t

    variants[f"hf transformers generate (torch, {threads} threads)"] = "hf"

  # Alternate the variants so that a change in machine load does not favour one; keep each one's best time.
  seconds, scheds = dict.fromkeys(variants, float("inf")), {}
  for _ in range(args.repeats):
    for name, v in variants.items():
      if v == "static":
        t = run_static()
      elif v == "hf":
        t = run_hf()
      else:
        engine_tokens, t, scheds[v] = run_engine(v, list(zip(prompts, lengths)))
        assert engine_tokens == total, (engine_tokens, total)
      seconds[name] = min(seconds[name], t)

  # --- report ---
  k = ks[-1]
  main_name = f"engine (paged, decode_steps={k})"
  sched = scheds[k]
  static_steps = sum(int(max(lengths[j] for j in b)) for b in batches)
  print(f"engine (decode_steps={k}): {sched.counters['decode_steps']} decode steps in "
        f"{sched.counters['decode_calls']} device calls + {sched.counters['prefill_rows']} prefill rows; static: "
        f"{static_steps} decode steps + {len(batches)} prefills of {s} rows")
  print(f"{'variant':<48}{'tokens':>9}{'seconds':>10}{'tokens/s':>11}")
  for name, t in seconds.items():
    print(f"{name:<48}{total:>9}{t:>10.2f}{total / t:>11.0f}")
  for name, t in seconds.items():
    if name != main_name:
      print(f"ratio {main_name} / {name}: {t / seconds[main_name]:.2f}x")
  print(f"(ideal engine / static on this workload, equal step costs and free admission: "
        f"{static_steps * s / total:.2f}x)")
  for j in ks:
    part = scheds[j].seconds
    busy = sum(part.values())
    print(f"engine decode_steps={j}, where a step's time goes: " + ", ".join(
        f"{name} {part[name] / busy:.0%}" for name in ("host_dispatch", "device_wait", "host_record", "weight_swap")))

  # --- roofline ---
  bandwidth = measure_bandwidth(jax.devices()[0])
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
  kv_per_token = 2 * model_cfg.num_layers * model_cfg.num_kv_heads * model_cfg.head_dim * 4
  steps = sched.counters["decode_steps"]
  mean_context = np.mean([len(p) for p in prompts]) + lengths.mean() / 2
  roofline_s = (steps * param_bytes + total * mean_context * kv_per_token) / bandwidth
  print(f"memory bandwidth {bandwidth / 1e9:.1f} GB/s; params {param_bytes / 1e6:.1f} MB; engine at "
        f"{roofline_s / seconds[main_name]:.1%} of the memory-bandwidth roofline ({total / roofline_s:.0f} tokens/s "
        f"at {s} slots)")


if __name__ == "__main__":
  main()
