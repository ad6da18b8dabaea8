"""One host's accelerators split over the processes of a job: the blocks each process gets, the environment that
gives them (what CUDA and libtpu read at start), and the launcher handing each process its own."""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from areal_jax.devices import device_subset_env, local_accelerators
from areal_jax.distributed import local_job


def test_blocks_are_consecutive_in_process_order_and_a_role_given_0_shares_what_is_left():
  roles = ["learner"] + ["sampler"] * 4
  want = [[0, 1, 2, 3], [4], [5], [6], [7]]
  assert local_job.device_blocks(roles, learner_devices=4, sampler_devices=1, available=8) == want
  assert local_job.device_blocks(roles, learner_devices=0, sampler_devices=1, available=8) == want
  assert local_job.device_blocks(roles, learner_devices=4, sampler_devices=0, available=8) == want
  assert local_job.device_blocks(["learner", "learner", "sampler"], learner_devices=2, sampler_devices=4,
                                 available=8) == [[0, 1], [2, 3], [4, 5, 6, 7]]
  assert local_job.device_blocks(roles, learner_devices=0, sampler_devices=0, available=8) == []  # all see all


@pytest.mark.parametrize("learner, sampler, need", [(5, 1, 9), (8, 0, 12)])
def test_blocks_that_do_not_fit_name_the_flags_and_the_count(learner, sampler, need):
  with pytest.raises(ValueError, match=rf"--learner_devices={learner} --sampler_devices={sampler}: 1 learner and 4 "
                                       rf"sampler processes need at least {need} devices; this host has 8"):
    local_job.device_blocks(["learner"] + ["sampler"] * 4, learner_devices=learner, sampler_devices=sampler,
                            available=8)


def test_the_environment_of_a_subset():
  assert device_subset_env("gpu", [2, 3], port=9000) == {"CUDA_VISIBLE_DEVICES": "2,3"}
  env = device_subset_env("tpu", [4, 5], port=9000)
  assert env == {"TPU_VISIBLE_CHIPS": "4,5", "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,2,1", "TPU_PROCESS_BOUNDS": "1,1,1",
                 "TPU_MESH_CONTROLLER_ADDRESS": "localhost:9000", "TPU_MESH_CONTROLLER_PORT": "9000"}
  assert device_subset_env("tpu", [0, 1, 2, 3], port=1)["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "2,2,1"
  with pytest.raises(ValueError, match="3 TPU chips per process: a process of a TPU host holds 1 or 2 or 4 or 8"):
    device_subset_env("tpu", [0, 1, 2], port=1)
  with pytest.raises(ValueError, match="not 'cpu' .*config.mesh.cpu_devices"):
    device_subset_env("cpu", [0], port=1)


_REPORT = textwrap.dedent("""
    import json, os, sys
    pid = [a for a in sys.argv if a.startswith("--process_id=")][0].split("=")[1]
    keys = ("CUDA_VISIBLE_DEVICES", "TPU_VISIBLE_CHIPS", "TPU_MESH_CONTROLLER_PORT")
    with open(os.path.join(sys.argv[1], pid + ".json"), "w") as f:
      json.dump({k: os.environ.get(k) for k in keys}, f)
""")


@pytest.mark.slow  # starts processes
@pytest.mark.parametrize("kind", ["gpu", "tpu"])
def test_the_launcher_gives_each_process_its_own_block(tmp_path, kind, capfd):
  script = tmp_path / "report.py"
  script.write_text(_REPORT)
  status = local_job.run_local(script=str(script), args=[str(tmp_path)], num_processes=5, sampler_processes=4,
                               learner_devices=4, sampler_devices=1, accelerators=(kind, 8))
  assert status == 0
  seen = [json.loads((tmp_path / f"{i}.json").read_text()) for i in range(5)]
  key = "CUDA_VISIBLE_DEVICES" if kind == "gpu" else "TPU_VISIBLE_CHIPS"
  assert [s[key] for s in seen] == ["0,1,2,3", "4", "5", "6", "7"]
  if kind == "tpu":  # a mesh controller port of its own each
    assert len({s["TPU_MESH_CONTROLLER_PORT"] for s in seen}) == 5
  out = capfd.readouterr().out
  assert re.search(rf"sampler 0 is process \d+ \(pid \d+\) on cores \[[0-9, ]+\], {kind.upper()}s 4\n", out), out


@pytest.mark.slow  # starts a process
@pytest.mark.skipif(local_accelerators()[0] != "cpu", reason="this machine has an accelerator")
def test_local_py_refuses_device_flags_on_a_machine_without_an_accelerator(tmp_path):
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  proc = subprocess.run([sys.executable, os.path.join(root, "launch", "local.py"), f"--workdir={tmp_path}",
                         "--num_processes=2", "--sampler_devices=1"], capture_output=True, text=True, timeout=120,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode != 0
  assert "local: --learner_devices=0 --sampler_devices=1: this machine has no GPU or TPU" in proc.stderr, proc.stderr
