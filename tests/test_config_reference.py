"""The configs reference (`docs/` page generated from the code) covers every field of every bundled config."""

import os

from areal_jax import config_reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_config_field_has_a_doc_line_and_a_row_in_the_reference():
  rows = config_reference.reference(ROOT)
  undocumented = [r["key"] for r in rows if not r["doc"]]
  assert not undocumented, f"fields without a comment in their config file (docs' configs reference): {undocumented}"
  page = config_reference.reference_markdown(ROOT)
  for r in rows:
    assert f"| `{r['key']}` |" in page
  by_key = {r["key"]: r for r in rows}
  assert by_key["learner.lr"]["checks"] == ["0: must be positive", "-1: must be positive"]
  assert by_key["data.source"]["checks"] == ["'?': choose one of ('synthetic', 'files', 'jsonl', 'tfds')"]
  assert by_key["model.hidden_size"]["defaults"]["qwen2.5-1.5b"] == 1536
  assert by_key["agent.options.attempts"]["defaults"] == {"tiny": "—", "qwen2.5-1.5b": "—",
                                                         "r1-distill-qwen-7b": "—", "agent": 1}


def test_field_docs_reads_the_comment_beside_and_above_an_assignment(tmp_path):
  path = tmp_path / "cfg.py"
  path.write_text(
      "import ml_collections\n\n"
      "def _model(preset):\n"
      "  m = ml_collections.ConfigDict()\n"
      "  m.width = 8  # model width\n"
      "  return m\n\n"
      "def get_config(preset=None):\n"
      "  c = ml_collections.ConfigDict()\n"
      "  c.model = _model(preset)\n"
      "  # the learning rate,\n"
      "  # peak of the schedule\n"
      "  c.lr = 1e-3  # Adam\n"
      "  c.steps = 10\n"
      "  return c\n")
  assert config_reference.field_docs(str(path)) == {
      "model.width": "model width", "lr": "the learning rate, peak of the schedule Adam"}
