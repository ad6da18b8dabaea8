"""The policy server, live on 127.0.0.1: OpenAI-client completions and chat completions on a tiny HF directory equal
the full forward's argmax and the sampler's own draws, with top alternatives, echo, several prompts, streaming and
tool calls; concurrent requests share decode batches, bad requests get a clear 400 and the next request is served, a
full queue gives 429, and a run's checkpoint serves its policy version."""

import collections
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
import urllib.error
import urllib.request

import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest
import tokenizers
from flax import nnx

from areal_jax.checkpoint.store import CheckpointMeta, Checkpointer
from areal_jax.models import orbax_io, save_hf
from areal_jax.sampler import QueueFull, Request, SamplingParams, generate
from areal_jax.serve import build
from areal_jax.tokenizer import load_tokenizer
from helpers import TINY, TOOLS_CHATML, memorize, tiny_model
from waiting import wait_until

TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}]
TEXT = ["What is 12 + 34? The answer is 46.", "Please reason step by step: 7 * 8 = 56, so x = 56.",
        "Question: how many apples are left? Answer: 3 apples.",
        *[json.dumps(t) for t in TOOLS] * 4, TOOLS_CHATML,
        '<tool_call>{"name": "add", "arguments": {"a": 12, "b": 34}}']
MAX_SEQ_LEN = 256
SIZING = dict(max_seq_len=MAX_SEQ_LEN, num_slots=4, page_size=8, warmup=False)
MODEL = "tiny-qwen"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  """A tiny random Qwen2 and a byte-level BPE tokenizer (ChatML template) of the same vocabulary, as a HF directory."""
  path = tmp_path_factory.mktemp("serve_hf")
  tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token=None))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(vocab_size=200, special_tokens=["<|endoftext|>", "<|im_start|>",
                                                                          "<|im_end|>"])
  tok.train_from_iterator(TEXT, trainer)
  tok.save(str(path / "tokenizer.json"))
  (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                                                          "chat_template": TOOLS_CHATML}))
  (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))  # <|endoftext|>, <|im_end|>
  save_hf(tiny_model(dataclasses.replace(TINY, vocab_size=tok.get_vocab_size(), max_position_embeddings=MAX_SEQ_LEN),
                     seed=3), str(path))
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
  srv = build(hf_dir, port=0, devices=jax.devices()[:1], max_queue=64, model_name=MODEL, **SIZING).start()
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
  assert m.id == server.model_name == MODEL and m.model_extra["max_model_len"] == MAX_SEQ_LEN
  assert server.sampler.scheduler.eos_ids == {0, 2}  # the tokenizer's and generation_config.json's
  with urllib.request.urlopen(server.url + "/health") as r:
    assert json.loads(r.read())["status"] == "ok"
  with urllib.request.urlopen(server.url + "/stats") as r:
    assert {"running", "waiting", "requests", "rejected", "max_batch_requests"} <= set(json.loads(r.read()))


def test_greedy_completion_is_the_full_forward_argmax(server, client, model, tok):
  for prompt in ("What is 12 + 34?", [5, 17, 3, 40, 22, 9]):
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, logprobs=0,
                                  extra_body={"ignore_eos": True})
    [c] = r.choices
    ids = tok.encode(prompt) if isinstance(prompt, str) else prompt
    argmax, logprobs = full_forward(model, ids, c.token_ids)
    assert c.token_ids == argmax and len(c.token_ids) == 20 and c.finish_reason == "length"
    np.testing.assert_allclose(c.logprobs.token_logprobs, logprobs, atol=1e-4)  # greedy: under temperature 1
    assert c.logprobs.tokens == [tok.decode([t]) for t in c.token_ids] and c.text == tok.decode(c.token_ids)
    assert r.policy_version == server.sampler.version == c.version_start == c.version_end
    assert r.system_fingerprint == f"areal_jax-policy-v{r.policy_version}"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 20)


