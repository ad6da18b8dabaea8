"""The policy server, live on 127.0.0.1: OpenAI-client completions and chat completions on a tiny HF directory equal
the full forward's argmax and the sampler's own draws, concurrent requests share decode batches, bad requests get a
clear 400 and the next request is served, a full queue gives 429, and a run's checkpoint serves its policy version."""

import concurrent.futures
import dataclasses
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest
import tokenizers
from flax import nnx

from areal_jax.models import orbax_io, save_hf
from areal_jax.rl.checkpoint import Checkpointer
from areal_jax.sampler import Request, SamplingParams, generate
from areal_jax.serve import build
from areal_jax.tokenizer import load_tokenizer
from helpers import TINY, tiny_model

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
          "'\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
TEXT = ["What is 12 + 34? The answer is 46.", "Please reason step by step: 7 * 8 = 56, so x = 56.",
        "Question: how many apples are left? Answer: 3 apples."]
MAX_SEQ_LEN = 128
SIZING = dict(max_seq_len=MAX_SEQ_LEN, num_slots=4, page_size=8, warmup=False)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  """A tiny random Qwen2 and a byte-level BPE tokenizer (ChatML template) of the same vocabulary, as a HF directory."""
  path = tmp_path_factory.mktemp("serve_hf")
  tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token=None))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(vocab_size=96, special_tokens=["<|endoftext|>", "<|im_start|>",
                                                                          "<|im_end|>"])
  tok.train_from_iterator(TEXT, trainer)
  tok.save(str(path / "tokenizer.json"))
  (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                                                          "chat_template": CHATML}))
  (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))  # <|endoftext|>, <|im_end|>
  save_hf(tiny_model(dataclasses.replace(TINY, vocab_size=tok.get_vocab_size()), seed=3), str(path))
  return str(path)


@pytest.fixture(scope="module")
def model(hf_dir):
  from areal_jax.models import load_hf  # pylint: disable=g-import-not-at-top
  return load_hf(hf_dir)


@pytest.fixture(scope="module")
def tok(hf_dir):
  return load_tokenizer(hf_dir)


@pytest.fixture(scope="module")
def server(hf_dir):
  srv = build(hf_dir, port=0, devices=jax.devices()[:1], max_queue=64, **SIZING).start()
  yield srv
  srv.stop()


@pytest.fixture(scope="module")
def client(server):
  return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def full_forward(model, prompt, answer):
  """Greedy check and logprobs from one uncached forward: the argmax and log-softmax at every answer position."""
  seq = list(prompt) + list(answer)
  logits = jax.jit(lambda t: model(t))(jnp.asarray([seq + [0] * (MAX_SEQ_LEN - len(seq))], jnp.int32))[0]
  rows = np.asarray(jax.nn.log_softmax(logits[len(prompt) - 1:len(seq) - 1].astype(jnp.float32), axis=-1))
  return rows.argmax(-1).tolist(), rows[np.arange(len(answer)), answer]


def post(server, path, data: bytes):
  """(status, JSON body) of a raw POST (for bodies the OpenAI client would not send)."""
  req = urllib.request.Request(server.url + path, data=data, headers={"Content-Type": "application/json"})
  try:
    with urllib.request.urlopen(req, timeout=120) as r:
      return r.status, json.loads(r.read())
  except urllib.error.HTTPError as e:
    return e.code, json.loads(e.read())


def test_models_health_and_stats(server, client, hf_dir):
  [m] = client.models.list().data
  assert m.id == server.model_name == os.path.basename(hf_dir) and m.model_extra["max_model_len"] == MAX_SEQ_LEN
  assert server.backend.scheduler.eos_ids == {0, 2}  # the tokenizer's and generation_config.json's
  with urllib.request.urlopen(server.url + "/health") as r:
    assert json.loads(r.read())["status"] == "ok"
  with urllib.request.urlopen(server.url + "/stats") as r:
    assert {"running", "waiting", "requests", "rejected", "max_batch_requests"} <= set(json.loads(r.read()))


def test_greedy_completion_is_the_full_forward_argmax(server, client, model, tok):
  for prompt in ("What is 12 + 34?", [5, 17, 3, 40, 22, 9]):
    r = client.completions.create(model="any", prompt=prompt, max_tokens=20, temperature=0, logprobs=0,
                                  extra_body={"ignore_eos": True})
    [c] = r.choices
    ids = tok.encode(prompt) if isinstance(prompt, str) else prompt
    argmax, logprobs = full_forward(model, ids, c.token_ids)
    assert c.token_ids == argmax and len(c.token_ids) == 20 and c.finish_reason == "length"
    np.testing.assert_allclose(c.logprobs.token_logprobs, logprobs, atol=1e-4)  # greedy: under temperature 1
    assert c.logprobs.tokens == [tok.decode([t]) for t in c.token_ids] and c.text == tok.decode(c.token_ids)
    assert r.policy_version == server.backend.version == c.version_start == c.version_end
    assert r.system_fingerprint == f"areal_jax-policy-v{r.policy_version}"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 20)


