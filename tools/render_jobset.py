r"""Renders a GKE JobSet for a job from the config: a learner on one TPU slice (or GPU nodes), samplers on slices (or
nodes) of their own, one `launch/tpu_run.py` process per host.

  # TPU: the learner on a v5p-32 (4 hosts, processes 0-3), four single-host v5e-8 samplers (processes 4-7)
  python tools/render_jobset.py --config=configs/math.py:qwen2.5-1.5b --learner=v5p-32 --samplers=4xv5e-8 \
      --image=us-docker.pkg.dev/PROJECT/areal/areal_jax:latest --workdir=gs://BUCKET/runs/math \
      --config.mesh.sampler_processes=4 --out=math.yaml
  # GPU: the learner on 2 nodes of 8 GPUs, four samplers of 8 GPUs each
  python tools/render_jobset.py --config=configs/math.py:qwen2.5-1.5b --learner_gpus=2x8 --sampler_gpus=4x8 \
      --gpu_type=nvidia-h100-80gb --image=... --workdir=gs://BUCKET/runs/math --config.mesh.sampler_processes=4
  kubectl create secret generic areal-jax-authkey \
      --from-literal=authkey="$(python -c 'import secrets; print(secrets.token_hex(16))')"
  kubectl apply -f math.yaml

The JobSet (`jobset.x-k8s.io/v1alpha2`, https://jobset.sigs.k8s.io) has two replicated jobs, as the job description
(`areal_jax/distributed/job.py`) lays the processes out:
- `learner`: one Job over the learner's slice, an Indexed Job of one pod per host (process id = the pod's completion
  index). Its pod 0 is the leader: the JobSet's headless service (`network.enableDNSHostnames`) names it
  `<name>-learner-0-0.<name>`, the coordinator every process is given. A learner that fails fails the JobSet
  (`failurePolicy`); applying the same file again resumes from the workdir's last checkpoint.
- `sampler`: one single-pod Job per sampler (process id = learner processes + the Job's index, from the
  `jobset.sigs.k8s.io/job-index` annotation). A sampler that fails is restarted in its pod (`restartPolicy:
  OnFailure`, up to `--sampler_restarts` times) and rejoins the running job. A sampler owns its devices and never
  joins a collective, so its slice is one host: a multi-host sampler slice is refused.
Pods get GKE's TPU node selectors (`cloud.google.com/gke-tpu-accelerator`, `-topology`) and `google.com/tpu` chips
per host, or the GPU selector (`cloud.google.com/gke-accelerator`) and `nvidia.com/gpu`. The control connections'
authkey comes from a Kubernetes Secret (never this file). The image holds this repository at `--repo_dir` with its
requirements installed; every `--config` and `--config.KEY=VALUE` flag given here is passed on to each process.
"""

from __future__ import annotations

import os
import re
import shlex
import sys

from absl import flags
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from areal_jax import cli  # pylint: disable=g-import-not-at-top  # does not import JAX
from areal_jax.distributed.job import JobSpec, TpuSlice, config_args, tpu_slice  # pylint: disable=g-import-not-at-top
from areal_jax.distributed.roles import AUTHKEY_ENV, DEFAULT_PORT, ENV_PREFIX  # pylint: disable=g-import-not-at-top

API_VERSION = "jobset.x-k8s.io/v1alpha2"
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
JOB_INDEX = "metadata.annotations['jobset.sigs.k8s.io/job-index']"
SECRET_KEY = "authkey"


def _count_x(flag: str, value: str, what: str) -> tuple[int, str]:
  """"4xv5e-8" -> (4, "v5e-8"); "v5e-8" -> (1, "v5e-8")."""
  m = re.fullmatch(r"(?:(\d+)x)?(.+)", value.strip())
  if not m or (m.group(1) is not None and int(m.group(1)) < 1):
    raise ValueError(f"--{flag}={value!r}: expected {what}")
  return int(m.group(1) or 1), m.group(2)


def _gpus(flag: str, value: str) -> tuple[int, int]:
  """"2x8" -> (2 nodes, 8 GPUs each)."""
  m = re.fullmatch(r"(\d+)x(\d+)", value.strip())
  if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
    raise ValueError(f"--{flag}={value!r}: expected PODSxGPUS, e.g. 2x8 (2 nodes of 8 GPUs)")
  return int(m.group(1)), int(m.group(2))