def test_seeded_sampling_equals_the_sampler_and_repeats(client, model, tok):
  kw = dict(max_tokens=12, temperature=0.8, top_p=0.9, n=3, seed=7, logprobs=0, extra_body={"ignore_eos": True})
  prompt = "Please reason step by step"
  first = client.completions.create(model=MODEL, prompt=prompt, **kw)
  again = client.completions.create(model=MODEL, prompt=prompt, **kw)
  [want] = generate(model, [tok.encode(prompt)], max_new_tokens=12, temperature=0.8, top_p=0.9, n=3, seed=7)
  for c, w, a in zip(first.choices, want, again.choices):
    assert c.token_ids == w.tokens.tolist() == a.token_ids
    np.testing.assert_allclose(c.logprobs.token_logprobs, w.logprobs, atol=1e-5)
  assert len({tuple(c.token_ids) for c in first.choices}) > 1  # answers of one request draw independently


def test_chat_completion_logprobs(server, client, model, tok):
  messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 7 * 8?"}]
  r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0, logprobs=True)
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
  assert c.finish_reason == ("stop" if c.token_ids[-1] in server.sampler.scheduler.eos_ids else "length")
  assert r.policy_version == c.version_end


def test_stop_string_ends_the_text_before_it(client, tok):
  kw = dict(model=MODEL, prompt="Question: how many", max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
  full = client.completions.create(**kw).choices[0]
  stop = tok.decode(full.token_ids[5:7])
  cut = client.completions.create(stop=[stop, "never seen"], **kw).choices[0]
  assert cut.finish_reason == "stop" and cut.text == full.text[:full.text.index(stop)]
  assert cut.token_ids == full.token_ids[:len(cut.token_ids)] and stop in tok.decode(cut.token_ids)
  assert stop not in tok.decode(cut.token_ids[:-1])  # the tokens stop with the one that completes the stop string


def test_concurrent_requests_share_decode_batches(server, client, model, tok):
  prompts = [f"What is {i} + {2 * i}?" for i in range(16)]
  before = server.sampler.stats()

  def ask(p):
    return client.completions.create(model=MODEL, prompt=p, max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].token_ids

  with concurrent.futures.ThreadPoolExecutor(16) as pool:
    got = list(pool.map(ask, prompts))
  want = generate(model, [tok.encode(p) for p in prompts], max_new_tokens=16, temperature=0.0)
  assert got == [w[0].tokens.tolist() for w in want]  # batching changes no answer
  after = server.sampler.stats()
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
    "too many alternatives": ({"prompt": "hi", "logprobs": 21}, "logprobs", "logprobs=21: must lie in [0, 20]"),
    "streaming with echo": ({"prompt": "hi", "stream": True, "echo": True}, "stream", "stream=true with echo"),
    "top_logprobs without logprobs": ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
                                      "top_logprobs", "top_logprobs=2 needs logprobs=true"),
    "forced tool call": ({"messages": [{"role": "user", "content": "hi"}], "tools": [], "tool_choice": "required"},
                         "tool_choice", "needs constrained decoding"),
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
  sampler = server.sampler
  long = dict(max_new_tokens=120, ignore_eos=True)
  running = sampler.submit_many([Request(group_id=0, prompt_ids=[5, 6, 7], sampling=SamplingParams(seed=i, **long))
                                 for i in range(4)])  # one per slot
  wait_until(lambda: sampler.stats()["running"] >= 4, timeout_s=60, what=sampler.stats, poll_s=0.002)
  sampler.max_queue = 1
  try:
    [queued] = sampler.submit_many([Request(group_id=0, prompt_ids=[5, 6, 7], sampling=SamplingParams(**long))])
    with pytest.raises(openai.RateLimitError, match=r"1 requests are waiting .*max_queue=1"):
      client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert sampler.stats()["rejected"] >= 1
    for f in running + [queued]:
      assert len(f.result(timeout=120)[0].tokens) == 120
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].text is not None
  finally:
    sampler.max_queue = 64