def test_seeded_sampling_equals_the_sampler_and_repeats(client, model, tok):
  kw = dict(max_tokens=12, temperature=0.8, top_p=0.9, n=3, seed=7, logprobs=0, extra_body={"ignore_eos": True})
  prompt = "Please reason step by step"
  first = client.completions.create(model="any", prompt=prompt, **kw)
  again = client.completions.create(model="any", prompt=prompt, **kw)
  [want] = generate(model, [tok.encode(prompt)], max_new_tokens=12, temperature=0.8, top_p=0.9, n=3, seed=7)
  for c, w, a in zip(first.choices, want, again.choices):
    assert c.token_ids == w.tokens.tolist() == a.token_ids
    np.testing.assert_allclose(c.logprobs.token_logprobs, w.logprobs, atol=1e-5)
  assert len({tuple(c.token_ids) for c in first.choices}) > 1  # answers of one request draw independently


def test_chat_completion_logprobs(server, client, model, tok):
  messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 7 * 8?"}]
  r = client.chat.completions.create(model="any", messages=messages, max_tokens=16, temperature=0, logprobs=True)
  [c] = r.choices
  content = c.logprobs.content
  assert [e.model_extra["token_id"] for e in content] == c.token_ids and len(content) == r.usage.completion_tokens
  assert all(math.isfinite(e.logprob) and e.logprob <= 0 and e.token == tok.decode([e.model_extra["token_id"]])
             for e in content)
  prompt = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
  argmax, logprobs = full_forward(model, prompt, c.token_ids)
  assert c.token_ids == argmax and r.usage.prompt_tokens == len(prompt)
  np.testing.assert_allclose([e.logprob for e in content], logprobs, atol=1e-4)
  assert c.message.role == "assistant" and c.message.content == tok.decode(c.token_ids)
  assert c.finish_reason == ("stop" if c.token_ids[-1] in server.backend.scheduler.eos_ids else "length")
  assert r.policy_version == c.version_end


