"""AOT check: the tiny preset's six programs compile for a v5e:2x2 topology description (libtpu, no TPU) and fit;
a program over the HBM is reported and makes the tool exit non-zero."""

import dataclasses
import os
import subprocess
import sys
import types

import pytest

pytest.importorskip("libtpu")

from areal_jax import aot_check  # noqa: E402
from areal_jax.config import load_config  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The tiny preset cut to one layer and one bucket of 128 tokens: the same programs, compiled in seconds.
SMALL = {"model.num_layers": 1, "learner.max_tokens_per_mb": 128}


@pytest.fixture(scope="module")
def reports():
  config = load_config(os.path.join(ROOT, "configs/math.py:tiny"), **SMALL)
  return aot_check.check(config, sampler_topology="v5e:2x2", learner_topology="v5e:2x2")


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
  assert by_name["decode"].mesh == {"data": 4, "tensor": 1}
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


def _learner(attention: str):
  config = load_config(os.path.join(ROOT, "configs/math.py:tiny"), **{
      "model.num_layers": 2, "model.vocab_size": 1000, "learner.vocab_chunk": 96, "learner.max_tokens_per_mb": 384,
      "model.attention": attention})
  mesh = aot_check.make_mesh(aot_check.topology_devices("v5e:2x2"), {"fsdp": -1, "tensor": 1})
  cfg = aot_check.LearnerConfig.from_config(config.learner, max_new_tokens=config.sampler.max_new_tokens)
  return aot_check.ModelConfig.from_config(config.model), cfg, mesh


def test_executed_flops_count_every_layer_and_chunk_and_the_skipped_blocks():
  """`learner_flops` equals XLA's count of the same program without loops (layers unrolled, one vocabulary chunk: the
  chunks' padding aside), and rows of short sequences cost dense attention far more than the splash kernel."""
  model_cfg, cfg, mesh = _learner("dense")
  executed = aot_check.learner_flops(model_cfg, cfg, mesh, temperature=1.0, seq_len=32)
  plain = aot_check.build_step(dataclasses.replace(model_cfg, scan_layers=False),
                               dataclasses.replace(cfg, vocab_chunk=0), mesh).lower(384)
  for name in ("logprobs", "accumulate"):
    want = plain[name].compile().cost_analysis()["flops"]
    assert want <= executed[name] <= 1.06 * want, (name, executed[name], want)  # 11 chunks of 96 hold 1056 ids
  model_cfg, cfg, mesh = _learner("splash")
  splash = aot_check.learner_flops(model_cfg, cfg, mesh, temperature=1.0, seq_len=32)
  for name in ("logprobs", "accumulate"):  # splash visits one block of 128 keys per query block, dense all 384
    assert splash[name] < 0.95 * executed[name], (splash, executed)


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
