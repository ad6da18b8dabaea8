r"""Asynchronous RL on math problems (AReaL, arXiv 2505.24298). Presets: `--config=configs/math.py:PRESET`.

* `tiny` (default): a ~3M-parameter Qwen2-style model with a character vocabulary on synthetic arithmetic, on a 2-core
  CPU with 4 emulated devices (2 sampler, 2 learner); no downloads. A supervised warm-start (cached in
  `<workdir>/warmstart`), then 90 steps of asynchronous RL (eta = 4):

      python launch/tpu_run.py --config=configs/math.py --workdir=/tmp/areal_tiny

  About 14 minutes; held-out accuracy from 0.60 at step 0 to 0.92 at step 90 (seed 0, quiet 2-core CPU).

* `fast`: `tiny` made small and quick with every mechanism on (a 2-layer model, 30 warm-start steps, a checkpoint
  and an evaluation every 2 steps, uniform groups kept): what the end-to-end tests and `tools/chaos.py` run. It
  barely learns.

* `tiny-moe`: `tiny` as a Qwen3-MoE model: 8 experts per layer, 2 per token, each half the dense MLP's width (the
  same active parameters as `tiny`, 4x its MLP parameters in all). Same command with
  `--config=configs/math.py:tiny-moe`.

* `qwen2.5-1.5b`: DeepSeek-R1-Distill-Qwen-1.5B / Qwen2.5-1.5B shapes with the paper's Table 3 hyperparameters, for a
  v5p-8 per role:

      python launch/tpu_run.py --config=configs/math.py:qwen2.5-1.5b --workdir=gs://bucket/run \
          --config.model.init_from=/ckpt/DeepSeek-R1-Distill-Qwen-1.5B \
          --config.model.tokenizer=/ckpt/DeepSeek-R1-Distill-Qwen-1.5B --config.data.path=/data/math.jsonl

  Not run on TPUs here; `tools/aot_check.py` compiles both roles for v5p:2x2x1 within 95 GiB per chip.

* `r1-distill-qwen-7b`: DeepSeek-R1-Distill-Qwen-7B shapes, same hyperparameters, the learner mesh fsdp alone, for a
  v5p-16 per role (same command with this preset). Not run on TPUs here; `tools/aot_check.py` compiles both roles for
  v5p:2x2x2 within 95 GiB per chip.

* `qwen3-30b-a3b`: Qwen3-30B-A3B (a mixture of experts: 128 experts, 8 per token, 3.3B active parameters of 30.5B),
  same hyperparameters, for a v5p-64 learner and a v5p-32 sampler (4-way tensor parallel). Not run on TPUs here;
  `tools/aot_check.py` compiles both roles for them (docs/results.md).

Measured figures: docs/results.md. Any field can be overridden: `--config.learner.lr=1e-5`. Unknown keys raise.
"""

import os

import ml_collections

from areal_jax.learner import objectives

