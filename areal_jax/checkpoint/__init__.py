"""A run's Orbax checkpoints: `store` writes and restores them (the learner's state and the `CheckpointMeta` record),
`sources` resolves what evaluation, serving and conversion read (a run's steps, a policy or a HF directory)."""
