"""The RL run: the trainer, its rollout buffer and controller, checkpoints, metrics, evaluation, warm-start."""
