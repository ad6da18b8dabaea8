"""Process layouts: which process plays which role, where they meet, and the launcher's core split and restarts."""

import os

import pytest

from areal_jax.distributed import local_job, zygote
from areal_jax.distributed.roles import ProcessLayout, first_slurm_host, from_flags_or_env

Child, tend = local_job._Child, local_job._tend_samplers  # pylint: disable=protected-access
CORES = sorted(os.sched_getaffinity(0))[:1]


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
  for k in ("AREAL_JAX_NUM_PROCESSES", "AREAL_JAX_PROCESS_ID", "AREAL_JAX_COORDINATOR_ADDRESS", "AREAL_JAX_PORT",
            "SLURM_JOB_NODELIST"):
    monkeypatch.delenv(k, raising=False)
  monkeypatch.setenv("SLURM_NTASKS", "1")  # a SLURM step of one task is the single-process mode
  monkeypatch.setenv("SLURM_PROCID", "0")
  monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[07-09,12]")
  assert not from_flags_or_env(num_processes=None, process_id=None, coordinator_address=None,
                               sampler_processes=1).multi_process
  # SLURM's variables alone: the task's rank, and the node list's first host as the coordinator.
  monkeypatch.setenv("SLURM_NTASKS", "4")
  monkeypatch.setenv("SLURM_PROCID", "3")
  layout = from_flags_or_env(num_processes=None, process_id=None, coordinator_address=None, sampler_processes=1)
  assert (layout.num_processes, layout.process_id, layout.role) == (4, 3, "sampler")
  assert layout.coordinator_address == "gpu07:8476" and layout.learner_coordinator == "gpu07:8477"
  monkeypatch.setenv("AREAL_JAX_PORT", "9100")
  assert from_flags_or_env(num_processes=None, process_id=None, coordinator_address=None,
                           sampler_processes=1).coordinator_address == "gpu07:9100"
  monkeypatch.setenv("AREAL_JAX_COORDINATOR_ADDRESS", "node0:9000")
  layout = from_flags_or_env(num_processes=None, process_id=None, coordinator_address=None, sampler_processes=1)
  assert (layout.num_processes, layout.process_id, layout.coordinator_address) == (4, 3, "node0:9000")
  monkeypatch.setenv("AREAL_JAX_PROCESS_ID", "1")
  layout = from_flags_or_env(num_processes=None, process_id=None, coordinator_address=None, sampler_processes=1)
  assert layout.process_id == 1 and layout.coordinator_address == "node0:9000"
  layout = from_flags_or_env(num_processes=2, process_id=0, coordinator_address="127.0.0.1:7000", sampler_processes=1)
  assert (layout.num_processes, layout.process_id, layout.coordinator_address) == (2, 0, "127.0.0.1:7000")


@pytest.mark.parametrize("nodelist,first", [("gpu[07-09,12]", "gpu07"), ("node1,node2", "node1"),
                                            ("a[3]-ib,b1", "a3-ib"), ("tpu-vm-[000-003]", "tpu-vm-000")])
def test_the_first_host_of_a_slurm_node_list(nodelist, first):
  assert first_slurm_host(nodelist) == first


def test_cores_are_split_in_blocks_and_wrap(monkeypatch):
  monkeypatch.setattr(local_job.os, "sched_getaffinity", lambda _: {0, 1, 2, 3})
  assert local_job.core_sets(2, None) == [[0, 1], [2, 3]]
  assert local_job.core_sets(3, 1) == [[0], [1], [2]]
  assert local_job.core_sets(3, 2) == [[0, 1], [2, 3], [0, 1]]  # more processes than cores: they share
  port = local_job.free_port_pair()
  assert 0 < port < 65535


@pytest.mark.parametrize("forked", [False, True], ids=["interpreter", "zygote"])
def test_a_sampler_that_keeps_failing_at_once_is_restarted_less_and_less_often(monkeypatch, capsys, tmp_path, forked):
  clock = [100.0]
  monkeypatch.setattr(local_job.time, "monotonic", lambda: clock[0])
  (tmp_path / "fail.py").write_text("raise SystemExit(3)")
  forker = zygote.Zygote(["json"], dict(os.environ)) if forked else None
  failing = Child("sampler 0", [str(tmp_path / "fail.py")], CORES, dict(os.environ), sampler=True)
  learner = Child("learner 0", ["-c", "import time; time.sleep(30)"], CORES, dict(os.environ))
  failing.start()
  learner.start()
  pauses = []
  try:
    for _ in range(4):
      failing.proc.wait(10)
      tend([learner, failing], lambda c: c.start(forker), "")
      pauses.append(failing.pause_s)
      clock[0] = failing.restart_at
      tend([learner, failing], lambda c: c.start(forker), "")
      assert isinstance(failing.proc, zygote.Forked) == forked  # restarted by a fork of the zygote
  finally:
    learner.proc.kill()
    if forker is not None:
      forker.close()
  assert pauses == [2.0, 4.0, 8.0, 16.0]  # each failed at once (within QUICK_EXIT_S of its start)
  out = capsys.readouterr().out
  assert out.count("sampler 0 is restarted") == 4 and "exited with status 3; restarting it in 16 s" in out
  assert learner.restart_at is None and learner.pause_s == 1.0  # learners are never tended


def test_without_restarts_a_sampler_that_exits_is_left_gone(capsys):
  gone = Child("sampler 1", ["-c", "raise SystemExit(1)"], CORES, dict(os.environ), sampler=True)
  gone.start()
  gone.proc.wait(10)
  for _ in range(3):
    tend([gone], None, "")
  assert capsys.readouterr().out.count("the job goes on without it") == 1 and gone.restart_at is None
