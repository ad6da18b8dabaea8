"""Problems as read from a source, prompt records as the controller consumes them, and the data error type."""

from __future__ import annotations

import dataclasses

import numpy as np


class DataError(ValueError):
  """Bad input data; the message names the file (or dataset), the line (or record) and the field."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Problem:
  """One problem from a source, before prompting."""

  # stable id: the row's own `id` when it has one, else "FILE:LINE" (JSONL), "FILE:ROW" (Parquet), "name/split:INDEX"
  uid: str
  question: str
  reference: str  # math: the final answer ("72", "\\frac{3}{4}"); code: the tests as normalised JSON
  solution: str = ""  # a worked solution ending in \boxed{answer} (math) when the source has one
  kind: str = "math"  # "math" | "code": the reward that scores answers


@dataclasses.dataclass(frozen=True, kw_only=True)
class PromptRecord:
  """A problem ready for the sampler: the prompt text and its token ids, plus what the reward needs."""

  uid: str
  prompt: str
  prompt_ids: np.ndarray  # int32 [P]
  reference: str
  kind: str = "math"
  solution: str = ""
  question: str = ""  # the problem as the source gave it (what an agent is handed)

  @property
  def num_prompt_tokens(self) -> int:
    return len(self.prompt_ids)