# The presets as data: each is the fields it changes from the defaults in `get_config` (which are `tiny`'s), in one
# place. `TABLE3` holds what the real-size presets share: the paper's Table 3 settings on real data and answers.
FAST = {  # `tiny` made small and quick with every mechanism on; configs/agent.py:fast applies it too
    "model.hidden_size": 64, "model.intermediate_size": 128, "model.num_layers": 2, "model.num_heads": 2,
    "model.num_kv_heads": 1, "model.head_dim": 32,
    "warmstart.steps": 30, "warmstart.batch_size": 32, "warmstart.target_match": 0.0,
    "data.eval_size": 8, "data.synthetic_size": 2000, "data.max_prompt_len": 40,
    "rollout.batch_size": 4, "rollout.group_size": 4, "rollout.max_concurrent_rollouts": 8,
    # With uniform groups filtered, nearly every group of a model this weak (all wrong) would be dropped: kept.
    "learner.ppo_n_minibatches": 2, "learner.max_tokens_per_mb": 256, "learner.min_bucket": 64,
    "learner.filter_uniform_groups": False,
    "sampler.num_slots": 32, "sampler.num_pages": 256, "sampler.max_new_tokens": 40, "sampler.max_seq_len": 96,
    "checkpoint.every_steps": 2, "eval.every_steps": 2, "reward.num_workers": 1, "metrics.tensorboard": False,
}
TINY_MOE = {  # Qwen3-MoE layers whose 8 experts of width 384, 2 per token, hold as many active parameters as tiny's MLP
    "model.family": "qwen3_moe", "model.qk_norm": True, "model.attention_bias": False, "model.num_experts": 8,
    "model.num_experts_per_tok": 2, "model.moe_intermediate_size": 384,
}
TABLE3 = {
    "total_steps": 1000, "model.scan_layers": True, "model.tie_word_embeddings": False, "model.dtype": "bfloat16",
    "data.source": "files", "data.prompt_template": "chat", "data.max_prompt_len": 1024,
    "sampler.num_slots": 256, "sampler.page_size": 64, "sampler.num_pages": 0, "sampler.max_seq_len": 28672,
    "sampler.max_new_tokens": 27648, "sampler.param_dtype": "bfloat16",
    "learner.lr": 2e-5, "learner.warmup_steps": 2, "learner.max_tokens_per_mb": 32768,
    "rollout.batch_size": 512, "rollout.group_size": 16, "rollout.max_head_offpolicyness": 8,
    "rollout.max_concurrent_rollouts": 256, "rollout.stall_timeout_s": 3600.0,
    "reward.num_workers": 16, "warmstart.steps": 0, "warmstart.target_match": 0.0,
    "checkpoint.every_steps": 50, "eval.every_steps": 50,
    "eval.num_samples": 1,  # greedy, one answer a problem (tools/evaluate.py: 32 samples at temperature 0.6)
}
PRESETS = {
    "tiny": {},
    "fast": FAST,
    "tiny-moe": TINY_MOE,
    "qwen2.5-1.5b": TABLE3 | {
        "model.vocab_size": 151936, "model.hidden_size": 1536, "model.intermediate_size": 8960,
        "model.num_layers": 28, "model.num_heads": 12, "model.num_kv_heads": 2, "model.head_dim": 128,
        "model.max_position_embeddings": 131072,
        # Matmul outputs kept for the backward pass (fewer FLOPs, more memory); on 16 GiB chips (v5e) set remat=full.
        "model.remat": "dots",
    },
    "r1-distill-qwen-7b": TABLE3 | {
        "model.vocab_size": 152064, "model.hidden_size": 3584, "model.intermediate_size": 18944,
        "model.num_layers": 28, "model.num_heads": 28, "model.num_kv_heads": 4, "model.head_dim": 128,
        "model.max_position_embeddings": 131072, "model.remat": "full",
    },
    "qwen3-30b-a3b": TABLE3 | {
        "model.family": "qwen3_moe", "model.vocab_size": 151936, "model.hidden_size": 2048,
        "model.intermediate_size": 6144,  # no dense layers: unused
        "model.num_layers": 48, "model.num_heads": 32, "model.num_kv_heads": 4, "model.head_dim": 128,
        "model.rope_theta": 1000000.0, "model.max_position_embeddings": 40960, "model.attention_bias": False,
        "model.qk_norm": True, "model.num_experts": 128, "model.num_experts_per_tok": 8,
        "model.moe_intermediate_size": 768, "model.remat": "full",
        "mesh.sampler_tensor": 4,  # its 61 GB of bfloat16 weights over 4 chips
    },
}


def apply(c: ml_collections.ConfigDict, fields: dict) -> ml_collections.ConfigDict:
  """Sets `fields` ("group.name": value) on `c`; a key the config does not have raises, naming it."""
  for key, value in fields.items():
    *groups, leaf = key.split(".")
    node = c
    for group in groups:
      node = node[group]
    if leaf not in node:
      raise KeyError(f"configs/math.py: a preset sets {key!r}, a field the config does not have")
    node[leaf] = value
  return c


