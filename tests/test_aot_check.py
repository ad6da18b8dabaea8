"""AOT check: the tiny preset's six programs compile for a v5e:2x2 topology description (libtpu, no TPU) and fit;
a program over the HBM is reported and makes the tool exit non-zero."""

import dataclasses
import os
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

pytest.importorskip("libtpu")

from areal_jax import aot_check  # noqa: E402
from areal_jax.config import load_config, validate  # noqa: E402

pytestmark = pytest.mark.slow  # whole runs, subprocess jobs or benchmarks: the full suite only

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The tiny preset cut to one layer and one bucket of 128 tokens: the same programs, compiled in seconds.
SMALL = {"model.num_layers": 1, "learner.max_tokens_per_mb": 128}


@pytest.fixture(scope="module")
def reports():
  settings = validate(load_config(os.path.join(ROOT, "configs/math.py:tiny"), **SMALL), data=False)
  return aot_check.check(settings, sampler_topology="v5e:2x2", learner_topology="v5e:2x2")


def test_tiny_compiles_and_fits(reports):
  assert [(r.role, r.program) for r in reports] == [
      ("learner", "logprobs"), ("learner", "accumulate"), ("learner", "apply"),
      ("sampler", "prefill"), ("sampler", "decode"), ("sampler", "insert")]
  for r in reports:
    assert r.fits, r.verdict()
    assert r.argument_bytes > 0 and r.output_bytes > 0 and r.total_bytes > 0, r
    assert r.hbm_bytes == 16 * aot_check.GIB and r.compile_s > 0
  by_name = {r.program: r for r in reports}
  assert by_name["accumulate"].flops == 3 * by_name["logprobs"].flops > 0  # forward + backward
  assert by_name["decode"].flops > 0 and by_name["insert"].flops == 0
  assert by_name["accumulate"].resident_bytes > 0  # the optimizer state, live but not an argument
  assert by_name["accumulate"].alias_bytes > 0  # the donated gradient accumulator
  assert by_name["decode"].mesh == {"data": 4, "expert": 1, "tensor": 1}
  # On TPU the learner's packed attention is the Pallas splash kernel: forward, and both backward kernels.
  assert "splash_mha_fwd" in " ".join(by_name["logprobs"].kernels), by_name["logprobs"].kernels
  names = " ".join(by_name["accumulate"].kernels)
  assert all(k in names for k in ("splash_mha_fwd", "splash_mha_dq", "splash_mha_dkv")), names
  assert "128 pages of 16" in by_name["decode"].note
  # Executed over model FLOPs, measured for the learner's model passes only.
  assert by_name["logprobs"].flop_ratio > 1 and by_name["accumulate"].flop_ratio > 1
  assert by_name["apply"].flop_ratio == by_name["decode"].flop_ratio == 0
  table = aot_check.format_table(reports)
  assert table.count("\n") == len(reports) + 1 and "| accumulate |" in table and "splash_mha_dkv" in table


def test_a_replica_s_programs_compile_on_its_share_and_list_their_collectives():
  """With mesh.sampler_replicas=2 the sampler's programs are one replica's, on 2 of the 4 chips; the compiled HLO's
  collectives are listed: the decode loop's all-reduces (whether any slot of any shard is live); in the prefill (one
  row per data shard) only the all-reduce of the rows' last positions, no all-gather of keys or values; in the
  speculative loop all-reduces only (each slot's emitted tokens written on its own shard)."""
  settings = validate(load_config(os.path.join(ROOT, "configs/math.py:tiny"), **SMALL,
                                  **{"mesh.sampler_replicas": 2, "sampler.speculation": "suffix"}), data=False)
  reports = aot_check.check(settings, sampler_topology="v5e:2x2", learner_topology=None)
  by_name = {r.program: r for r in reports}
  assert all(r.fits and r.mesh == {"data": 2, "expert": 1, "tensor": 1} for r in reports), reports
  assert all(isinstance(c, str) and " x" in c for r in reports for c in r.collectives)
  assert "collectives" in aot_check.format_table(reports)
  assert by_name["prefill"].collectives == ("all-reduce x1",) and by_name["insert"].collectives == ()
  for name in ("decode", "speculate"):
    assert by_name[name].collectives and all(c.startswith("all-reduce") for c in by_name[name].collectives), name
  with pytest.raises(ValueError, match="mesh.sampler_replicas=3"):
    aot_check.check(dataclasses.replace(settings, mesh=dataclasses.replace(settings.mesh, sampler_replicas=3)),
                    sampler_topology="v5e:2x2", learner_topology=None)


