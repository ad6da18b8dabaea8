"""The checkpoint's `meta` record: written and read by a real `Checkpointer`, old dict metas read, bad ones named."""

import json

import jax.numpy as jnp
import orbax.checkpoint as ocp
import pytest

from areal_jax.checkpoint import sources
from areal_jax.checkpoint.store import CheckpointMeta, Checkpointer
from areal_jax.models import ModelConfig, orbax_io

CFG = ModelConfig(family="qwen3", vocab_size=40, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, lora_rank=4)
PARAMS = {"w": jnp.arange(6.).reshape(2, 3)}
OPT = {"count": jnp.array(3)}
MODEL_CONFIG = json.loads(json.dumps(orbax_io.config_to_json(CFG)))  # as read back (lists for tuples)
CONTROLLER = {"dataset": {"epoch": 0, "index": 7}, "undone": ["p1", "p2"], "next_group": 5}
# What the trainer's leader wrote before the record: the same keys.
OLD = {"step": 4, "version": 4, "updates": 8, "controller": CONTROLLER, "elapsed_s": 12.5,
       "model_config": MODEL_CONFIG, "critic": "lora",
       "base": {"source": {"warmstart": "run/warmstart"}, "fingerprint": [0.5, 1.5]}}


def test_roundtrips_through_a_checkpointer(tmp_path):
  meta = CheckpointMeta(step=2, version=2, updates=3, controller=CONTROLLER, elapsed_s=1.25,
                        model_config=MODEL_CONFIG, critic="copy", base=OLD["base"])
  ckpt = Checkpointer(str(tmp_path), every_steps=1)
  assert ckpt.save(2, params=PARAMS, opt_state=OPT, meta=meta)
  assert ckpt.save(3, params=PARAMS, opt_state=OPT, meta=CheckpointMeta(step=3))  # a follower's
  ckpt.close()
  ckpt = Checkpointer(str(tmp_path), every_steps=1)
  _, _, restored = ckpt.restore(2, params=PARAMS, opt_state=OPT)
  assert restored == meta == ckpt.read_meta(2) == sources.read_meta(tmp_path, 2)
  assert restored.model_cfg == CFG
  follower = ckpt.read_meta(3)
  ckpt.close()
  assert follower == CheckpointMeta(step=3) and follower.controller is None and follower.base is None
  with ocp.Checkpointer(ocp.JsonCheckpointHandler()) as raw:  # None fields are left out of the JSON
    assert raw.restore(tmp_path / "3" / "meta") == {"step": 3, "version": 0, "updates": 0, "elapsed_s": 0.0,
                                                    "model_config": {}, "critic": ""}
  with pytest.raises(ValueError, match="the meta of step 3 holds no model_config"):
    follower.model_cfg  # pylint: disable=pointless-statement


def test_reads_a_meta_written_before_the_record(tmp_path):
  with ocp.CheckpointManager(tmp_path) as mngr:
    mngr.save(4, args=ocp.args.Composite(params=ocp.args.StandardSave(PARAMS), meta=ocp.args.JsonSave(OLD)))
    mngr.wait_until_finished()
  meta = sources.read_meta(tmp_path, 4)
  assert meta.to_json() == OLD and meta.model_cfg == CFG and meta.controller["undone"] == ["p1", "p2"]
  ckpt = Checkpointer(str(tmp_path), every_steps=1)
  assert ckpt.read_meta(4) == meta
  ckpt.close()
  older = CheckpointMeta.from_json({"step": 1, "version": 1, "elapsed_s": 3, "data": {}}, where="old")
  assert older == CheckpointMeta(step=1, version=1, elapsed_s=3.0)  # an int time, a key no longer read


def test_a_meta_without_step_or_with_a_wrong_type_is_named(tmp_path):
  with ocp.CheckpointManager(tmp_path) as mngr:
    mngr.save(1, args=ocp.args.Composite(meta=ocp.args.JsonSave({"version": 1})))
    mngr.wait_until_finished()
  with pytest.raises(ValueError, match=r"1/meta: the checkpoint meta has no `step` \(keys: \['version'\]\)"):
    sources.read_meta(tmp_path, 1)
  ckpt = Checkpointer(str(tmp_path), every_steps=1)
  with pytest.raises(ValueError, match=r"step 1: the checkpoint meta has no `step`"):
    ckpt.read_meta(1)
  with pytest.raises(TypeError, match="checkpoint of step 2: meta is a dict, not a CheckpointMeta"):
    ckpt.save(2, params=PARAMS, opt_state=OPT, meta={"step": 2})
  ckpt.close()
  for bad, message in [({"step": "3"}, r"`step` is '3' \(str\), not int"),
                       ({"step": True}, r"`step` is True \(bool\), not int"),
                       ({"step": 3, "controller": []}, r"`controller` is \[\] \(list\), not dict or null"),
                       ({"step": 3, "model_config": None}, r"`model_config` is None \(NoneType\), not dict"),
                       ([3], r"is a list, not a JSON object")]:
    with pytest.raises(ValueError, match=rf"^where: the checkpoint meta(?:'s)? {message}"):
      CheckpointMeta.from_json(bad, where="where")
