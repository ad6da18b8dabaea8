"""The learner: decoupled PPO on packed dynamic micro-batches, sharded over an fsdp × tensor mesh."""
