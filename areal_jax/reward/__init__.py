"""Verifiable rewards: math answers (`reward.math`), code tests (`reward.code`), and the worker pool that scores
them off the controller's threads (`reward.service`)."""
