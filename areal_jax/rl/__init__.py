"""The RL loop's pieces below the composition root (`areal_jax.run`): the rollout buffer (the η rule's owner) and
controller, the rollout protocol, evaluation, metrics, the warm-start."""
