"""`tools/render_jobset.py`: the JobSet it renders is valid against the JobSet API as released and the Kubernetes API's
own models, asks GKE for the slices (or GPUs) the job description says, and every pod reads its process id, the
leader's address and the authkey from what Kubernetes gives it.

No cluster: the JobSet is checked against JobSet's CRD schema (`jobset_crd_v0.12.0.json`, vendored from
kubernetes-sigs/jobset v0.12.0, where its source and licence are noted), made strict (a field the API does not have is
an error, as `kubectl apply`'s field validation reports it); each Job template goes through the `kubernetes` client's
models and back unchanged. Each pod's container command then runs here under /bin/sh, with the environment kubelet
would build (the downward API's annotations, the Secret's value, Kubernetes' `$(VAR)` expansion) and a fake `python`
that records what `launch/tpu_run.py` would be given.
"""

import copy
import importlib.util
import json
import os
import re
import stat
import subprocess

import pytest
import yaml

from areal_jax.distributed import roles
from areal_jax.distributed.job import JobSpec

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CRD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jobset_crd_v0.12.0.json")
CONFIG = ["--config=configs/math.py:qwen2.5-1.5b", "--config.mesh.sampler_processes=4",
          "--config.model.init_from=gs://b/Qwen 1.5B"]
TPU = dict(learner="v5p-32", samplers="4xv5e-8")
GPU = dict(learner_gpus="2x8", sampler_gpus="4x4", gpu_type="nvidia-h100-80gb")