def test_stop_string_ends_the_text_before_it(client, tok):
  kw = dict(model="any", prompt="Question: how many", max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
  full = client.completions.create(**kw).choices[0]
  stop = tok.decode(full.token_ids[5:7])
  cut = client.completions.create(stop=[stop, "never seen"], **kw).choices[0]
  assert cut.finish_reason == "stop" and cut.text == full.text[:full.text.index(stop)]
  assert cut.token_ids == full.token_ids[:len(cut.token_ids)] and stop in tok.decode(cut.token_ids)
  assert stop not in tok.decode(cut.token_ids[:-1])  # the tokens stop with the one that completes the stop string


def test_concurrent_requests_share_decode_batches(server, client, model, tok):
  prompts = [f"What is {i} + {2 * i}?" for i in range(16)]
  before = server.backend.stats()

  def ask(p):
    return client.completions.create(model="any", prompt=p, max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].token_ids

  with concurrent.futures.ThreadPoolExecutor(16) as pool:
    got = list(pool.map(ask, prompts))
  want = generate(model, [tok.encode(p) for p in prompts], max_new_tokens=16, temperature=0.0)
  assert got == [w[0].tokens.tolist() for w in want]  # batching changes no answer
  after = server.backend.stats()
  assert after["finished"] - before["finished"] == 16
  # One request alone draws at most decode_steps=8 tokens per decode call (its prefill token included): more per
  # call means calls advanced answers of several HTTP requests.
  calls, tokens = (after[k] - before[k] for k in ("decode_calls", "tokens"))
  assert tokens == 16 * 16 and tokens / calls > 8, (tokens, calls)
  assert after["max_batch_requests"] > 1


BAD = {  # name: (body, param, words the message must hold)
    "malformed JSON": (b'{"prompt": "hi", "max_tokens": ', None, "malformed JSON"),
    "wrong type": ({"prompt": "hi", "temperature": "hot"}, "temperature", "temperature"),
    "no prompt": ({"max_tokens": 3}, "prompt", "prompt: Field required"),
    "prompt too long": ({"prompt": [5] * MAX_SEQ_LEN}, "prompt",
                        f"prompt too long: {MAX_SEQ_LEN} tokens > max {MAX_SEQ_LEN - 1}"),
    "negative temperature": ({"prompt": "hi", "temperature": -0.5}, "temperature", "temperature=-0.5"),
    "top_p zero": ({"prompt": "hi", "top_p": 0}, "top_p", "top_p=0.0"),
    "top_p above one": ({"prompt": "hi", "top_p": 1.5}, "top_p", "top_p=1.5"),
    "max_tokens zero": ({"prompt": "hi", "max_tokens": 0}, "max_tokens", "max_tokens=0"),
    "max_tokens beyond the cache": ({"prompt": [5, 6], "max_tokens": MAX_SEQ_LEN}, "max_tokens",
                                    f"max_tokens={MAX_SEQ_LEN}: the prompt's 2 tokens leave room for at most "
                                    f"{MAX_SEQ_LEN - 2}"),
    "n zero": ({"prompt": "hi", "n": 0}, "n", "n=0"),
    "token outside the vocabulary": ({"prompt": [5, 100000]}, "prompt", "token id 100000 outside the vocabulary"),
    "empty stop": ({"prompt": "hi", "stop": [""]}, "stop", "stop strings must be non-empty"),
    "top alternatives": ({"prompt": "hi", "logprobs": 3}, "logprobs", "logprobs=3"),
    "streaming": ({"prompt": "hi", "stream": True}, "stream", "stream=True is not supported"),
    "empty chat": ({"messages": []}, "messages", "messages: empty"),
    "image part": ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages",
                   "part type(s) ['image_url'] are not supported"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_request_gets_a_clear_400_and_the_next_is_served(server, case):
  body, param, words = BAD[case]
  path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
  status, reply = post(server, path, body if isinstance(body, bytes) else json.dumps(body).encode())
  assert status == 400, reply
  assert words in reply["error"]["message"] and reply["error"]["param"] == param, reply
  status, reply = post(server, "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 2}).encode())
  assert status == 200 and len(reply["choices"][0]["token_ids"]) <= 2


def test_full_queue_gives_429_and_the_server_keeps_serving(server, client):
  backend = server.backend
  long = dict(max_new_tokens=MAX_SEQ_LEN - 8, ignore_eos=True)
  running = [backend.submit(Request(group_id=0, prompt_ids=[5, 6, 7], sampling=SamplingParams(seed=i, **long)))
             for i in range(4)]  # one per slot
  deadline = time.monotonic() + 60
  while backend.stats()["running"] < 4:
    assert time.monotonic() < deadline, backend.stats()
    time.sleep(0.002)
  backend.max_queue = 1
  try:
    queued = backend.submit(Request(group_id=0, prompt_ids=[5, 6, 7], sampling=SamplingParams(**long)))
    with pytest.raises(openai.RateLimitError, match=r"1 requests are waiting .*max_queue=1"):
      client.completions.create(model="any", prompt="hi", max_tokens=2)
    assert backend.stats()["rejected"] >= 1
    for f in running + [queued]:
      assert len(f.result(timeout=120)[0].tokens) == MAX_SEQ_LEN - 8
    assert client.completions.create(model="any", prompt="hi", max_tokens=2).choices[0].text is not None
  finally:
    backend.max_queue = 64


def test_new_weights_report_their_version(server, client):
  backend = server.backend
  old = backend.version
  backend.update_params(backend.scheduler.params, version=old + 5)
  try:
    r = client.chat.completions.create(model="any", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert r.policy_version == r.choices[0].version_start == old + 5
    assert client.models.list().data[0].model_extra["policy_version"] == old + 5
  finally:
    backend.update_params(backend.scheduler.params, version=old)


def test_a_run_checkpoint_serves_its_step_and_version(hf_dir, model, tmp_path):
  run = tmp_path / "myrun"
  ckpt = Checkpointer(str(run / "checkpoints"), every_steps=1)
  ckpt.save(3, params=nnx.state(model, nnx.Param), opt_state={"count": jnp.zeros(())},
            meta={"version": 11, "model_config": orbax_io.config_to_json(model.cfg)}, force=True)
  ckpt.close()
  (run / "config.json").write_text(json.dumps({"model": {"tokenizer": hf_dir}, "sampler": {"max_seq_len": 64}}))
  sizing = dict(SIZING, max_seq_len=None)  # the run's own
  with build(str(run), port=0, devices=jax.devices()[:1], **sizing) as srv:
    assert srv.model_name == "myrun@3" and srv.backend.scheduler.engine.cfg.max_seq_len == 64
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
    r = client.completions.create(model="any", prompt=[5, 17, 3], max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.policy_version == 11 and r.choices[0].token_ids == full_forward(model, [5, 17, 3],
                                                                             r.choices[0].token_ids)[0]


def test_an_orbax_policy_directory_serves(hf_dir, model, tmp_path):
  orbax_io.save_orbax(model, str(tmp_path / "policy"))
  with build(str(tmp_path / "policy"), tokenizer=hf_dir, port=0, devices=jax.devices()[:1],
             **dict(SIZING, max_seq_len=64)) as srv:
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
    r = client.completions.create(model="any", prompt=[5, 17, 3], max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert (srv.model_name, r.policy_version) == ("policy", 0)
    assert r.choices[0].token_ids == full_forward(model, [5, 17, 3], r.choices[0].token_ids)[0]


def test_command_line(hf_dir):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
  cmd = [sys.executable, "tools/serve.py", f"--checkpoint_dir={hf_dir}", "--port=0", "--max_seq_len=32",
         "--num_slots=2", "--page_size=8", "--nowarmup"]
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.Popen(cmd, cwd=root, env=env, stderr=subprocess.PIPE, text=True)
  try:
    url, seen = None, []
    while url is None:
      line = proc.stderr.readline()
      assert line, f"tools/serve.py exited ({proc.poll()}) before serving:\n{''.join(seen)}"
      seen.append(line)
      url = (m := re.search(r"on (http://127\.0\.0\.1:\d+)/v1", line)) and m.group(1)
    threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep the pipe drained
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    r = client.completions.create(model="any", prompt="What is", max_tokens=4, temperature=0)
    assert r.model == os.path.basename(hf_dir) and 1 <= len(r.choices[0].token_ids) <= 4
  finally:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