def test_tiny_moe_compiles_with_megablox_and_expert_parallelism():
  settings = validate(load_config(os.path.join(ROOT, "configs/math.py:tiny-moe"), **SMALL, **{
      "mesh.learner_expert": 2, "mesh.sampler_expert": 2}), data=False)
  reports = aot_check.check(settings, sampler_topology="v5e:2x2", learner_topology="v5e:2x2")
  by_name = {r.program: r for r in reports}
  for r in reports:
    assert r.fits, r.verdict()
  assert by_name["accumulate"].mesh == {"fsdp": 2, "expert": 2, "tensor": 1}
  assert by_name["decode"].mesh == {"data": 2, "expert": 2, "tensor": 1}
  for name in ("logprobs", "accumulate", "prefill", "decode"):
    assert any("gmm" in k for k in by_name[name].kernels), (name, by_name[name].kernels)
  # The grouped matmuls count each token-expert pair once (megablox states its FLOPs): no masked dense work.
  assert 1 < by_name["logprobs"].flop_ratio < 2 and 1 < by_name["accumulate"].flop_ratio < 2


def test_matmul_flops_count_every_pass_of_every_loop():
  """Scans count `length` times, a rematerialised forward pass again in the backward, shard_map bodies per device."""
  mesh = aot_check.make_mesh(aot_check.topology_devices("v5e:2x2"), {"fsdp": 4, "tensor": 1})
  x, ws = jax.ShapeDtypeStruct((64, 32), jnp.float32), jax.ShapeDtypeStruct((5, 32, 32), jnp.float32)
  layer = lambda x, w: (jnp.tanh(x @ w), None)
  forward = lambda x, ws: jax.lax.scan(jax.checkpoint(layer), x, ws)[0].sum()
  one = 2 * 64 * 32 * 32
  count = lambda f, *a: aot_check.matmul_flops(jax.make_jaxpr(f)(*a), devices=4)[0]
  assert count(forward, x, ws) == 5 * one
  assert count(jax.grad(forward, 1), x, ws) == 5 * 4 * one  # forward, its recomputation, two backward matmuls
  sharded = jax.shard_map(lambda x, w: x @ w, mesh=mesh, in_specs=(P("fsdp"), P()), out_specs=P("fsdp"))
  w = jax.ShapeDtypeStruct((32, 32), jnp.float32)
  assert count(jax.jit(sharded), x, w) == one  # 4 devices x a quarter of the rows


def _learner(attention: str, length: int = 384):
  config = load_config(os.path.join(ROOT, "configs/math.py:tiny"), **{
      "model.num_layers": 2, "learner.max_tokens_per_mb": length, "model.attention": attention})
  mesh = aot_check.make_mesh(aot_check.topology_devices("v5e:2x2"), {"fsdp": -1, "tensor": 1})
  settings = validate(config)
  return aot_check.build_step(settings.model, settings.learner, mesh), settings.model


def test_executed_flops_show_the_attention_no_segment_needs():
  """With one sequence filling each row the learner executes the model's FLOPs (the splash kernel's block pairs
  included, at 128-token blocks); with short sequences dense attention does far more work than splash."""
  fns, model_cfg = _learner("splash")
  model = aot_check._model_flops(model_cfg, fns.rows * 384, 384, fns.mesh.size)
  full = aot_check.learner_flops(fns, model_cfg, 384, 384)
  assert 1.0 <= full["logprobs"] / model < 1.05, full["logprobs"] / model
  assert 1.0 <= full["accumulate"] / (3 * model) < 1.2  # the flash backward recomputes q.k: 9 matmuls for 6
  short = aot_check.learner_flops(fns, model_cfg, 384, 32)
  dense = aot_check.learner_flops(*_learner("dense"), 384, 32)
  # Splash visits the 3 diagonal blocks of 128 keys, dense all 384 x 384 pairs: 2 matmuls of 2 x hd FLOPs per pair
  # forward; backward dense 4, splash 7 (dq and dkv recompute q.k).
  per_pair = 2 * model_cfg.head_dim * model_cfg.num_heads * model_cfg.num_layers
  assert dense["logprobs"] - short["logprobs"] == per_pair * 2 * (384 ** 2 - 3 * 128 ** 2)
  assert dense["accumulate"] - short["accumulate"] == pytest.approx(per_pair * (6 * 384 ** 2 - 9 * 3 * 128 ** 2),
                                                                    rel=1e-3)


def test_over_hbm_is_reported(reports):
  r = reports[0]
  small = dataclasses.replace(r, hbm_bytes=r.total_bytes - 1)
  assert not small.fits and "does NOT fit" in small.verdict() and "| NO |" in aot_check.format_table([small])


def test_hbm_by_device_kind():
  device = lambda kind, x, core=0: types.SimpleNamespace(device_kind=kind, coords=[x, 0, 0], core_on_chip=core)
  assert aot_check.hbm_bytes([device("TPU v5 lite", 0), device("TPU v5 lite", 1)]) == 16 * aot_check.GIB
  assert aot_check.hbm_bytes([device("TPU v4", 0), device("TPU v4", 0, core=1)]) == 16 * aot_check.GIB
  assert aot_check.hbm_bytes([device("TPU v7", 0)], hbm_gib=1.5) == 3 << 29
  with pytest.raises(ValueError, match="'TPU v7'.*hbm_gib"):
    aot_check.hbm_bytes([device("TPU v7", 0)])


