r"""Checks, without a TPU, that a preset's learner and sampler fit their slices: compiles every device program for a
named TPU topology (libtpu only) and prints per-device memory against the chip's HBM, FLOPs (the model's, and for the
learner what the programs execute over that) and compile times.

  python tools/aot_check.py --config=configs/math.py:qwen2.5-1.5b --sampler_topology=v5e:2x4 --learner_topology=v5e:2x4
  python tools/aot_check.py --config=configs/math.py:r1-distill-qwen-7b --learner_topology=v5p:2x2x2 \
      --sampler_topology=v5e:2x4 --config.mesh.sampler_tensor=4

  python tools/aot_check.py --config=configs/math.py:qwen2.5-1.5b --colocated_topology=v5p:2x2x1  # mesh.colocated

Topology names are libtpu's (`v5e:4x4`, `v5p:2x2x2`, `v6e:2x4`, `v4:2x2x1`). An empty topology skips that role.
Exits with status 1, naming the program, its bytes and the HBM, when a program does not fit. See `areal_jax.aot_check`.
"""

import sys

from absl import flags

from areal_jax import cli
from areal_jax.aot_check import check, check_colocated, format_table
from areal_jax.config import validate

_CONFIG = cli.define_config()
_SAMPLER = flags.DEFINE_string("sampler_topology", "v5e:2x2", "The sampler slice's TPU topology ('' = skip).")
_LEARNER = flags.DEFINE_string("learner_topology", "v5e:2x2", "The learner slice's TPU topology ('' = skip).")
_COLOCATED = flags.DEFINE_string("colocated_topology", "", "Both roles on every device of this topology "
                                  "(mesh.colocated): each role's programs with the other's state resident; replaces "
                                  "--sampler_topology and --learner_topology.")
_HBM = flags.DEFINE_float("hbm_gib", 0.0, "HBM per device in GiB (0 = from the device kind).")
_FLOP_SEQ_LEN = flags.DEFINE_integer(
    "flop_seq_len", 4096, "The learner's FLOPs (model and executed) are for rows packed with sequences of this many "
    "tokens; 0 = leave the executed FLOPs out.")


def main(argv):
  del argv
  settings = validate(_CONFIG.value, data=False)  # a compile check reads no dataset
  if _COLOCATED.value:
    reports = check_colocated(settings, _COLOCATED.value, hbm_gib=_HBM.value, flop_seq_len=_FLOP_SEQ_LEN.value or None)
  else:
    reports = check(settings, sampler_topology=_SAMPLER.value, learner_topology=_LEARNER.value, hbm_gib=_HBM.value,
                    flop_seq_len=_FLOP_SEQ_LEN.value or None)
  print(format_table(reports))
  unfit = [r for r in reports if not r.fits]
  for r in unfit:
    print(f"does not fit: {r.verdict()}", file=sys.stderr)
  if unfit:
    sys.exit(1)


if __name__ == "__main__":
  cli.run(main)
