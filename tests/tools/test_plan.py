"""`tools/plan.py` refuses to plan a real model on a toy preset's settings."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QWEN_1_5B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 1536,
             "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
             "max_position_embeddings": 131072, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
             "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


@pytest.mark.slow  # a subprocess
def test_a_hf_model_on_the_default_preset_is_refused_naming_the_settings(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps(QWEN_1_5B))
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plan.py"), f"--model={tmp_path}/",
                         "--device=h800", "--chips=8", "--plot="], capture_output=True, text=True, timeout=300,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode != 0
  assert (f"FATAL --model={tmp_path}/: 1.78B parameters, planned with the `tiny` preset's sampler and learner settings"
          in proc.stderr), proc.stderr[-2000:]
  assert "pass --config=configs/math.py:PRESET" in proc.stderr


@pytest.mark.slow  # a subprocess
def test_the_plan_prints_every_efficiency_and_fixed_cost_with_its_source():
  """Every field of `Efficiency` is printed with the figure the plan used and where it came from: a published
  measurement, the host's own measured work, or the plain statement that no published figure was found."""
  import dataclasses

  from areal_jax.sim.costs import HOST_MEASURED, PUBLISHED, UNSOURCED, Efficiency

  proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plan.py"), "--device=v5p", "--chips=2",
                         "--eta=0", "--sampler_chips=1", "--steps=3", "--warmup=1", "--plot="],
                        capture_output=True, text=True, timeout=300, cwd=ROOT,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 0, proc.stderr[-2000:]
  printed = dict(line.strip().split(" ", 1) for line in
                 proc.stdout.split("efficiencies and fixed costs:\n")[1].split("\n") if line.startswith("  "))
  assert set(printed) == {f.name for f in dataclasses.fields(Efficiency)}
  for name, text in printed.items():
    source = PUBLISHED["v5p"][name][1] if name in PUBLISHED["v5p"] else HOST_MEASURED.get(name, UNSOURCED)
    assert text.endswith(f"({source})"), (name, text)
  assert printed["learner_mfu"].startswith("0.715 ")
