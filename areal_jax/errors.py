"""Errors that cross packages, at the bottom of the layers so any package may raise or catch them (imports nothing,
JAX included)."""


class ConfigError(ValueError):
  """A config value that cannot work, named as `config.FIELD=VALUE: why`."""


class SamplerLost(RuntimeError):
  """The sampler (a replica or a sampler process) generating this answer left, died or fell silent; its group is
  generated again."""
