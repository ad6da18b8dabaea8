"""The run in virtual time, for sizing jobs: the project's own orchestration (buffer, controller, sampler loop,
scheduler) with device calls priced by a cost model (`tools/plan.py`; docs: Planning a job)."""