def test_cli_exits_nonzero_when_a_program_does_not_fit():
  args = [f"--config.{k}={v}" for k, v in SMALL.items()]
  proc = subprocess.run(
      [sys.executable, "tools/aot_check.py", "--config=configs/math.py:tiny", "--learner_topology=",
       "--sampler_topology=v5e:2x2", "--hbm_gib=0.001", *args],
      cwd=ROOT, capture_output=True, text=True, timeout=300,
      env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT})
  assert proc.returncode == 1, proc.stderr[-2000:]
  assert "| decode |" in proc.stdout
  assert "does not fit: sampler/decode on v5e:2x2" in proc.stderr and "0.00 GiB HBM" in proc.stderr


def test_qlora_and_critic_programs_compile_with_each_others_state_resident():
  settings = validate(load_config(os.path.join(ROOT, "configs/math.py:tiny"), **SMALL, **{
      "learner.lora.rank": 4, "learner.lora.quantize_base": "nf4", "learner.critic": "lora"}), data=False)
  by_name = {r.program: r for r in aot_check.check_learner(settings, "v5e:2x2", flop_seq_len=None)}
  assert list(by_name) == ["logprobs", "accumulate", "apply", "critic_values", "critic_accumulate", "critic_apply"]
  assert all(r.fits for r in by_name.values()), [r.verdict() for r in by_name.values()]
  tiny = validate(load_config(os.path.join(ROOT, "configs/math.py:tiny"), **SMALL), data=False)
  plain = {r.program: r for r in aot_check.check_learner(tiny, "v5e:2x2", flop_seq_len=None)}
  # LoRA: the optimizer state and the update cover the adapters alone (the base in 4 bits); the critic's state (a
  # LoRA branch: adapters and a head) is resident beside them.
  assert by_name["apply"].argument_bytes < plain["apply"].argument_bytes / 2
  assert by_name["critic_apply"].argument_bytes < plain["apply"].argument_bytes / 2
  assert by_name["accumulate"].resident_bytes > by_name["apply"].resident_bytes > 0
  assert by_name["critic_accumulate"].flops == 3 * by_name["critic_values"].flops > 0
  assert by_name["critic_accumulate"].resident_bytes > 0


def test_colocated_roles_compile_on_the_same_chips_each_beside_the_others_state():
  """`mesh.colocated`: both roles' programs on every device of one topology; the sampler's pool is sized from what
  the learner's resident state and its step's working memory leave (gradients and the largest program's scratch, as
  a run reserves them: fewer pages than beside the state alone, and than on a slice of its own), and every learner
  program counts the sampler's weights and pool as resident."""
  settings = validate(load_config(os.path.join(ROOT, "configs/math.py:tiny"), **SMALL,
                                  **{"sampler.num_pages": 0, "mesh.colocated": True,
                                     "rollout.max_head_offpolicyness": 0}), data=False)
  # The tiny model in 11.5 MB: the learner's 2.4 MB of state and 4.9 MB of working memory take a visible share.
  hbm_gib = 11.5e6 / aot_check.GIB
  alone = aot_check.check(settings, sampler_topology="v5e:2x2", learner_topology="v5e:2x2", hbm_gib=hbm_gib,
                          flop_seq_len=None)
  both = aot_check.check_colocated(settings, "v5e:2x2", hbm_gib=hbm_gib, flop_seq_len=None)
  assert [(r.role, r.program) for r in both] == [(r.role, r.program) for r in alone]
  pages = lambda reports: int(next(r for r in reports if r.program == "decode").note.split(" pages")[0].split()[-1])
  held, grads = aot_check.learner_state_bytes(settings, "v5e:2x2")
  beside_state = aot_check.check_sampler(settings, "v5e:2x2", hbm_gib=hbm_gib, held_bytes=held)
  assert 0 < pages(both) < pages(beside_state) <= pages(alone) and held > 0 and grads > 0
  working = grads + max(r.temp_bytes for r in both if r.role == "learner")
  exact = aot_check.check_sampler(settings, "v5e:2x2", hbm_gib=hbm_gib, held_bytes=held + working)
  assert pages(both) == pages(exact)
  sampler_state = next(r for r in both if r.program == "decode").argument_bytes
  for a, b in zip(alone, both):
    extra = sampler_state if a.role == "learner" else held
    if a.program == "prefill":  # the pool, resident while it runs: smaller beside the learner's state
      assert b.resident_bytes - extra < a.resident_bytes
    else:
      assert b.resident_bytes == a.resident_bytes + extra, (a.program, a.resident_bytes, b.resident_bytes)