def test_new_weights_report_their_version(server, client):
  sampler = server.sampler
  old = sampler.version
  sampler.update_params(sampler.scheduler.params, version=old + 5)
  try:
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert r.policy_version == r.choices[0].version_start == old + 5
    assert client.models.list().data[0].model_extra["policy_version"] == old + 5
  finally:
    sampler.update_params(sampler.scheduler.params, version=old)


def test_a_run_checkpoint_serves_its_step_and_version(hf_dir, model, tmp_path):
  run = tmp_path / "myrun"
  ckpt = Checkpointer(str(run / "checkpoints"), every_steps=1)
  ckpt.save(3, params=nnx.state(model, nnx.Param), opt_state={"count": jnp.zeros(())},
            meta=CheckpointMeta(step=3, version=11, model_config=orbax_io.config_to_json(model.cfg)), force=True)
  ckpt.close()
  (run / "config.json").write_text(json.dumps({"model": {"tokenizer": hf_dir}, "sampler": {"max_seq_len": 64}}))
  sizing = dict(SIZING, max_seq_len=None)  # the run's own
  with build(str(run), port=0, devices=jax.devices()[:1], **sizing) as srv:
    assert srv.model_name == "myrun@3" and srv.sampler.scheduler.engine.cfg.max_seq_len == 64
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
    r = client.completions.create(model=srv.model_name, prompt=[5, 17, 3], max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.policy_version == 11 and r.choices[0].token_ids == full_forward(model, [5, 17, 3],
                                                                             r.choices[0].token_ids)[0]


def test_an_orbax_policy_directory_serves(hf_dir, model, tmp_path):
  orbax_io.save_orbax(model, str(tmp_path / "policy"))
  with build(str(tmp_path / "policy"), tokenizer=hf_dir, port=0, devices=jax.devices()[:1],
             **dict(SIZING, max_seq_len=64)) as srv:
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
    r = client.completions.create(model=srv.model_name, prompt=[5, 17, 3], max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert (srv.model_name, r.policy_version) == ("policy", 0)
    assert r.choices[0].token_ids == full_forward(model, [5, 17, 3], r.choices[0].token_ids)[0]


@pytest.mark.slow
def test_command_line(hf_dir):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
  cmd = [sys.executable, "tools/serve.py", f"--checkpoint_dir={hf_dir}", "--port=0", "--max_seq_len=32",
         "--num_slots=2", "--page_size=8", "--nowarmup"]
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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
    r = client.completions.create(model=os.path.basename(hf_dir), prompt="What is", max_tokens=4, temperature=0)
    assert r.model == os.path.basename(hf_dir) and 1 <= len(r.choices[0].token_ids) <= 4
  finally:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0


# --- what agent frameworks and lm-evaluation-harness need ------------------------------------------------------------


def test_another_models_name_is_404(client):
  with pytest.raises(openai.NotFoundError, match="The model `gpt-4o` does not exist"):
    client.completions.create(model="gpt-4o", prompt="hi", max_tokens=2)


def test_completions_default_to_16_tokens(client):
  c = client.completions.create(model=MODEL, prompt="hi", extra_body={"ignore_eos": True}).choices[0]
  assert len(c.token_ids) == 16 and c.finish_reason == "length"


def test_several_prompts_answer_in_prompt_order(client, model, tok):
  prompts = ["What is 12 + 34?", "Please reason", "Question: how many"]
  r = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=6, temperature=0.9, seed=5,
                                extra_body={"ignore_eos": True})
  want = generate(model, [tok.encode(p) for p in prompts], max_new_tokens=6, temperature=0.9, n=2, seed=5)
  assert [c.index for c in r.choices] == list(range(6))
  assert [c.token_ids for c in r.choices] == [a.tokens.tolist() for group in want for a in group]
  assert r.usage.prompt_tokens == sum(len(tok.encode(p)) for p in prompts) and r.usage.completion_tokens == 36


def full_logprobs(model, ids):
  """log_softmax rows of one uncached forward over `ids`: row p - 1 is about token p."""
  logits = jax.jit(lambda t: model(t))(jnp.asarray([ids + [0] * (MAX_SEQ_LEN - len(ids))], jnp.int32))[0]
  return np.asarray(jax.nn.log_softmax(logits[:len(ids) - 1].astype(jnp.float32), axis=-1))


def test_echo_and_top_alternatives_match_the_full_forward(client, model, tok):
  prompt = "Question: how many apples"
  r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=5, echo=True)
  [c] = r.choices
  ids = tok.encode(prompt) + c.token_ids
  rows = full_logprobs(model, ids)
  lp = c.logprobs
  assert c.text == prompt + tok.decode(c.token_ids) and lp.tokens == [tok.decode([t]) for t in ids]
  assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
  np.testing.assert_allclose(lp.token_logprobs[1:], rows[np.arange(len(ids) - 1), ids[1:]], atol=1e-4)
  for row, top in zip(rows, lp.top_logprobs[1:]):
    best = np.argsort(-row)[:5]
    want = {}
    for t in best:
      want.setdefault(tok.decode([int(t)]), row[t])
    assert list(top) == list(want)
    np.testing.assert_allclose(list(top.values()), list(want.values()), atol=1e-4)
  # Chat: top alternatives under the request's temperature, as the sampled token's logprob.
  messages = [{"role": "user", "content": "What is 7 * 8?"}]
  r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0.7, seed=1,
                                     logprobs=True, top_logprobs=3)
  [c] = r.choices
  ids = tok.encode(tok.apply_chat_template(messages)) + c.token_ids
  n = len(ids) - len(c.token_ids)
  logits = jax.jit(lambda t: model(t))(jnp.asarray([ids + [0] * (MAX_SEQ_LEN - len(ids))], jnp.int32))[0]
  rows = np.asarray(jax.nn.log_softmax(logits[n - 1:len(ids) - 1] / 0.7, axis=-1))
  for entry, row in zip(c.logprobs.content, rows):
    assert [a.model_extra["token_id"] for a in entry.top_logprobs] == np.argsort(-row)[:3].tolist()
    np.testing.assert_allclose([a.logprob for a in entry.top_logprobs], np.sort(row)[::-1][:3], atol=1e-4)
    np.testing.assert_allclose(entry.logprob, row[entry.model_extra["token_id"]], atol=1e-4)


