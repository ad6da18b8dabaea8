"""Result files: when a stored result counts as done, and the settings that decide it."""

import logging

import pytest
from etils import epath

from areal_jax.evaluate.results import Settings, is_done, result_path, write_result


def test_settings_default_pass_k_and_validation():
  assert Settings(num_samples=8).pass_k == (1, 8)
  assert Settings(num_samples=8, pass_k=(4, 1, 4)).pass_k == (1, 4)
  with pytest.raises(ValueError, match="k=16"):
    Settings(num_samples=8, pass_k=(1, 16))
  with pytest.raises(ValueError, match="num_samples=0"):
    Settings(num_samples=0)


def test_a_result_is_done_only_under_the_same_settings_and_source(tmp_path, caplog):
  out = epath.Path(tmp_path)
  settings = Settings(num_samples=4)
  path = result_path(out, "gsm8k", 3)
  assert path == out / "gsm8k" / "step_3.json" and result_path(out, "gsm8k", None).name == "model.json"
  assert not is_done(path, settings, source=None, overwrite=False)
  write_result(path, {"settings": settings.to_json(), "source": "/run/checkpoints"})
  assert [p.name for p in path.parent.iterdir()] == ["step_3.json"]  # no temporary file left behind
  assert is_done(path, settings, source=None, overwrite=False)
  other = Settings(num_samples=8)
  for kw in ({"settings": other, "source": None}, {"settings": settings, "source": "/another/model"}):
    caplog.clear()
    with caplog.at_level(logging.WARNING):
      assert is_done(path, **kw, overwrite=False)  # another evaluation's result: kept, never overwritten silently
    assert "--overwrite" in caplog.text
    assert not is_done(path, **kw, overwrite=True)
  path.write_text('{"settings": ')  # a torn file is evaluated again
  assert not is_done(path, settings, source=None, overwrite=False)