def _tpu(flag: str, name: str) -> TpuSlice:
  try:
    return tpu_slice(name)
  except ValueError as e:
    raise ValueError(f"--{flag}={name!r}: {e}") from None


def jobset(*, config: list[str], sampler_processes: int, workdir: str, image: str, name: str = "areal-jax",
           learner: str = "", samplers: str = "", learner_gpus: str = "", sampler_gpus: str = "",
           gpu_type: str = "nvidia-h100-80gb", repo_dir: str = "/app", python: str = "python", secret: str = "",
           port: int = DEFAULT_PORT, sampler_restarts: int = 1000, namespace: str = "") -> dict:
  """The JobSet as a dict. A ValueError names the flag at fault and its value."""
  if not re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name):
    raise ValueError(f"--name={name!r}: a DNS label (lower-case letters, digits and '-', a letter first)")
  if not image:
    raise ValueError("--image='': the container image holding this repository (at --repo_dir) and its requirements")
  if not workdir:
    raise ValueError("--workdir='': every pod writes to it: gs://BUCKET/PATH (or a volume every pod mounts)")
  if sampler_restarts < 0:
    raise ValueError(f"--sampler_restarts={sampler_restarts}: must be >= 0")
  tpu, gpu = bool(learner or samplers), bool(learner_gpus or sampler_gpus)
  if tpu == gpu:
    raise ValueError(f"--learner={learner!r} --samplers={samplers!r} --learner_gpus={learner_gpus!r} "
                     f"--sampler_gpus={sampler_gpus!r}: give --learner and --samplers (TPU slices) or --learner_gpus "
                     "and --sampler_gpus (GPU nodes), not both kinds")
  if tpu:
    if not learner or not samplers:
      raise ValueError(f"--learner={learner!r} --samplers={samplers!r}: a TPU job needs both, e.g. --learner=v5p-32 "
                       "--samplers=4xv5e-8")
    learner_slice = _tpu("learner", learner)
    num_samplers, sampler_name = _count_x("samplers", samplers, "COUNTxSLICE, e.g. 4xv5e-8")
    sampler_slice = _tpu("samplers", sampler_name)
    if sampler_slice.hosts > 1:
      raise ValueError(f"--samplers={samplers!r}: a {sampler_slice.name} slice spans {sampler_slice.hosts} hosts; a "
                       "sampler process owns its devices and never joins a collective, so each sampler's slice is "
                       f"one host (up to {sampler_slice.device.chips_per_host} {sampler_slice.device.name} chips, "
                       f"e.g. {sampler_slice.device.name}-"
                       f"{sampler_slice.device.chips_per_host * sampler_slice.device.cores_per_chip})")
    learner_pods, learner_devices = learner_slice.hosts, learner_slice.chips_per_host
    sampler_devices = sampler_slice.chips
  else:
    if not learner_gpus or not sampler_gpus:
      raise ValueError(f"--learner_gpus={learner_gpus!r} --sampler_gpus={sampler_gpus!r}: a GPU job needs both, "
                       "e.g. --learner_gpus=2x8 --sampler_gpus=4x8")
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", gpu_type):
      raise ValueError(f"--gpu_type={gpu_type!r}: GKE's accelerator name, e.g. nvidia-h100-80gb, nvidia-l4")
    learner_pods, learner_devices = _gpus("learner_gpus", learner_gpus)
    num_samplers, sampler_devices = _gpus("sampler_gpus", sampler_gpus)
  if num_samplers != sampler_processes:
    flag = f"--samplers={samplers}" if tpu else f"--sampler_gpus={sampler_gpus}"
    raise ValueError(f"{flag} makes {num_samplers} sampler process(es) but config.mesh.sampler_processes="
                     f"{sampler_processes}: pass --config.mesh.sampler_processes={num_samplers}")
  spec = JobSpec.create(num_processes=learner_pods + num_samplers, sampler_processes=num_samplers,
                        accelerator="tpu" if tpu else "gpu", learner_devices=learner_devices,
                        sampler_devices=sampler_devices, port=port)
  for job, jobs, pods in (("learner", 1, learner_pods), ("sampler", num_samplers, 1)):
    longest = f"{name}-{job}-{jobs - 1}-{pods - 1}-abcde"  # as JobSet's webhook checks its pods' names
    if len(longest) > 63:
      raise ValueError(f"--name={name!r}: too long for this job, its pod names (such as {longest}) would exceed 63 "
                       "characters")
  leader = f"{name}-learner-0-0.{name}"  # JobSet's pod hostname <jobset>-<replicated job>-<job>-<pod>.<subdomain>
  env = spec.env(0, leader)
  secret = secret or f"{name}-authkey"
  command = [python, "launch/tpu_run.py", *config, f"--workdir={workdir}"]  # roles from the environment

  def pod(role: str, devices: int, selector: dict[str, str], process_id: list[dict], argv: list[str],
          restart: str) -> dict:
    resource = "google.com/tpu" if tpu else "nvidia.com/gpu"
    container = {
        "name": role, "image": image, "workingDir": repo_dir, "command": argv,
        "env": [{"name": k, "value": v} for k, v in env.items() if k != f"{ENV_PREFIX}PROCESS_ID"] + process_id + [
            {"name": AUTHKEY_ENV, "valueFrom": {"secretKeyRef": {"name": secret, "key": SECRET_KEY}}}],
        "resources": {"requests": {resource: str(devices)}, "limits": {resource: str(devices)}},
    }
    if role == "learner":  # pod 0 listens on them (the others carry the same template)
      container["ports"] = [{"name": "control", "containerPort": spec.port},
                            {"name": "jax-coordinator", "containerPort": spec.port + 1}]
    spec_ = {"restartPolicy": restart, "nodeSelector": selector, "containers": [container]}
    if gpu:  # NCCL's shared memory: the container's default /dev/shm is 64 MiB
      container["volumeMounts"] = [{"name": "dshm", "mountPath": "/dev/shm"}]
      spec_["volumes"] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    return {"metadata": {"labels": {"app.kubernetes.io/name": name, "app.kubernetes.io/component": role}},
            "spec": spec_}

  if tpu:
    learner_selector = {"cloud.google.com/gke-tpu-accelerator": learner_slice.gke_accelerator,
                        "cloud.google.com/gke-tpu-topology": learner_slice.topology}
    sampler_selector = {"cloud.google.com/gke-tpu-accelerator": sampler_slice.gke_accelerator,
                        "cloud.google.com/gke-tpu-topology": sampler_slice.topology}
  else:
    learner_selector = sampler_selector = {"cloud.google.com/gke-accelerator": gpu_type}
  learner_id = [{"name": f"{ENV_PREFIX}PROCESS_ID", "valueFrom": {"fieldRef": {"fieldPath": COMPLETION_INDEX}}}]
  sampler_id = [{"name": "JOB_INDEX", "valueFrom": {"fieldRef": {"fieldPath": JOB_INDEX}}}]
  # Kubernetes expands $(VAR) in a command and turns $$ into $; the shell then computes the id and execs the process.
  sampler_argv = ["/bin/sh", "-c", f'export {ENV_PREFIX}PROCESS_ID=$$(({spec.num_learners} + JOB_INDEX)); '
                  'exec "$$0" "$$@"', *command]
  learner_job = {"parallelism": learner_pods, "completions": learner_pods, "completionMode": "Indexed",
                 "backoffLimit": 0, "template": pod("learner", learner_devices, learner_selector, learner_id, command,
                                                    "Never")}
  sampler_job = {"parallelism": 1, "completions": 1, "completionMode": "Indexed", "backoffLimit": sampler_restarts,
                 "template": pod("sampler", sampler_devices, sampler_selector, sampler_id, sampler_argv, "OnFailure")}
  learner_template = {"spec": learner_job}
  if tpu:  # the learner's slice whole: one Job per node pool (slice)
    learner_template = {"metadata": {"annotations": {
        "alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}}} | learner_template
  metadata = {"name": name} | ({"namespace": namespace} if namespace else {})
  return {
      "apiVersion": API_VERSION, "kind": "JobSet", "metadata": metadata,
      "spec": {
          "network": {"enableDNSHostnames": True, "subdomain": name, "publishNotReadyAddresses": True},
          # The learner's failure ends the JobSet; applying it again resumes from the last checkpoint.
          "failurePolicy": {"maxRestarts": 0, "rules": [
              {"name": "LearnerFailed", "action": "FailJobSet", "targetReplicatedJobs": ["learner"]}]},
          "successPolicy": {"operator": "All", "targetReplicatedJobs": ["learner"]},
          "replicatedJobs": [{"name": "learner", "replicas": 1, "template": learner_template},
                             {"name": "sampler", "replicas": num_samplers, "template": {"spec": sampler_job}}],
      },
  }


def secret_command(manifest: dict) -> str:
  """How to create the Secret the pods read the authkey from."""
  ref = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["env"][-1]
  ref = ref["valueFrom"]["secretKeyRef"]
  namespace = manifest["metadata"].get("namespace")
  return (f"kubectl create secret generic {ref['name']}{f' --namespace={namespace}' if namespace else ''} "
          f"--from-literal={ref['key']}=\"$(python3 -c 'import secrets; print(secrets.token_hex(16))')\"")


def render(**kw) -> str:
  """The JobSet as YAML, after comments saying how to create its Secret and apply it."""
  manifest = jobset(**kw)
  s = manifest["spec"]
  learners = s["replicatedJobs"][0]["template"]["spec"]["completions"]
  header = [
      "# A JobSet rendered by tools/render_jobset.py from these flags (render it again rather than edit it):",
      *(f"#   {shlex.quote(a)}" for a in kw["config"]),
      f"# {learners} learner process(es), ids 0-{learners - 1} (the leader: {s['network']['subdomain']}-learner-0-0), "
      f"and {s['replicatedJobs'][1]['replicas']} sampler process(es).",
      "# First, once, the control connections' shared secret (never put it in this file):",
      f"#   {secret_command(manifest)}",
      "# Then: kubectl apply -f THIS_FILE (needs the JobSet controller: https://jobset.sigs.k8s.io)",
  ]
  return "\n".join(header) + "\n" + yaml.safe_dump(manifest, sort_keys=False, width=120)


def main(argv):
  del argv
  f = flags.FLAGS
  config = config_args(sys.argv[1:])
  try:
    text = render(config=config, sampler_processes=_CONFIG.value.mesh.sampler_processes, workdir=f.workdir,
                  image=f.image, name=f.name, learner=f.learner, samplers=f.samplers, learner_gpus=f.learner_gpus,
                  sampler_gpus=f.sampler_gpus, gpu_type=f.gpu_type, repo_dir=f.repo_dir, python=f.python,
                  secret=f.secret, port=f.port, sampler_restarts=f.sampler_restarts, namespace=f.namespace)
  except ValueError as e:
    sys.exit(f"FATAL {e}")
  if f.out:
    with open(f.out, "w", encoding="utf-8") as out:
      out.write(text)
    print(f"wrote {f.out}", file=sys.stderr)
  else:
    sys.stdout.write(text)


if __name__ == "__main__":
  _CONFIG = cli.define_config()
  flags.DEFINE_string("learner", "", "TPU: the learner's slice, e.g. v5p-32 (one process per host).")
  flags.DEFINE_string("samplers", "", "TPU: COUNTxSLICE, the samplers' single-host slices, e.g. 4xv5e-8.")
  flags.DEFINE_string("learner_gpus", "", "GPU: NODESxGPUS of the learner, e.g. 2x8 (one process per node).")
  flags.DEFINE_string("sampler_gpus", "", "GPU: COUNTxGPUS, one sampler process per pod, e.g. 4x8.")
  flags.DEFINE_string("gpu_type", "nvidia-h100-80gb", "GPU: GKE's accelerator name (cloud.google.com/gke-accelerator).")
  flags.DEFINE_string("image", "", "Container image holding this repository at --repo_dir, its requirements installed.")
  flags.DEFINE_string("workdir", "", "Run directory every pod reaches: gs://BUCKET/PATH.")
  flags.DEFINE_string("name", "areal-jax", "The JobSet's name (and its headless service's).")
  flags.DEFINE_string("namespace", "", "The JobSet's namespace ('' = kubectl's current one).")
  flags.DEFINE_string("repo_dir", "/app", "This repository's path in the image (the processes' working directory).")
  flags.DEFINE_string("python", "python", "The image's Python.")
  flags.DEFINE_string("secret", "", "The Secret holding the authkey under key 'authkey' ('' = <name>-authkey).")
  flags.DEFINE_integer("port", DEFAULT_PORT, "The leader's control port (it also takes port + 1).")
  flags.DEFINE_integer("sampler_restarts", 1000, "How often a sampler is restarted in its pod (its Job's "
                       "backoffLimit).")
  flags.DEFINE_string("out", "", "Write the YAML here ('' = stdout).")
  cli.run(main)
