"""The transport of a run: process roles, control connections, the sampler hub and processes, weight transfer,
the local multi-process launcher and device slices."""
