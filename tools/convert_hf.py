r"""Converts policy weights between a HF model directory and Orbax.

  # HF -> Orbax policy directory (local or gs://)
  python tools/convert_hf.py --hf_dir=/ckpt/Qwen2.5-1.5B --orbax_dir=gs://bucket/qwen-1.5b
  # Orbax (policy directory, or a run / its checkpoints/ directory at --step, default latest) -> HF
  python tools/convert_hf.py --orbax_dir=/tmp/run --hf_dir=/tmp/export --to=hf [--step=40]

  # A LoRA run's adapters as a PEFT adapter directory (peft.PeftModel.from_pretrained onto its base)
  python tools/convert_hf.py --orbax_dir=/tmp/run --hf_dir=/tmp/adapters --to=peft [--base_model=Qwen/Qwen2.5-1.5B]

The HF side writes config.json + model.safetensors, loadable by transformers.AutoModelForCausalLM; copy the
tokenizer files next to it yourself if you want a complete model directory. A LoRA run's checkpoints hold the
adapters alone: `--to=hf` reads the base they name and writes the merged weights.
"""

import jax
from absl import app, flags
from flax import nnx

from areal_jax import models
from areal_jax.checkpoint import sources
from areal_jax.models import hf_io, orbax_io

_HF = flags.DEFINE_string("hf_dir", None, "HF model directory (config.json + safetensors), or PEFT adapters.",
                          required=True)
_ORBAX = flags.DEFINE_string("orbax_dir", None, "Orbax policy directory, or a run directory or its checkpoints/.",
                             required=True)
_TO = flags.DEFINE_enum("to", "orbax", ["orbax", "hf", "peft"], "Direction of the conversion.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step of a run directory (default: latest).")
_BASE = flags.DEFINE_string("base_model", "", "--to=peft: the base model's name or path, for adapter_config.json.")


def _load(source: sources.Source, step: int | None):
  """The model of a policy directory or of a run's checkpoint (LoRA: base and adapters), on the first device."""
  if source.kind == "policy":
    return orbax_io.load_orbax(str(source.path))
  model_cfg = sources.read_meta(source.path, step).model_cfg
  graphdef, abstract = orbax_io.abstract_params(model_cfg)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  params = sources.load_params(source.path, step, model_cfg, shardings=jax.tree.map(lambda _: device, abstract))
  return nnx.merge(graphdef, params)


def main(argv):
  del argv
  if _TO.value == "orbax":
    orbax_io.save_orbax(models.load_hf(_HF.value), _ORBAX.value)
    print(f"wrote Orbax policy {_ORBAX.value}")
    return
  source = sources.resolve(_ORBAX.value)
  if source.kind == "hf":
    raise app.UsageError(f"--orbax_dir={_ORBAX.value} is a HF model directory, not Orbax")
  step = _STEP.value
  if source.kind == "run" and step is None:
    step = max(sources.scan(source.path).complete, default=None)
    if step is None:
      raise app.UsageError(f"--orbax_dir={_ORBAX.value}: no complete checkpoint in {source.path}")
  model = _load(source, step)
  where = f"{source.path}" + (f" step {step}" if source.kind == "run" else "")
  if _TO.value == "peft":
    if not model.cfg.lora_rank:
      raise app.UsageError(f"--to=peft: {where} holds full weights, no LoRA adapters")
    hf_io.save_peft(model, _HF.value, base_model=_BASE.value)
    print(f"wrote PEFT adapters {_HF.value} from {where}")
  else:
    models.save_hf(model, _HF.value)
    print(f"wrote HF model {_HF.value} from {where}" + (" (LoRA adapters merged)" if model.cfg.lora_rank else ""))


if __name__ == "__main__":
  app.run(main)