def test_streamed_answers_equal_unstreamed_ones(client):
  kw = dict(model=MODEL, prompt=["Question: how many", "What is"], n=2, max_tokens=20, temperature=0.8, seed=3,
            extra_body={"ignore_eos": True})
  whole = client.completions.create(**kw)
  texts, ids, finish, usage = collections.defaultdict(str), collections.defaultdict(list), {}, None
  for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
    for c in chunk.choices:
      texts[c.index] += c.text
      ids[c.index] += c.token_ids
      if c.finish_reason:
        finish[c.index] = c.finish_reason
    usage = chunk.usage or usage
  assert [texts[i] for i in range(4)] == [c.text for c in whole.choices]
  assert [ids[i] for i in range(4)] == [c.token_ids for c in whole.choices]
  assert finish == {i: "length" for i in range(4)} and usage.completion_tokens == 80
  # Chat, cut by a stop string drawn mid-answer: the streamed text stops before it, as unstreamed.
  messages = [{"role": "user", "content": "Please reason step by step"}]
  kw = dict(model=MODEL, messages=messages, max_tokens=30, temperature=0, extra_body={"ignore_eos": True})
  full = client.chat.completions.create(**kw).choices[0]
  stop = tok_text = full.message.content[8:10]
  assert tok_text
  cut = client.chat.completions.create(stop=[stop], **kw).choices[0]
  chunks = list(client.chat.completions.create(stop=[stop], stream=True, logprobs=True, **kw))
  assert chunks[0].choices[0].delta.role == "assistant"
  assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == cut.message.content
  assert sum((ch.choices[0].model_extra["token_ids"] or [] for ch in chunks[1:]), []) == cut.token_ids
  assert [e.token for ch in chunks[1:] for e in ch.choices[0].logprobs.content] == [
      e.token for e in client.chat.completions.create(stop=[stop], logprobs=True, **kw).choices[0].logprobs.content]
  assert chunks[-1].choices[0].finish_reason == "stop"