def _model() -> ml_collections.ConfigDict:
  m = ml_collections.ConfigDict()
  m.family = "qwen2"  # qwen2 | qwen3 | qwen3_moe | llama
  m.init_from = ""  # HF model directory; "" = random init (+ supervised warm-start for `tiny`)
  m.tokenizer = "char"  # "char" (built-in character vocabulary) or a path (tokenizer.json dir / .model file)
  # A model over 50M parameters with the char tokenizer, or with neither init_from nor warm-start steps, is refused
  # at load time (it would learn nothing); True trains it so anyway (a benchmark of a random real-size model).
  m.allow_random_init = False
  # RoPE scaling (rope_type "" = none, "llama3" = Llama 3.1's; the rest are its parameters), as in HF configs
  m.rope_scaling = ml_collections.ConfigDict(
      {"rope_type": "", "factor": 1.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
       "original_max_position_embeddings": 8192})
  m.rms_norm_eps = 1e-6  # RMSNorm epsilon
  m.dtype = "float32"  # compute dtype: float32 | bfloat16 (parameters stay param_dtype)
  m.param_dtype = "float32"  # the learner's parameters (its master weights)
  m.remat = "none"  # none | full | dots
  # Decoder layers under lax.scan (one layer compiled, one layer's activations live); tiny runs its 4 layers unrolled.
  m.scan_layers = False
  # Packed training attention: auto = splash (Pallas TPU) on TPU, pallas_gpu (Pallas GPU flash) on GPU, else flash
  # (pure JAX; dense for rows of <= 2 blocks).
  m.attention = "auto"  # auto | flash | splash | pallas_gpu | dense
  m.attention_block = 0  # tokens per block; 0 = flash: 128 on CPU, 512 elsewhere; splash: 512
  # Mixture of experts (family qwen3_moe; 0 experts = dense): layer i is sparse unless it is in mlp_only_layers or
  # (i + 1) % decoder_sparse_step != 0, as in HF's Qwen3-MoE.
  m.num_experts = 0  # experts per sparse layer
  m.num_experts_per_tok = 0  # experts each token is routed to (top-k)
  m.moe_intermediate_size = 0  # one expert's MLP width
  m.norm_topk_prob = True  # renormalise a token's k routing weights to sum to 1
  m.decoder_sparse_step = 1  # every n-th layer is sparse
  m.mlp_only_layers = ()  # layers kept dense
  m.experts_impl = "auto"  # expert matmuls: auto (TPU megablox, GPU ragged_dot, CPU tiled) | ragged_dot | tiled
  m.vocab_size = 64  # token ids (the char tokenizer needs 64)
  m.hidden_size = 256  # model width
  m.intermediate_size = 768  # MLP width
  m.num_layers = 4  # decoder layers
  m.num_heads = 4  # query heads
  m.num_kv_heads = 2  # key/value heads (grouped-query attention)
  m.head_dim = 64  # width of one head
  m.rope_theta = 10000.0  # RoPE base frequency
  m.max_position_embeddings = 512  # longest position the model takes
  m.tie_word_embeddings = True  # the output projection is the embedding table
  m.attention_bias = True  # biases on the q, k, v projections (Qwen2)
  m.qk_norm = False  # RMSNorm on queries and keys per head (Qwen3)
  return m


