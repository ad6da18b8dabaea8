"""The composition root: the run's wiring on top of every other package (`trainer` runs a job or one process of it,
`parts` builds the leader's parts, `initial_weights` the learner's first parameters)."""