def test_tools_render_as_transformers_renders_them(client, hf_dir, tok):
  import transformers  # pylint: disable=g-import-not-at-top

  history = [{"role": "user", "content": "What is 12 + 34?"},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 12, "b": 34}'}}]},
             {"role": "tool", "tool_call_id": "call_1", "content": "46"}]
  r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=2)
  reference = transformers.AutoTokenizer.from_pretrained(hf_dir)
  calls_as_objects = [history[0], {**history[1], "tool_calls": [
      {**history[1]["tool_calls"][0], "function": {"name": "add", "arguments": {"a": 12, "b": 34}}}]}, history[2]]
  want = reference.apply_chat_template(calls_as_objects, tools=TOOLS, add_generation_prompt=True, tokenize=False)
  assert r.usage.prompt_tokens == len(tok.encode(want))  # (transformers 5 splits digits its own way: Qwen2Tokenizer)
  assert '"arguments": {"a": 12, "b": 34}' in want and "<tool_response>46</tool_response>" in want


def test_a_tool_call_comes_back_as_tool_calls(server, client, model, tok):
  messages = [{"role": "user", "content": "What is 12 + 34?"}]
  prompt = tok.encode(tok.apply_chat_template(messages, tools=TOOLS))
  call = '<tool_call>{"name": "add", "arguments": {"a": 12, "b": 34}}</tool_call>'
  scripted = memorize(model, [(prompt, tok.encode(call) + [tok.eos_id])])
  sampler, old = server.sampler, server.sampler.version
  before = sampler.scheduler.params
  sampler.update_params(sampler.scheduler.engine.load_params(nnx.state(scripted, nnx.Param)), version=old + 1)
  try:
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=60)
    [c] = r.choices
    assert c.finish_reason == "tool_calls" and c.message.content is None
    [got] = c.message.tool_calls
    assert got.type == "function" and got.function.name == "add" and got.id.startswith("call_")
    assert json.loads(got.function.arguments) == {"a": 12, "b": 34}
    assert tok.decode(c.token_ids) == call  # the answer as drawn, EOS (a special token) decoding to ""
    # Without tools the same text is plain content; streamed, the calls come whole in the last delta.
    plain = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                           temperature=0, max_tokens=60).choices[0]
    assert plain.message.tool_calls is None and plain.finish_reason != "tool_calls"
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0,
                                                 max_tokens=60, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == ""
    [streamed] = chunks[-1].choices[0].delta.tool_calls
    assert (streamed.index, streamed.function.name, json.loads(streamed.function.arguments)) == (
        0, "add", {"a": 12, "b": 34})
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
  finally:
    sampler.update_params(before, version=old)


def test_a_burst_fills_the_free_slots_then_the_queue(server):
  sampler = server.sampler
  long = SamplingParams(max_new_tokens=120, ignore_eos=True)
  sampler.max_queue = 2
  accepted, rejected = [], 0
  try:
    for i in range(10):  # an idle server with 4 free slots: 4 + max_queue accepted, whenever the slots are handed out
      try:
        accepted += sampler.submit_many([Request(group_id=i, prompt_ids=[5, 6, 7], sampling=long)])
      except QueueFull:
        rejected += 1
    assert (len(accepted), rejected) == (6, 4)
  finally:
    sampler.max_queue = 64
    for f in accepted:
      f.result(timeout=120)