def get_config(preset: str | None = None) -> ml_collections.ConfigDict:
  """The defaults below (`tiny`'s), then the preset's fields from `PRESETS`."""
  preset = preset or "tiny"
  if preset not in PRESETS:
    raise ValueError(f"unknown preset {preset!r} in configs/math.py; choose one of {tuple(PRESETS)}")
  c = ml_collections.ConfigDict()
  c.preset = preset  # the preset this config was built from
  c.seed = 0  # model init, sampling and data order
  c.total_steps = 90  # learner steps (policy versions) to train

  c.model = _model()

  c.data = ml_collections.ConfigDict()
  # synthetic | files (data.path: JSONL, Parquet if it ends in .parquet, or a .json array; local or gs://; "jsonl" is
  # its old name) | tfds. Released datasets to files: tools/prepare_data.py.
  c.data.source = "synthetic"
  c.data.path = ""  # training problems (source=files): a .jsonl or .parquet file
  c.data.eval_path = ""  # held-out problems (source=files); "" = data.eval_size problems held out of data.path
  c.data.tfds_name = ""  # TFDS dataset name (source=tfds)
  c.data.tfds_data_dir = ""  # local directory holding the prepared (array_record) dataset
  c.data.split = "train"  # tfds split to train on
  c.data.eval_split = ""  # tfds split to evaluate on; "" = data.eval_size problems held out of data.split
  c.data.prompt_template = "plain"  # plain | chat
  c.data.max_prompt_len = 48  # prompt tokens at most; longer prompts are skipped
  c.data.skip_bad_rows = False  # False: a bad row raises, naming file, line and field; True: skipped and counted
  c.data.shuffle_seed = 0  # order of the prompt stream
  c.data.synthetic_task = "arithmetic"  # arithmetic | products (two-digit products, for configs/agent.py)
  c.data.synthetic_difficulty = 1  # 1..4: number of operations in the synthetic problems
  c.data.synthetic_mix = ""  # "1:9,4:1" = difficulty:weight pairs (long-tail answer lengths); "" = synthetic_difficulty
  c.data.synthetic_size = 20000  # synthetic problems generated
  c.data.eval_size = 128  # problems held out for evaluation

  c.sampler = ml_collections.ConfigDict()
  c.sampler.num_slots = 64  # sequences decoded at once (continuous batching)
  c.sampler.page_size = 16  # tokens per KV-cache page
  c.sampler.num_pages = 512  # 0 = fill `memory_fraction` of free device memory
  c.sampler.memory_fraction = 0.8  # share of free device memory for the KV pool when num_pages = 0
  c.sampler.max_seq_len = 128  # prompt + answer (cache length per sequence)
  c.sampler.max_new_tokens = 64  # answer tokens at most
  c.sampler.temperature = 1.0  # sampling temperature (the learner divides logits by it too)
  c.sampler.top_p = 1.0  # nucleus sampling; 1 = off
  c.sampler.top_k = -1  # -1 = off
  c.sampler.attention = "auto"  # auto | jax | pallas_tpu | pallas_gpu (decode attention; auto: by platform)
  c.sampler.attention_block = 0  # tokens per block of the pure-JAX paged attention; 0 = 32 on CPU, 256 elsewhere
  # Decode steps per device call, one while loop (new answers and weights wait for the call to end).
  c.sampler.decode_steps = 8
  # Dispatch each decode call before reading the last one's tokens: the host's bookkeeping hides behind the device.
  c.sampler.overlap = True
  c.sampler.max_prefill_tokens = 0  # rows x padded length of a prefill call, per data shard; 0 = max(8192, max_seq_len)
  # Keep released sequences' full pages for prompts that extend them (an agent's next turn); evicted when short.
  c.sampler.prefix_cache = False
  # The sampler's copy of the weights: bfloat16 halves their HBM and update bytes (gap: sampler/logprob_gap).
  c.sampler.param_dtype = "float32"
  c.sampler.vocab_limit = 0  # ids at or above are never drawn; 0 = the tokenizer's vocab_size (padded rows unused)
  c.sampler.recompute_on_swap = True  # new weights recompute running answers' caches; False keeps them (stale)
  c.sampler.warmup = False  # compile every prefill bucket and decode first: no compile stalls mid-run, a slower start
  # Speculative decoding: "suffix" drafts from the rollouts already drawn (own context, the same prompt's finished
  # answers, recent answers), verified exactly (same distribution, same logprobs); "off" = one token per forward.
  c.sampler.speculation = "off"
  c.sampler.spec_tokens = 4  # draft tokens verified per slot and forward (the forward covers spec_tokens + 1)

  c.learner = ml_collections.ConfigDict()
  c.learner.lr = 1e-4  # Adam learning rate
  c.learner.weight_decay = 0.05  # decoupled weight decay (AdamW)
  c.learner.b1 = 0.9  # Adam beta1
  c.learner.b2 = 0.95  # Adam beta2
  c.learner.adam_eps = 1e-5  # Adam epsilon
  c.learner.grad_clip = 1.0  # global gradient-norm clip; 0 = off
  c.learner.warmup_steps = 10  # learner steps of linear warmup (x ppo_n_minibatches optimizer updates)
  # The policy objective (docs/objectives.md): ppo (decoupled PPO, paper Eq. 5) | gspo (its sequence-level ratio) |
  # sapo (soft gates; needs use_decoupled_loss=False, as in AReaL) | cispo (MiniMax-M1's clipped IS weight).
  c.learner.loss = "ppo"
  c.learner.eps_clip = 0.2  # ppo/gspo/cispo clip: ratios outside [1 - eps_clip, 1 + eps_clip]; <= 1
  c.learner.eps_clip_higher = 0.0  # 0 = symmetric clip
  c.learner.c_clip = 0.0  # 0 = no dual clip
  c.learner.behav_imp_weight_cap = 0.0  # 0 = no cap; w above it weighs 0 (token-level rejection by ratio)
  # Off-policy corrections of w = pi_prox / pi_behav outside [lower, upper] (AReaL's rejection; docs/concepts.md).
  c.learner.rejection = ml_collections.ConfigDict()
  c.learner.rejection.level = ""  # "" | token | sequence
  c.learner.rejection.action = "mask"  # mask | clamp
  c.learner.rejection.metric = "ratio"  # ratio | kl_k1 | kl_k2 | kl_k3
  c.learner.rejection.agg = "mean"  # sequence level: mean | sum | max (the ratio in log space: geometric)
  c.learner.rejection.upper = 5.0  # upper bound of the corrected metric
  c.learner.rejection.lower = ml_collections.config_dict.placeholder(float)  # None = no lower bound
  c.learner.importance_sampling_level = "token"  # ppo/sapo: token | sequence (GSPO's geometric-mean ratio)
  c.learner.tau_pos = 1.0  # sapo: gate temperature where the advantage is positive
  c.learner.tau_neg = 1.05  # sapo: gate temperature where it is negative
  # M2PO: per minibatch, drop the tokens of largest (log pi_behav - log pi_prox)^2 until the rest's mean is below this
  # (logged as learner/m2po_masked_fraction); 0 = off. Needs the recomputed proximal pass and token-mean.
  c.learner.m2_threshold = 0.0
  c.learner.use_decoupled_loss = True  # the decoupled PPO objective (False: standard PPO, proximal = behaviour)
  # Proximal logprobs: recompute (a forward pass) | loglinear (interpolated by token version, one pass fewer).
  c.learner.prox_logp_method = "recompute"
  c.learner.ppo_n_minibatches = 4  # optimizer updates per learner step (each on whole prompt groups)
  # Tokens per row (device) of a micro-batch, >= the longest sequence; short rows are cheaper for short sequences.
  c.learner.max_tokens_per_mb = 256
  c.learner.min_bucket = 128  # row lengths: this x 1, 1.5, 2, 3, ... up to max_tokens_per_mb (one compile each)
  # Vocabulary entries per chunk of logprobs and entropy (at most a [tokens, chunk] logits tile); 0 = all at once.
  c.learner.vocab_chunk = 8192
  c.learner.kl_coef = 0.0  # KL penalty to the proximal policy; 0 = off
  c.learner.kl_estimator = "k3"  # k1 | k2 | k3
  c.learner.entropy_coef = 0.0  # entropy bonus; 0 = off
  c.learner.aux_loss_coef = 0.001  # mixture of experts: the router's load-balancing loss (logged as learner/aux_loss)
  # Mixture of experts: the sampler records each position's experts and the learner's proximal and training passes
  # use them (routing replay: the experts fixed, their weights from the learner's router).
  c.learner.routing_replay = False
  c.learner.reward_scale = 5.0  # r in {0,1} -> (r - 0.5) * 2 * scale
  c.learner.adv_norm = "group"  # group | batch | none
  c.learner.filter_uniform_groups = True  # drop groups whose answers all score the same (no advantage)
  # token-mean (the paper) | seq-mean-token-mean (GRPO) | seq-mean-token-sum-norm (Dr. GRPO)
  c.learner.loss_agg = "token-mean"
  c.learner.loss_agg_max_tokens = 0  # Dr. GRPO's divisor of token sums; 0 = sampler.max_new_tokens
  # PPO with a learned critic (docs/models.md): "" = critic-free (the paper's) | copy | lora (LoRA runs)
  c.learner.critic = ""
  c.learner.gae_gamma = 1.0  # GAE over the shaped, normalised rewards (critic runs)
  c.learner.gae_lambda = 1.0  # GAE lambda (with a critic)
  c.learner.value_clip = 0.2  # the value loss's clip around the step's starting values
  c.learner.critic_lr = 0.0  # 0 = learner.lr
  # An objective registered beyond the built-in ones (`objectives.register`): its parameters that no key above names,
  # at their defaults, set by their names (`--config.learner.beta=0.5`).
  c.learner.update({k: v for k, v in objectives.declared_params().items() if k not in c.learner})
  # LoRA (docs/models.md): rank > 0 freezes the base and trains adapters; the sampler then takes only the adapters.
  c.learner.lora = ml_collections.ConfigDict()
  c.learner.lora.rank = 0  # tiny, rank 8: learner.lr=7e-4 suggested
  c.learner.lora.alpha = 16.0  # adapters scaled by alpha / rank
  c.learner.lora.targets = "q,k,v,o,gate,up,down"  # projections that get adapters
  c.learner.lora.dropout = 0.0  # must stay 0: a random mask would make the learner's logprobs noisy
  c.learner.lora.quantize_base = ""  # "" = model.param_dtype | bfloat16 | int8 | nf4 (QLoRA; adapters stay float32)

  c.rollout = ml_collections.ConfigDict()
  c.rollout.batch_size = 16  # B: prompt groups per learner step
  c.rollout.group_size = 8  # G: answers per prompt
  c.rollout.max_head_offpolicyness = 4  # eta; 0 = synchronous RL
  c.rollout.max_concurrent_rollouts = 16  # groups in flight
  # Pace the sampler this many versions ahead (fractional allowed) instead of up to eta; None = eta.
  c.rollout.target_staleness = ml_collections.config_dict.placeholder(float)
  # A run that accepts no group for this long stops with an error (every answer scores the same: nothing to learn).
  c.rollout.stall_timeout_s = 300.0
  # How a prompt becomes a scored group (docs/objectives.md, Workflows): rlvr (G answers, each verified), agent (G
  # episodes of agent.path), multi_turn_math (a wrong answer gets the verifier's verdict and another try), or a
  # module:function path; "" = agent when agent.path is set, else rlvr.
  c.rollout.workflow = ""
  c.rollout.max_turns = 2  # multi-turn workflows: answers per episode
  c.rollout.turn_discount = 0.9  # multi-turn workflows: reward x turn_discount ** (turns - 1)

  c.reward = ml_collections.ConfigDict()
  c.reward.num_workers = 2  # reward worker processes
  c.reward.timeout_s = 5.0  # per item on a worker; it scores 0 past this
  c.reward.code_test_timeout_s = 2.0  # wall and CPU seconds per sandboxed code test
  c.reward.code_memory_mb = 1024  # address-space cap per sandboxed code test
  # bwrap: a kernel-enforced jail (needs bubblewrap) | rlimits: weaker, only where bwrap cannot run.
  c.reward.code_isolation = "bwrap"

  # An agent on the OpenAI API (docs/agents.md): its episodes and rewards replace single-turn answers.
  c.agent = ml_collections.ConfigDict()
  c.agent.path = ""  # "module:attribute", importable where the job runs; "" = single-turn answers
  c.agent.options = ml_collections.ConfigDict()  # keyword arguments for a class at agent.path
  c.agent.max_turns = 8  # completions per episode; one more fails the episode
  c.agent.timeout_s = 600.0  # per episode; past it the episode fails (scored 0)
  c.agent.turn_discount = 1.0  # each earlier completion adds the next one's reward times this (AReaL's rule)

  c.mesh = ml_collections.ConfigDict()
  # Emulated devices per process when running on CPU (4: 2 sampler, 2 learner).
  c.mesh.cpu_devices = 4
  c.mesh.sampler_processes = 1  # multi-process jobs (--num_processes > 1): how many processes are samplers
  # A sampler process that sends nothing this long (hung, or cut off) is dropped and its groups generated again.
  c.mesh.sampler_heartbeat_s = 30.0
  c.mesh.sampler_devices = 0.5  # int = count, float in (0, 1) = fraction of devices; the rest are the learner's
  # Both roles on every device, generate-then-train: synchronous RL's colocated baseline (needs
  # rollout.max_head_offpolicyness=0; sampler_devices unused). The sampler's KV pool and the learner's state share HBM.
  c.mesh.colocated = False
  # sampler mesh: data x tensor (data = devices / tensor); 30B-A3B: its 61 GB of bfloat16 weights over 4 chips
  c.mesh.sampler_tensor = 1
  # Independent sampler engines on equal parts of the sampler slice (own scheduler, KV pool, weight swap); the
  # sampler.num_slots and num_pages are each replica's; in a multi-process job, of each sampler process's devices.
  c.mesh.sampler_replicas = 1
  # learner mesh: fsdp x tensor (fsdp = devices / tensor); tensor > 1 trades rows for memory.
  c.mesh.learner_tensor = 1
  # Expert parallelism (a mixture of experts): its experts sharded over this many devices of each role's mesh (data or
  # fsdp x expert x tensor); the learner's rows are split over it too, the sampler's slots replicated.
  c.mesh.sampler_expert = 1  # sampler mesh: data x expert x tensor
  c.mesh.learner_expert = 1  # learner mesh: fsdp x expert x tensor

  # Supervised warm-start on worked solutions: of the random init, or of model.init_from's weights with on_init_from.
  c.warmstart = ml_collections.ConfigDict()
  # At most; 0 = none; the cosine schedule spans all of them. Cached in <workdir>/warmstart.
  c.warmstart.steps = 500
  c.warmstart.lr = 2e-3  # peak of a cosine schedule over `steps`
  c.warmstart.batch_size = 16
  # Stop once the held-out solutions' mean probability of being drawn exactly is >= this (every 10 steps); 0 = off.
  c.warmstart.target_match = 0.6
  c.warmstart.heldout = 128  # the last pairs, held out from the warm-start to measure target_match
  # Stop once the mean loss of 10 steps is <= this; 0 = off (a poorer stop than target_match).
  c.warmstart.target_loss = 0.0
  # True: one update per batch (its packed pieces' gradients added); False: one per piece. configs/agent.py: True.
  c.warmstart.accumulate = False
  # A directory (local or gs://) where runs share their warm-starts, each under a key of everything that decides it
  # (model, data, tokenizer, warm-start settings, seed, learner mesh): a run finds its own there instead of training
  # it. "" = none (each run keeps its own in <workdir>/warmstart). Default: $AREAL_JAX_WARMSTART_CACHE (tests set it).
  c.warmstart.cache_dir = os.environ.get("AREAL_JAX_WARMSTART_CACHE", "")
  # True: warm-start model.init_from's weights too (a released checkpoint fine-tuned on worked solutions, e.g. to
  # answer in \boxed{}, before RL); False: model.init_from's weights go to RL as they are.
  c.warmstart.on_init_from = False

  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.every_steps = 30  # learner steps between checkpoints
  c.checkpoint.max_to_keep = 3  # checkpoints kept

  c.eval = ml_collections.ConfigDict()
  c.eval.every_steps = 30  # learner steps between held-out evaluations
  c.eval.num_samples = 4  # 1 = greedy; k > 1 = pass@1 averaged over k samples at eval.temperature
  c.eval.temperature = 1.0  # with eval.num_samples > 1 (with 1 it is unused: another value is refused)

  c.sync = ml_collections.ConfigDict()  # weight updates to sampler processes (a multi-process run)
  # True: a sampler that holds the version before is sent only the elements whose bits changed (indices and values,
  # rebuilt on its devices bit for bit, checked by the fingerprint); one that joins or restarts gets the whole copy.
  c.sync.delta = False
  # True: the learner trains on while the new version is copied, diffed and offered (one version in flight; the bound
  # on versions live holds as without); False: the learner waits until it is offered.
  c.sync.overlap = True

  c.metrics = ml_collections.ConfigDict()
  c.metrics.tensorboard = True  # TensorBoard event files beside metrics.jsonl
  c.metrics.save_batches = False  # every trained batch to <workdir>/batches/step_N.npz (to replay a step)
  return apply(c, PRESETS[preset])
