"""The job description every launcher renders (distributed/job.py): roles, devices and meeting point per process."""

import pytest

from areal_jax.distributed import roles
from areal_jax.distributed.job import JobSpec, tpu_slice


def test_every_process_gets_its_role_name_devices_and_the_coordinator(monkeypatch):
  spec = JobSpec.create(num_processes=5, sampler_processes=3, accelerator="gpu", learner_devices=8, sampler_devices=4)
  assert [(p.process_id, p.role, p.name, p.devices) for p in spec.processes] == [
      (0, "learner", "learner 0", 8), (1, "learner", "learner 1", 8), (2, "sampler", "sampler 0", 4),
      (3, "sampler", "sampler 1", 4), (4, "sampler", "sampler 2", 4)]
  assert [p.process_id for p in spec.learners] == [0, 1] and [p.process_id for p in spec.samplers] == [2, 3, 4]
  # What a launcher hands process 3, read back the way launch/tpu_run.py reads it.
  for k, v in spec.env(3, "10.1.2.3").items():
    monkeypatch.setenv(k, v)
  layout = roles.from_flags_or_env(num_processes=None, process_id=None, coordinator_address=None,
                                   sampler_processes=3)
  assert layout == spec.layout(3, "10.1.2.3")
  assert (layout.role, layout.sampler_index, layout.control_address) == ("sampler", 1, ("10.1.2.3", 8476))
  assert spec.argv(0, "h") == ["--num_processes=5", "--process_id=0", "--coordinator_address=h:8476"]
  assert spec.coordinator_address("fd00::1") == "[fd00::1]:8476"


@pytest.mark.parametrize("kw,message", [
    (dict(num_processes=1, sampler_processes=0), "--num_processes=1: a multi-process job has at least 2"),
    (dict(num_processes=3, sampler_processes=3), "config.mesh.sampler_processes=3: must leave at least one"),
    (dict(num_processes=2, sampler_processes=1, learner_devices=1), "this machine has no GPU or TPU"),
    (dict(num_processes=2, sampler_processes=1, accelerator="npu"), "accelerator 'npu': choose one of"),
    (dict(num_processes=2, sampler_processes=1, port=65535), "--port=65535"),
])
def test_a_job_that_cannot_run_is_refused_naming_the_value(kw, message):
  with pytest.raises(ValueError, match=message):
    JobSpec.create(**kw)


@pytest.mark.parametrize("name,chips,hosts,topology", [
    ("v5p-8", 4, 1, "2x2x1"), ("v5p-32", 16, 4, "2x2x4"), ("v5p-128", 64, 16, "4x4x4"), ("v5e-1", 1, 1, "1x1"),
    ("v5e-8", 8, 1, "2x4"), ("v5e-32", 32, 4, "4x8"), ("v6e-256", 256, 32, "16x16"), ("v4-16", 8, 2, "2x2x2")])
def test_tpu_slices_by_googles_names(name, chips, hosts, topology):
  s = tpu_slice(name)
  assert (s.chips, s.hosts, s.topology) == (chips, hosts, topology)
  assert s.chips_per_host * s.hosts == s.chips


@pytest.mark.parametrize("name,message", [("v5p-7", "2 per chip"), ("v5e-12", "power of two"),
                                          ("h100-8", "expected GENERATION-SIZE"), ("v5p", "expected")])
def test_a_bad_slice_name_is_refused(name, message):
  with pytest.raises(ValueError, match=message):
    tpu_slice(name)


def test_ray_placement_asks_for_what_each_process_owns():
  from areal_jax.distributed.ray_job import Placement  # pylint: disable=g-import-not-at-top  # imports no ray
  gpu = JobSpec.create(num_processes=3, sampler_processes=2, accelerator="gpu", learner_devices=8, sampler_devices=4)
  assert Placement().sampler_options(gpu) == {"num_cpus": 1.0, "num_gpus": 4}
  tpu = JobSpec.create(num_processes=6, sampler_processes=2, accelerator="tpu")
  placement = Placement(learner_slice="v5p-32", sampler_slice="v5e-8")
  placement.check(tpu)
  assert placement.sampler_options(tpu) == {"num_cpus": 1.0, "resources": {"TPU": 8}}
  cpu = JobSpec.create(num_processes=3, sampler_processes=2)
  assert Placement(host_resource="host").sampler_options(cpu) == {"num_cpus": 1.0, "resources": {"host": 1}}
  with pytest.raises(ValueError, match="--learner_slice=v5p-64 has 8 hosts, one learner process each; the job has 4"):
    Placement(learner_slice="v5p-64", sampler_slice="v5e-8").check(tpu)
  with pytest.raises(ValueError, match="--sampler_slice=v5e-16 spans 2 hosts"):
    Placement(learner_slice="v5p-32", sampler_slice="v5e-16").check(tpu)
  with pytest.raises(ValueError, match="names --learner_slice and --sampler_slice"):
    Placement().check(tpu)
