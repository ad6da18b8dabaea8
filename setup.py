"""areal_jax: fully asynchronous RL for language reasoning (AReaL) in JAX."""

from setuptools import find_packages, setup

RAY = "ray==2.60.0"

setup(
    name="areal_jax",
    version="0.1.0",
    description="Asynchronous reinforcement learning for language reasoning models, in JAX/Flax NNX.",
    packages=find_packages(include=["areal_jax", "areal_jax.*"]),
    python_requires=">=3.12,<3.13",
    install_requires=[
        "jax==0.12.0.1",
        "jaxlib==0.12.0.1",
        "flax==0.12.12",
        "optax==0.2.8",
        "qwix==0.1.8",  # quantized arrays for QLoRA bases (models/lora.py)
        "orbax-checkpoint==0.12.8",
        "ml-collections==1.1.0",
        "absl-py==2.5.1",
        "numpy==2.4.6",
        "scipy==1.17.1",  # the planner's length distributions (areal_jax/sim/lengths.py)
        "sentencepiece==0.2.3",
        "tokenizers==0.23.3",
        "safetensors==0.8.0",
        "jinja2==3.1.6",
        "msgpack==1.2.4",  # the control plane's message format (areal_jax/distributed/wire.py)
        "math-verify==0.9.0",
        # The code sandbox's seccomp filter (ctypes over the system's libseccomp.so.2); the jail itself is bubblewrap,
        # a system package (Debian/Ubuntu: bubblewrap).
        "pyseccomp==0.1.2",
        "tensorboardX==2.6.5",
        "matplotlib==3.11.2",  # tools/plot_run.py
        "tensorflow-datasets==4.9.10",
        "array-record==0.8.6",
        "pyarrow==26.0.1",  # datasets as released (Parquet): areal_jax/data/sources.py, tools/prepare_data.py
        "etils==1.15.0",
        # tools/serve.py: the OpenAI-compatible policy server.
        "fastapi==0.165.0",
        "uvicorn==0.54.0",
        # areal_jax.agents: agents get an OpenAI client whose transport calls the server's routes in process.
        "openai==3.54.0",
        "httpx2==2.16.2",
        "anthropic==2.14.0",  # agents written against the Messages API get an Anthropic client the same way
    ],
    extras_require={
        # The test oracle. torch is pinned exactly (for Python 3.12 on Linux PyPI has only its CUDA build, which runs
        # on the CPU too: 2.6 GB with its NVIDIA libraries; an unpinned torch would move with every release).
        "test": ["pytest==9.2.0", "pytest-xdist==3.8.0", "torch==2.13.0", "transformers==5.23.0",
                 "peft==0.21.2", "accelerate==1.15.0",  # PEFT's own LoRA layers check our adapters and their export
                 "gcp-storage-emulator==2026.7.19",
                 # The server and the agent runner are tested with other projects' own clients:
                 # lm-evaluation-harness's `local-completions`, the OpenAI Agents SDK, LangChain.
                 "lm-eval[api]==0.4.13", "openai-agents==0.24.0", "langchain-openai==1.7.4",
                 "langchain-core==1.8.3",
                 # JetStream's own server and orchestrator serve the engine in the tests: what google-jetstream
                 # 0.2.2 imports (it is installed with --no-deps: its declared dependencies pull in TensorFlow).
                 # areal==1.0.4 is installed the same way (its declared dependencies pull in PyTorch's CUDA stack):
                 # the objectives' tests run its own loss functions (tests/areal_functions.py).
                 "grpcio==1.85.3", "prometheus-client==0.26.0", "shortuuid==1.0.13", "tiktoken==0.14.0",
                 # The packages' layers (.importlinter), checked by tests/test_layers.py.
                 "import-linter==2.17",
                 # launch/ray_run.py on a local multi-node Ray cluster; the JobSet renderer's pod specs checked
                 # through the Kubernetes client's models.
                 RAY, "kubernetes==37.0.2"],
        "gcs": ["gcsfs==2026.10.1"],
        # The documentation site (docs/, mkdocs.yml); its configs reference is generated from the code.
        "docs": ["mkdocs==1.6.1", "mkdocs-material==9.8.2"],
        "tpu": ["libtpu==0.0.50.1"],
        # NVIDIA GPUs: JAX's CUDA 12 plugin at our JAX's version, with CUDA's own wheels (cuDNN, NCCL, cuBLAS...).
        # CUDA 12 rather than 13: its wheels run on NVIDIA drivers from 525 on, where CUDA 13 needs 580 or newer,
        # which many clusters do not run yet. `.ci/run` checks that pip resolves it against these pins.
        "cuda": ["jax-cuda12-plugin[with-cuda]==0.12.0.1", "jax-cuda12-pjrt==0.12.0.1"],
        # launch/ray_run.py: the job on a Ray cluster (TPU slices, GPU nodes, CPU nodes).
        "ray": [RAY],
    },
)