@pytest.mark.slow
def test_lm_evaluation_harness_scores_and_generates_through_the_server(server, model, hf_dir):
  """lm-evaluation-harness's own `local-completions` client: loglikelihood (echo + logprobs + top alternatives, what
  multiple-choice tasks score with) equals the full forward's, and generate_until equals greedy decoding."""
  from lm_eval.api.instance import Instance  # pylint: disable=g-import-not-at-top
  from lm_eval.models.openai_completions import LocalCompletionsAPI  # pylint: disable=g-import-not-at-top

  lm = LocalCompletionsAPI(base_url=f"{server.url}/v1/completions", model=MODEL, tokenizer=hf_dir,
                           tokenizer_backend="huggingface", max_length=MAX_SEQ_LEN, batch_size=2, max_retries=1)
  pairs = [("What is 12 + 34? The answer is", " 46."), ("Question: how many apples", " are left?"),
           ("Please reason", " step by step")]
  got = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)],
                         disable_tqdm=True)
  for (context, continuation), (logprob, greedy) in zip(pairs, got):
    ctx, cont = lm.tok_encode(context), lm.tok_encode(continuation)
    rows = full_logprobs(model, ctx + cont)[len(ctx) - 1:]
    np.testing.assert_allclose(logprob, rows[np.arange(len(cont)), cont].sum(), atol=1e-3)
    assert greedy == bool((rows.argmax(-1) == cont).all())
  [text] = lm.generate_until([Instance("generate_until", {}, ("Question: how many", {"until": ["\n\n"],
                                                                                     "max_gen_toks": 12}), 0)],
                             disable_tqdm=True)
  ids = lm.tok_encode("Question: how many")
  want = generate(model, [ids], max_new_tokens=12, temperature=0.0, eos_ids=sorted(server.sampler.scheduler.eos_ids))
  assert text == load_tokenizer(hf_dir).decode(want[0][0].tokens).split("\n\n")[0]


@pytest.mark.parametrize("text,content,calls", [
    ('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>', None, [("add", {"a": 1})]),
    ('Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>{"name": "mul", '
     '"arguments": "{\\"b\\": 2}"}</tool_call>', "Let me add.\n", [("add", {"a": 1}), ("mul", {"b": 2})]),
    ('<tool_call>{"name": "add", "arguments": {"a": 1}}', None, [("add", {"a": 1})]),  # cut at the cache's end
    ('<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>', "same", None),  # not JSON: plain content
    ('<tool_call>["add"]</tool_call>', "same", None),  # no name: plain content
    ("no call here", "same", None),
])
def test_malformed_tool_calls_stay_content(text, content, calls):
  from areal_jax.serve import tool_calls  # pylint: disable=g-import-not-at-top

  got_content, got_calls = tool_calls.parse(text)
  assert got_content == (text if content == "same" else content)
  assert got_calls is None if calls is None else [
      (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got_calls] == calls


def test_api_key_is_required_of_every_route_but_health(server, tok):
  import uvicorn  # pylint: disable=g-import-not-at-top

  from areal_jax.distributed.local_job import free_port_pair  # pylint: disable=g-import-not-at-top
  from areal_jax.serve.server import create_app  # pylint: disable=g-import-not-at-top

  port = free_port_pair()
  app = create_app(sampler=server.sampler, tokenizer=tok, model_name=MODEL, api_key="sk-test-key")
  keyed = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
  thread = threading.Thread(target=keyed.run, daemon=True)
  thread.start()
  try:
    wait_until(lambda: keyed.started, timeout_s=30, what="the server started")
    url = f"http://127.0.0.1:{port}"
    good = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-test-key", max_retries=0, timeout=120)
    r = good.completions.create(model=MODEL, prompt="1+1=", max_tokens=2, temperature=0)
    assert r.choices[0].text is not None
    bad = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-wrong", max_retries=0, timeout=120)
    with pytest.raises(openai.AuthenticationError) as e:
      bad.models.list()
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    with urllib.request.urlopen(f"{url}/health", timeout=30) as h:
      assert h.status == 200
    req = urllib.request.Request(f"{url}/v1/completions", data=b'{"prompt": "1"}',
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
      urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 401
  finally:
    keyed.should_exit = True
    thread.join(30)
