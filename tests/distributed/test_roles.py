"""Process layouts: which process plays which role, where they meet, and the launcher's core split."""

import pytest

from areal_jax.distributed import local_job
from areal_jax.distributed.roles import ProcessLayout, from_flags_or_env


def test_learners_come_first_then_samplers():
  names = [ProcessLayout.create(num_processes=5, process_id=i, coordinator_address="10.0.0.2:8476",
                                sampler_processes=2) for i in range(5)]
  assert [(l.role, l.name, l.is_leader) for l in names] == [
      ("learner", "learner 0", True), ("learner", "learner 1", False), ("learner", "learner 2", False),
      ("sampler", "sampler 0", False), ("sampler", "sampler 1", False)]
  assert names[0].num_learners == 3 and names[4].sampler_index == 1
  assert names[0].control_address == ("10.0.0.2", 8476) and names[0].learner_coordinator == "10.0.0.2:8477"


def test_process_ids_beyond_the_job_are_samplers_that_join_it():
  layout = ProcessLayout.create(num_processes=3, process_id=4, coordinator_address="h:1", sampler_processes=1)
  assert (layout.role, layout.name, layout.sampler_index) == ("sampler", "sampler 2", 2)


def test_one_process_is_the_single_controller_mode():
  layout = ProcessLayout.create(num_processes=1, process_id=0, coordinator_address="", sampler_processes=1)
  assert not layout.multi_process and layout.role == "learner" and layout.name == "controller"


@pytest.mark.parametrize("kw,match", [
    (dict(num_processes=2, process_id=-1, coordinator_address="h:1", sampler_processes=1), "--process_id=-1"),
    (dict(num_processes=2, process_id=0, coordinator_address="h:1", sampler_processes=2),
     "config.mesh.sampler_processes=2"),
    (dict(num_processes=2, process_id=0, coordinator_address="h:1", sampler_processes=0),
     "config.mesh.sampler_processes=0"),
    (dict(num_processes=2, process_id=0, coordinator_address="", sampler_processes=1), "COORDINATOR_ADDRESS"),
    (dict(num_processes=0, process_id=0, coordinator_address="", sampler_processes=1), "--num_processes=0"),
])
def test_bad_layouts_name_the_value(kw, match):
  with pytest.raises(ValueError, match=match):
    ProcessLayout.create(**kw)


def test_flags_win_then_environment_then_slurm(monkeypatch):
  for k in ("AREAL_JAX_NUM_PROCESSES", "AREAL_JAX_PROCESS_ID", "AREAL_JAX_COORDINATOR_ADDRESS"):
    monkeypatch.delenv(k, raising=False)
  monkeypatch.setenv("SLURM_NTASKS", "4")
  monkeypatch.setenv("SLURM_PROCID", "3")
  # SLURM alone (no coordinator anywhere) is not a multi-process job.
  assert not from_flags_or_env(num_processes=None, process_id=None, coordinator_address=None,
                               sampler_processes=1).multi_process
  monkeypatch.setenv("AREAL_JAX_COORDINATOR_ADDRESS", "node0:9000")
  layout = from_flags_or_env(num_processes=None, process_id=None, coordinator_address=None, sampler_processes=1)
  assert (layout.num_processes, layout.process_id, layout.role) == (4, 3, "sampler")
  monkeypatch.setenv("AREAL_JAX_PROCESS_ID", "1")
  layout = from_flags_or_env(num_processes=None, process_id=None, coordinator_address=None, sampler_processes=1)
  assert layout.process_id == 1 and layout.coordinator_address == "node0:9000"
  layout = from_flags_or_env(num_processes=2, process_id=0, coordinator_address="127.0.0.1:7000", sampler_processes=1)
  assert (layout.num_processes, layout.process_id, layout.coordinator_address) == (2, 0, "127.0.0.1:7000")


def test_cores_are_split_in_blocks_and_wrap(monkeypatch):
  monkeypatch.setattr(local_job.os, "sched_getaffinity", lambda _: {0, 1, 2, 3})
  assert local_job.core_sets(2, None) == [[0, 1], [2, 3]]
  assert local_job.core_sets(3, 1) == [[0], [1], [2]]
  assert local_job.core_sets(3, 2) == [[0, 1], [2, 3], [0, 1]]  # more processes than cores: they share
  port = local_job.free_port_pair()
  assert 0 < port < 65535