def _tool():
  spec = importlib.util.spec_from_file_location("render_jobset", os.path.join(ROOT, "tools", "render_jobset.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _jobset(**kw):
  args = dict(config=CONFIG, sampler_processes=4, workdir="gs://bucket/runs/math", image="example/areal_jax:1")
  return _tool().jobset(**(args | kw))


def _strict(schema):
  """The CRD's schema with unknown fields refused where Kubernetes would prune (or strict validation reject) them."""
  if isinstance(schema, list):
    return [_strict(s) for s in schema]
  if not isinstance(schema, dict):
    return schema
  out = {k: _strict(v) for k, v in schema.items()}
  if "properties" in out and "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
    out["additionalProperties"] = False
  return out


def _validator():
  jsonschema = pytest.importorskip("jsonschema")  # setup.py's test extra
  with open(CRD, encoding="utf-8") as f:
    crd = json.load(f)["crd"]
  (version,) = [v for v in crd["spec"]["versions"] if v["served"]]
  api = f"{crd['spec']['group']}/{version['name']}"
  return api, crd["spec"]["names"]["kind"], jsonschema.Draft7Validator(_strict(version["schema"]["openAPIV3Schema"]))


@pytest.mark.parametrize("kind", [TPU, GPU], ids=["tpu", "gpu"])
def test_the_jobset_is_valid_against_jobsets_api_as_released(kind):
  manifest = _jobset(**kind)
  api, crd_kind, validator = _validator()
  assert (manifest["apiVersion"], manifest["kind"]) == (api, crd_kind) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
  errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(manifest)]
  assert not errors, errors
  # The check bites: a misspelt field, a wrong type, a missing required field, an action JobSet does not have.
  for path, value in ((("spec", "network", "enableDNSHostname"), True),
                      (("spec", "replicatedJobs", 0, "replicas"), "1"),
                      (("spec", "failurePolicy", "rules", 0, "action"), "FailJob")):
    bad = copy.deepcopy(manifest)
    node = bad
    for key in path[:-1]:
      node = node[key]
    node[path[-1]] = value
    assert list(validator.iter_errors(bad)), path
  bad = copy.deepcopy(manifest)
  del bad["spec"]["replicatedJobs"][1]["template"]["spec"]["template"]["spec"]["containers"][0]["name"]
  assert list(validator.iter_errors(bad))


@pytest.mark.parametrize("kind", [TPU, GPU], ids=["tpu", "gpu"])
def test_job_and_pod_templates_round_trip_through_the_kubernetes_clients_models(kind):
  kubernetes = pytest.importorskip("kubernetes")  # setup.py's test extra
  client = kubernetes.client.ApiClient()
  deserialize = client._ApiClient__deserialize  # pylint: disable=protected-access  # as for a server's answer
  for rjob in _jobset(**kind)["spec"]["replicatedJobs"]:
    template = rjob["template"]
    job = deserialize(template, "V1JobTemplateSpec")
    assert client.sanitize_for_serialization(job) == template, rjob["name"]
    pod = deserialize(template["spec"]["template"], "V1PodTemplateSpec")
    assert isinstance(pod.spec.containers[0], kubernetes.client.V1Container)
    assert client.sanitize_for_serialization(pod) == template["spec"]["template"]


def test_the_tpu_jobset_asks_gke_for_the_slices_the_job_description_says():
  spec = _jobset(**TPU)["spec"]
  learner, sampler = spec["replicatedJobs"]
  assert (learner["name"], learner["replicas"], sampler["name"], sampler["replicas"]) == ("learner", 1, "sampler", 4)
  job = learner["template"]["spec"]
  assert (job["parallelism"], job["completions"], job["completionMode"], job["backoffLimit"]) == (4, 4, "Indexed", 0)
  assert learner["template"]["metadata"]["annotations"] == {
      "alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}
  pod = job["template"]["spec"]
  assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
                                 "cloud.google.com/gke-tpu-topology": "2x2x4"}
  assert pod["containers"][0]["resources"] == {"requests": {"google.com/tpu": "4"}, "limits": {"google.com/tpu": "4"}}
  assert pod["restartPolicy"] == "Never"
  assert [p["containerPort"] for p in pod["containers"][0]["ports"]] == [8476, 8477]
  job = sampler["template"]["spec"]
  assert (job["parallelism"], job["completions"], job["backoffLimit"]) == (1, 1, 1000)
  pod = job["template"]["spec"]
  assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
                                 "cloud.google.com/gke-tpu-topology": "2x4"}
  assert pod["containers"][0]["resources"]["limits"] == {"google.com/tpu": "8"}
  assert pod["restartPolicy"] == "OnFailure"  # a sampler comes back in its pod and rejoins
  # The leader's DNS name through JobSet's headless service; a learner's failure ends the JobSet.
  assert spec["network"] == {"enableDNSHostnames": True, "subdomain": "areal-jax", "publishNotReadyAddresses": True}
  assert spec["failurePolicy"] == {"maxRestarts": 0, "rules": [
      {"name": "LearnerFailed", "action": "FailJobSet", "targetReplicatedJobs": ["learner"]}]}
  assert spec["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["learner"]}


def test_the_gpu_jobset_asks_for_gpu_nodes():
  learner, sampler = _jobset(**GPU)["spec"]["replicatedJobs"]
  assert learner["template"]["spec"]["completions"] == 2 and sampler["replicas"] == 4
  assert "metadata" not in learner["template"]
  for rjob, gpus in ((learner, "8"), (sampler, "4")):
    pod = rjob["template"]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
    resources = {"requests": {"nvidia.com/gpu": gpus}, "limits": {"nvidia.com/gpu": gpus}}
    assert pod["containers"][0]["resources"] == resources
    assert pod["volumes"] == [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]


def _expand(text: str, env: dict[str, str]) -> str:
  """Kubernetes' expansion of $(VAR) in env values and commands (k8s.io/kubernetes third_party/forked/golang/
  expansion): $$ is $, $(NAME) is NAME's value or stays as written, any other $ stays."""
  out, i = [], 0
  while i < len(text):
    if text[i] == "$" and i + 1 < len(text):
      if text[i + 1] == "$":
        out.append("$")
        i += 2
        continue
      if text[i + 1] == "(" and ")" in text[i + 2:]:
        end = text.index(")", i + 2)
        name = text[i + 2:end]
        out.append(env.get(name, f"$({name})"))
        i = end + 1
        continue
    out.append(text[i])
    i += 1
  return "".join(out)


def _kubelet_env(container: dict, annotations: dict[str, str], secrets: dict[tuple[str, str], str]) -> dict[str, str]:
  env = {}
  for var in container["env"]:
    if "value" in var:
      env[var["name"]] = _expand(var["value"], env)
    elif "fieldRef" in var["valueFrom"]:
      m = re.fullmatch(r"metadata\.annotations\['([^']+)'\]", var["valueFrom"]["fieldRef"]["fieldPath"])
      env[var["name"]] = annotations[m.group(1)]
    else:
      ref = var["valueFrom"]["secretKeyRef"]
      env[var["name"]] = secrets[ref["name"], ref["key"]]
  return env


@pytest.mark.parametrize("kind", [TPU, GPU], ids=["tpu", "gpu"])
def test_every_pod_gets_its_process_id_the_leader_and_the_authkey(kind, tmp_path, monkeypatch):
  tool = _tool()
  manifest = _jobset(**kind)
  command = tool.secret_command(manifest)
  m = re.fullmatch(r"kubectl create secret generic (\S+) --from-literal=(\w+)=\"\$\(python3 -c 'import secrets; "
                   r"print\(secrets.token_hex\(16\)\)'\)\"", command)
  assert m, command
  key = "0123456789abcdef0123456789abcdef"
  secrets = {(m.group(1), m.group(2)): key}
  fake = tmp_path / "bin"
  fake.mkdir()
  (fake / "python").write_text('#!/bin/sh\nenv -0 > "$OUT/env"\nprintf "%s\\0" "$0" "$@" > "$OUT/argv"\n')
  (fake / "python").chmod(stat.S_IRWXU)
  learners = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["completions"]
  spec = JobSpec.create(num_processes=learners + 4, sampler_processes=4)
  seen = []
  for rjob in manifest["spec"]["replicatedJobs"]:
    job = rjob["template"]["spec"]
    (container,) = job["template"]["spec"]["containers"]
    assert all("value" not in v for v in container["env"] if v["name"] == roles.AUTHKEY_ENV)  # never inline
    for job_index in range(rjob["replicas"]):
      for pod_index in range(job["completions"]):
        annotations = {"batch.kubernetes.io/job-completion-index": str(pod_index),
                       "jobset.sigs.k8s.io/job-index": str(job_index)}
        env = _kubelet_env(container, annotations, secrets)
        argv = [_expand(a, env) for a in container["command"]]
        subprocess.run(argv, env=env | {"PATH": f"{fake}:/usr/bin:/bin", "OUT": str(tmp_path)}, cwd=tmp_path,
                       check=True, timeout=30)
        process_env = dict(kv.split("=", 1) for kv in (tmp_path / "env").read_text().split("\0") if kv)
        process_argv = (tmp_path / "argv").read_text().split("\0")[:-1]
        assert process_argv[1:] == ["launch/tpu_run.py", *CONFIG, "--workdir=gs://bucket/runs/math"]
        monkeypatch.setattr(os, "environ", process_env)
        layout = roles.from_flags_or_env(num_processes=None, process_id=None, coordinator_address=None,
                                         sampler_processes=4)
        expected = pod_index if rjob["name"] == "learner" else learners + job_index
        assert layout == spec.layout(expected, "areal-jax-learner-0-0.areal-jax"), (rjob["name"], job_index)
        assert layout.role == rjob["name"] and layout.coordinator_address == "areal-jax-learner-0-0.areal-jax:8476"
        assert roles.authkey() == key.encode()
        seen.append(layout.process_id)
  assert sorted(seen) == list(range(learners + 4))


def test_the_yaml_is_the_jobset_after_comments_saying_how_to_make_its_secret():
  tool = _tool()
  args = dict(config=CONFIG, sampler_processes=4, workdir="gs://bucket/runs/math", image="example/areal_jax:1",
              name="math-run", namespace="rl", secret="math-key", **TPU)
  text = tool.render(**args)
  (document,) = list(yaml.safe_load_all(text))
  assert document == tool.jobset(**args)
  header = text[:text.index("apiVersion:")].splitlines()
  assert all(line.startswith("#") for line in header)
  assert ("#   kubectl create secret generic math-key --namespace=rl --from-literal=authkey=\"$(python3 -c "
          "'import secrets; print(secrets.token_hex(16))')\"") in header
  assert document["metadata"] == {"name": "math-run", "namespace": "rl"}
  env = document["spec"]["replicatedJobs"][1]["template"]["spec"]["template"]["spec"]["containers"][0]["env"]
  assert {"name": "AREAL_JAX_COORDINATOR_ADDRESS", "value": "math-run-learner-0-0.math-run:8476"} in env


@pytest.mark.parametrize("kw,message", [
    (dict(samplers="4xv5p-16"), r"--samplers='4xv5p-16': a v5p-16 slice spans 2 hosts; a sampler process owns its "
     r"devices and never joins a collective, so each sampler's slice is one host \(up to 4 v5p chips, e.g. v5p-8\)"),
    (dict(samplers="2xv5e-8"), r"--samplers=2xv5e-8 makes 2 sampler process\(es\) but "
     r"config.mesh.sampler_processes=4: pass --config.mesh.sampler_processes=2"),
    (dict(learner="v5p-7"), "--learner='v5p-7': TPU slice 'v5p-7'"),
    (dict(samplers="0xv5e-8"), "--samplers='0xv5e-8': expected COUNTxSLICE"),
    (dict(learner=""), "a TPU job needs both"),
    (dict(learner_gpus="2x8"), "not both kinds"),
    (dict(learner="", samplers="", learner_gpus="2x8", sampler_gpus="4"), "--sampler_gpus='4': expected PODSxGPUS"),
    (dict(learner="", samplers="", learner_gpus="2x8", sampler_gpus="4x8", gpu_type="H100 80GB"), "--gpu_type="),
    (dict(name="Areal"), "--name='Areal': a DNS label"),
    (dict(name="a" * 46), "would exceed 63 characters"),
    (dict(image=""), "--image=''"),
    (dict(workdir=""), "--workdir=''"),
    (dict(sampler_restarts=-1), "--sampler_restarts=-1"),
    (dict(port=65535), "--port=65535"),
])
def test_a_job_that_cannot_run_is_refused_naming_the_flag(kw, message):
  with pytest.raises(ValueError, match=message):
    _jobset(**(TPU | kw))
