"""The warm-start shared between runs (`warmstart.cache_dir`): keyed by what decides it, found by the next run with
the same settings instead of trained again, never read half-written."""

import logging

import jax
import numpy as np
from etils import epath
from flax import nnx

from areal_jax import config as config_lib
from areal_jax.data import build_dataset
from areal_jax.learner.step import build_step, make_learner_mesh
from areal_jax.models import orbax_io
from areal_jax.run import initial_weights
from areal_jax.tokenizer import load_tokenizer
from run_checks import FAST

_key, _share = initial_weights._shared_cache, initial_weights._share  # pylint: disable=protected-access


def _settings(cache_dir, **overrides):
  config = config_lib.load_config(FAST, **{"warmstart.steps": 2, "warmstart.cache_dir": str(cache_dir), **overrides})
  return config_lib.validate(config, num_devices=4)


def _fns(settings):
  return build_step(settings.model, settings.learner, make_learner_mesh(jax.devices()[:1]))


def test_the_key_holds_what_decides_the_warm_start(tmp_path):
  base = _settings(tmp_path)
  fns = _fns(base)
  key = _key(base, fns)
  assert key.parent == epath.Path(tmp_path) and key == _key(_settings(tmp_path), fns)
  assert _key(_settings(tmp_path, total_steps=7, **{"eval.every_steps": 5}), fns) == key
  for change in ({"seed": 1}, {"warmstart.lr": 1e-3}, {"data.synthetic_size": 1000}, {"sampler.max_new_tokens": 30}):
    assert _key(_settings(tmp_path, **change), fns) != key, change
  assert _key(_settings(""), fns) is None


def test_a_second_run_takes_the_shared_warm_start_and_a_racing_copy_stays(tmp_path, caplog):
  settings = _settings(tmp_path / "shared")
  fns = _fns(settings)
  tokenizer = load_tokenizer(settings.model_source.tokenizer)
  train = build_dataset(settings.data, tokenizer, split="train")
  start = fns.init_params(0)
  with caplog.at_level(logging.INFO):
    first = initial_weights.initial_base(settings, fns, start, train, tokenizer, epath.Path(tmp_path / "a"))
    assert "warm-start: done after 2 steps" in caplog.text and "shared in" in caplog.text
    caplog.clear()
    second = initial_weights.initial_base(settings, fns, fns.init_params(0), train, tokenizer,
                                          epath.Path(tmp_path / "b"))
  assert "is this run's" in caplog.text and "warm-start: done" not in caplog.text
  assert (tmp_path / "b" / "warmstart" / "model_config.json").exists()  # the run's own copy, as without the cache
  for x, y in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  shared = _key(settings, fns)
  before = sorted(p.name for p in shared.iterdir())
  _share(epath.Path(tmp_path / "b" / "warmstart"), shared)
  assert sorted(p.name for p in shared.iterdir()) == before  # another run's copy stays; no staging left behind
  assert sorted(p.name for p in shared.parent.iterdir()) == [shared.name]


def test_init_from_weights_are_warm_started_only_with_on_init_from(tmp_path):
  """`model.init_from`'s weights go to RL as they are, unless `warmstart.on_init_from` fine-tunes them on the worked
  solutions first (then the checkpoints' base is that warm-start); the random init is warm-started either way."""
  plain = _settings("")
  fns = _fns(plain)
  released = str(tmp_path / "released")
  orbax_io.save_orbax(nnx.merge(fns.graphdef, fns.init_params(5)), released)
  tokenizer = load_tokenizer(plain.model_source.tokenizer)
  train = build_dataset(plain.data, tokenizer, split="train")
  loaded = np.concatenate([np.ravel(x) for x in jax.tree.leaves(orbax_io.load_orbax(released))])

  def base(workdir, **overrides):
    settings = _settings("", **{"model.init_from": released, **overrides})
    out = initial_weights.initial_base(settings, fns, fns.init_params(0), train, tokenizer, epath.Path(workdir))
    return settings, np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(out)])

  as_released, params = base(tmp_path / "a")
  np.testing.assert_array_equal(params, loaded)
  assert initial_weights.base_source(as_released, epath.Path(tmp_path / "a")) == {"init_from": released}
  tuned, params = base(tmp_path / "b", **{"warmstart.on_init_from": True})
  assert params.shape == loaded.shape and not np.allclose(params, loaded)  # two warm-start steps moved them
  assert 0 < np.abs(params - loaded).max() < 0.1  # from the released weights, not from a fresh init
  assert (tmp_path / "b" / "warmstart" / "model_config.json").exists()
  assert initial_weights.base_source(tuned, epath.Path(tmp_path / "b")) == {
      "warmstart": str(tmp_path / "b" / "warmstart")}
