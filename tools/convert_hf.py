r"""Converts policy weights between a HF model directory and Orbax.

  # HF -> Orbax policy directory (local or gs://)
  python tools/convert_hf.py --hf_dir=/ckpt/Qwen2.5-1.5B --orbax_dir=gs://bucket/qwen-1.5b
  # Orbax (policy directory, or a run / its checkpoints/ directory at --step, default latest) -> HF
  python tools/convert_hf.py --orbax_dir=/tmp/run --hf_dir=/tmp/export --to=hf [--step=40]

The HF side writes config.json + model.safetensors, loadable by transformers.AutoModelForCausalLM; copy the
tokenizer files next to it yourself if you want a complete model directory.
"""

from absl import app, flags

from areal_jax import models
from areal_jax.evaluate import checkpoints
from areal_jax.models import orbax_io

_HF = flags.DEFINE_string("hf_dir", None, "HF model directory (config.json + safetensors).", required=True)
_ORBAX = flags.DEFINE_string("orbax_dir", None, "Orbax policy directory, or a run directory or its checkpoints/.",
                             required=True)
_TO = flags.DEFINE_enum("to", "orbax", ["orbax", "hf"], "Direction of the conversion.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step of a run directory (default: latest).")


def main(argv):
  del argv
  if _TO.value == "orbax":
    orbax_io.save_orbax(models.load_hf(_HF.value), _ORBAX.value)
    print(f"wrote Orbax policy {_ORBAX.value}")
  else:
    source = checkpoints.resolve(_ORBAX.value)
    if source.kind == "hf":
      raise app.UsageError(f"--orbax_dir={_ORBAX.value} is a HF model directory, not Orbax")
    step = _STEP.value
    if source.kind == "run" and step is None:
      step = max(checkpoints.scan(source.path).complete, default=None)
      if step is None:
        raise app.UsageError(f"--orbax_dir={_ORBAX.value}: no complete checkpoint in {source.path}")
    models.save_hf(orbax_io.load_orbax(str(source.path), step=step), _HF.value)
    print(f"wrote HF model {_HF.value} from {source.path}" + (f" step {step}" if source.kind == "run" else ""))


if __name__ == "__main__":
  app.run(main)
