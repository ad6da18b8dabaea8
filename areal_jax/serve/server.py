"""The HTTP server (FastAPI on uvicorn): OpenAI-compatible routes over one shared `Sampler`.

    server = build("gs://bucket/run", port=8000)  # the latest checkpoint; see `build` for the sampler's sizing
    server.serve_forever()  # or server.start() ... server.stop() to run it in a background thread

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (see `openai_api` for the fields), `POST /v1/responses`
(`responses_api`), `POST /v1/messages` (Anthropic's, `messages_api`), `GET /v1/models`,
`GET /health`, `GET /stats` (the sampler's counters: requests accepted, rejected and finished, answers running,
requests waiting, the most answers and requests one decode call advanced, policy version).

Handlers never block the event loop on the device: tokenizing, scoring and shaping answers run in worker threads, and
a handler awaits its requests' futures, which the sampler thread resolves; a streamed request gets each decode call's
new tokens from the sampler thread through an asyncio queue. Errors are OpenAI-style bodies (`{"error": {"message",
"type", "param", "code"}}`; Anthropic's shape on `/v1/messages`): 401 without the server's API key when it has one
(every route but `/health`; clients send it as `Authorization: Bearer KEY`, as OpenAI's do, or `x-api-key`), 400
for malformed JSON, wrong types and values the server cannot serve, 404 for another model's name, 429 when `max_queue`
requests wait beyond the free decode slots, 503 if the sampler thread has stopped (in a stream: an error event, then
the stream ends). A refused request changes nothing; the next one is served.

`create_app` registers the routes in groups (`_completion_routes`, `_agent_api_routes`, `_info_routes`); the
generating routes share a `_Generation` (the sampler, tokenizer and model name, and a request's way through them).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import hmac
import logging
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Protocol

import fastapi
import fastapi.exceptions
import jax
import uvicorn
from fastapi.responses import JSONResponse, StreamingResponse

from areal_jax.sampler.config import SamplerConfig
from areal_jax.sampler.engine import Engine
from areal_jax.sampler.requests import Request
from areal_jax.sampler import scoring
from areal_jax.sampler.sampler import QueueFull, Sampler
from areal_jax.serve import messages_api, openai_api, policy, responses_api, streaming
from areal_jax.sharding import make_mesh
from areal_jax.tokenizer import Tokenizer, load_tokenizer

_log = logging.getLogger(__name__)


def _validation_error(exc: fastapi.exceptions.RequestValidationError) -> openai_api.ApiError:
  """One message for pydantic's list of errors: malformed JSON, or the fields of the wrong type or missing."""
  errors = exc.errors()
  if errors and errors[0].get("type") == "json_invalid":
    why = errors[0].get("ctx", {}).get("error", "")
    return openai_api.ApiError(400, f"malformed JSON body: {why} (at character {errors[0]['loc'][-1]})")
  parts, param = [], None
  for e in errors:
    loc = ".".join(str(x) for x in e.get("loc", ())[1:]) or "body"
    param = param or loc
    got = f" (got {e['input']!r:.80})" if "input" in e and e.get("type") != "missing" else ""
    parts.append(f"{loc}: {e.get('msg')}{got}")
  return openai_api.ApiError(400, "; ".join(parts) or "invalid request body", param=param)


class Sampling(Protocol):
  """What the routes need from the sampler side: a `sampler.Sampler` when serving, `agents.RolloutSampling` in
  training."""

  error: BaseException | None

  @property
  def version(self) -> int: ...

  @property
  def limits(self) -> dict[str, int]: ...

  def submit_many(self, requests: list[Request], on_tokens=None) -> list[concurrent.futures.Future]: ...

  def score(self, token_ids: list[int], temperature: float) -> scoring.Scores: ...

  def stats(self) -> dict[str, int | float]: ...


class Episodes(Protocol):
  """Hooks for requests tagged with an episode (header `EPISODE_HEADER`): agents' requests in training."""

  def prepare(self, episode: str, prepared: openai_api.Prepared) -> openai_api.Prepared:
    """The requests to run for this episode (may raise `ApiError`, e.g. past `agent.max_turns`)."""

  def record(self, episode: str, prepared: openai_api.Prepared, answers: list[list], response_id: str) -> None:
    """Every answer as the sampler drew it, after the response is built."""


EPISODE_HEADER = "x-areal-episode"


def create_app(*, sampler: Sampling, tokenizer: Tokenizer, model_name: str, episodes: Episodes | None = None,
               any_model: bool = False, api_key: str | None = None,
               responses: responses_api.ResponseStore | None = None) -> fastapi.FastAPI:
  """The routes over `sampler` (which the caller starts and stops); `episodes` records agents' completions;
  `any_model` serves requests naming any model (in training, whatever name an agent was written with); `api_key`:
  the key every request but `/health` must carry; `responses`: where the Responses API keeps the responses it made
  (default: the newest 4096, for an hour)."""
  app = fastapi.FastAPI(title="areal_jax policy server")
  if api_key:
    _require_api_key(app, api_key)
  _openai_errors(app)
  generation = _Generation(sampler=sampler, tokenizer=tokenizer, model_name=model_name, episodes=episodes,
                           any_model=any_model)
  _completion_routes(app, generation)
  _agent_api_routes(app, generation, responses or responses_api.ResponseStore())
  _info_routes(app, sampler, model_name=model_name, max_model_len=generation.limits["max_seq_len"])
  return app


class _Generation:
  """What the completion routes share: a request's way from its body to the sampler's answers and back."""

  def __init__(self, *, sampler: Sampling, tokenizer: Tokenizer, model_name: str, episodes: Episodes | None,
               any_model: bool):
    self.sampler, self.tokenizer, self.model_name = sampler, tokenizer, model_name
    self.episodes, self.any_model = episodes, any_model
    self.limits = sampler.limits

  def submit(self, prepared: openai_api.Prepared, on_tokens=None):
    """The prepared requests' futures; the sampler's refusals as OpenAI errors (429, 400, 503)."""
    try:
      return self.sampler.submit_many(prepared.requests, on_tokens=on_tokens)
    except QueueFull as e:
      raise openai_api.ApiError(429, str(e), kind="rate_limit_error") from None
    except ValueError as e:  # what the scheduler itself refuses
      raise openai_api.ApiError(400, str(e)) from None
    except RuntimeError as e:
      raise openai_api.ApiError(503, f"{e}: {self.sampler.error!r}", kind="server_error") from None

  def failed(self, e: BaseException) -> openai_api.ApiError:
    return openai_api.ApiError(503, f"the request failed: {e!r} (sampler error: {self.sampler.error!r})",
                               kind="server_error")

  def _check(self, body, episode: str | None) -> None:
    """404 for another model's name (unless `any_model`), 400 for an episode where none is recorded."""
    if not self.any_model and body.model is not None and body.model != self.model_name:
      raise openai_api.ApiError(404, f"The model `{body.model}` does not exist; this server serves "
                                f"`{self.model_name}`", param="model", code="model_not_found")
    if episode is not None and self.episodes is None:
      raise openai_api.ApiError(400, f"{EPISODE_HEADER}: this server records no episodes", param=EPISODE_HEADER)

  def _prepare(self, body, to_prompts: Callable, episode: str | None) -> openai_api.Prepared:
    """Tokenizes and checks `body` (in a worker thread): the requests to submit."""
    prepared = openai_api.prepare(body, to_prompts(body, self.tokenizer), tokenizer=self.tokenizer, **self.limits)
    return prepared if episode is None else self.episodes.prepare(episode, prepared)

  async def generate(self, body, to_prompts: Callable, respond: Callable, episode: str | None,
                     events: Callable | None = None):
    """One request: `to_prompts` reads its prompts, `respond` shapes the answers, or `events(prepared, version)`
    streams them (default: OpenAI's chunks). `body` is a completions or chat body (the other APIs' are translated
    into chat bodies first)."""
    self._check(body, episode)
    prepared = await asyncio.to_thread(self._prepare, body, to_prompts, episode)
    if prepared.stream:
      events = events or functools.partial(streaming.ChunkEvents, chat=isinstance(body, openai_api.ChatRequest),
                                           tokenizer=self.tokenizer, model=self.model_name)
      return _stream(prepared, events(prepared, version=self.sampler.version), episode=episode, submit=self.submit,
                     failed=self.failed, episodes=self.episodes, tokenizer=self.tokenizer)
    futures = self.submit(prepared)
    try:
      seqs = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
    except Exception as e:  # pylint: disable=broad-except  # the sampler thread stopped (on an error, or shutting down)
      raise self.failed(e) from None
    scored = functools.partial(self.sampler.score, temperature=prepared.temperature)
    response = await asyncio.to_thread(respond, prepared, seqs, tokenizer=self.tokenizer, model=self.model_name,
                                       score=scored)
    if episode is not None:
      self.episodes.record(episode, prepared, seqs, response["id"])
    return JSONResponse(response)  # already plain JSON types: FastAPI's encoder would only walk it again


def _completion_routes(app: fastapi.FastAPI, generation: _Generation) -> None:
  """`POST /v1/completions` and `POST /v1/chat/completions`."""

  @app.post("/v1/completions")
  async def completions(body: openai_api.CompletionRequest, request: fastapi.Request):
    return await generation.generate(body, openai_api.completion_prompts, openai_api.completion_response,
                                     request.headers.get(EPISODE_HEADER))

  @app.post("/v1/chat/completions")
  async def chat_completions(body: openai_api.ChatRequest, request: fastapi.Request):
    return await generation.generate(body, openai_api.chat_prompts, openai_api.chat_response,
                                     request.headers.get(EPISODE_HEADER))


def _agent_api_routes(app: fastapi.FastAPI, generation: _Generation, store: responses_api.ResponseStore) -> None:
  """`POST /v1/responses` (OpenAI's Responses API) and `POST /v1/messages` (Anthropic's Messages API), each
  translated into a chat request and answered in its own shape."""

  @app.post("/v1/responses")
  async def responses(body: responses_api.ResponsesRequest, request: fastapi.Request):
    episode = request.headers.get(EPISODE_HEADER)
    turn = responses_api.Turn(body, store, owner=episode)
    events = functools.partial(responses_api.ResponseEvents, turn, tokenizer=generation.tokenizer,
                               model=generation.model_name)
    respond = functools.partial(responses_api.respond, turn)
    return await generation.generate(turn.chat, openai_api.chat_prompts, respond, episode, events=events)

  @app.post("/v1/messages")
  async def messages(body: messages_api.MessagesRequest, request: fastapi.Request):
    events = functools.partial(messages_api.MessageEvents, tokenizer=generation.tokenizer,
                               model=generation.model_name)
    return await generation.generate(messages_api.to_chat(body), openai_api.chat_prompts, messages_api.respond,
                                     request.headers.get(EPISODE_HEADER), events=events)


def _info_routes(app: fastapi.FastAPI, sampler: Sampling, *, model_name: str, max_model_len: int) -> None:
  """`GET /v1/models`, `GET /health` and `GET /stats`."""
  created = int(time.time())

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                        "owned_by": "areal_jax", "max_model_len": max_model_len,
                                        "policy_version": sampler.version}]}

  @app.get("/health")
  async def health():
    if sampler.error is not None:
      raise openai_api.ApiError(503, f"the sampler thread stopped on an error: {sampler.error!r}", kind="server_error")
    return {"status": "ok", "policy_version": sampler.version}

  @app.get("/stats")
  async def stats():
    return sampler.stats()


def _error_response(request: fastapi.Request, err: openai_api.ApiError) -> JSONResponse:
  """`err` in OpenAI's shape, or in Anthropic's on the Messages API's route."""
  anthropic = request.url.path.startswith("/v1/messages")
  return JSONResponse(messages_api.error_body(err) if anthropic else err.body(), status_code=err.status)


def _openai_errors(app: fastapi.FastAPI) -> None:
  """Errors answered in the route's API's shape: ours (`ApiError`) and FastAPI's request validation (400, naming
  the field)."""

  @app.exception_handler(openai_api.ApiError)
  async def _api_error(request: fastapi.Request, exc: openai_api.ApiError):
    return _error_response(request, exc)

  @app.exception_handler(fastapi.exceptions.RequestValidationError)
  async def _invalid(request: fastapi.Request, exc: fastapi.exceptions.RequestValidationError):
    return _error_response(request, _validation_error(exc))


def _require_api_key(app: fastapi.FastAPI, api_key: str) -> None:
  """Every request but `/health` must carry `Authorization: Bearer <api_key>` (OpenAI's clients) or `x-api-key:
  <api_key>` (Anthropic's); others get 401 `invalid_api_key`."""
  bearer, bare = f"Bearer {api_key}".encode(), api_key.encode()

  @app.middleware("http")
  async def _authorize(request: fastapi.Request, call_next):
    given = request.headers.get("authorization", "").encode()
    key = request.headers.get("x-api-key", "").encode()
    ok = hmac.compare_digest(given, bearer) | hmac.compare_digest(key, bare)
    if request.url.path != "/health" and not ok:
      err = openai_api.ApiError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>` or "
                                     "`x-api-key: <key>`", code="invalid_api_key")
      return _error_response(request, err)
    return await call_next(request)


def _stream(prepared: openai_api.Prepared, events: streaming.Events, *, episode: str | None, submit: Callable,
            failed: Callable, episodes: Episodes | None, tokenizer: Tokenizer) -> StreamingResponse:
  """A streamed request: `events` of its answers' new tokens, one batch per decode call that advanced them."""
  loop, reports = asyncio.get_running_loop(), asyncio.Queue()
  futures = submit(prepared, lambda i, t: loop.call_soon_threadsafe(reports.put_nowait, (i, t)))
  for f in futures:  # a failed request ends the stream with an error event
    f.add_done_callback(lambda f: f.exception() and loop.call_soon_threadsafe(reports.put_nowait, f.exception()))
  n = prepared.n
  choices = {(i, j): streaming.ChoiceStream(tokenizer, stops=prepared.stops, tools=prepared.tools)
             for i in range(len(prepared.requests)) for j in range(n)}

  async def stream():
    for e in events.start():
      yield e
    open_choices, completion_tokens = len(choices), 0
    while open_choices:
      report = await reports.get()
      if isinstance(report, BaseException):
        for e in events.error(failed(report)):
          yield e
        return
      i, tokens = report
      delta = choices[(i, tokens.answer)].push(tokens)
      if delta is None:
        continue
      completion_tokens += len(delta.token_ids)
      open_choices -= delta.finish_reason is not None
      for e in events.delta(i * n + tokens.answer, delta):
        yield e
    for e in events.end(sum(len(r.prompt_ids) for r in prepared.requests), completion_tokens):
      yield e
    if episode is not None:  # once every answer ends (a stop string ends a choice sooner)
      episodes.record(episode, prepared, await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)),
                      events.request_id)

  return StreamingResponse(stream(), media_type="text/event-stream")


class _Interrupted(Exception):
  """SIGINT or SIGTERM, after uvicorn's graceful shutdown."""


class PolicyServer:
  """`create_app` served by uvicorn on `host:port` (port 0 = any free port; `port` then holds the one bound)."""

  def __init__(self, *, sampler: Sampler, tokenizer: Tokenizer, model_name: str, host: str = "127.0.0.1",
               port: int = 0, api_key: str | None = None):
    self.sampler, self.tokenizer, self.model_name = sampler, tokenizer, model_name
    self.app = create_app(sampler=sampler, tokenizer=tokenizer, model_name=model_name, api_key=api_key)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    self._sock = socket.socket(family, socket.SOCK_STREAM)
    self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
      self._sock.bind((host, port))
      self._sock.listen(2048)  # from now on connections wait in the backlog until uvicorn accepts them
    except OSError as e:
      self._sock.close()
      raise OSError(f"cannot listen on {host}:{port}: {e}") from None
    self.host, self.port = self._sock.getsockname()[:2]
    self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=5))
    self._thread: threading.Thread | None = None

  @property
  def url(self) -> str:
    host = f"[{self.host}]" if ":" in self.host else self.host
    return f"http://{host}:{self.port}"

  def start(self, timeout: float = 60.0) -> PolicyServer:
    """Serves from a background thread; returns once the server accepts connections."""
    self.sampler.start()
    self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, name="serve-http",
                                    daemon=True)
    self._thread.start()
    deadline = time.monotonic() + timeout
    while not self._server.started:
      if not self._thread.is_alive() or time.monotonic() > deadline:
        raise RuntimeError(f"the HTTP server on {self.url} did not start")
      time.sleep(0.01)
    return self

  def stop(self) -> None:
    self._server.should_exit = True
    if self._thread is not None:
      self._thread.join(30)
    self._stop_sampler()
    self._sock.close()

  def _stop_sampler(self) -> None:
    """Requests still open fail with "shutting down"; a sampler that had failed is logged, not raised."""
    try:
      self.sampler.stop(error=RuntimeError("the server is shutting down"))
    except RuntimeError:
      _log.exception("the sampler had stopped on an error")

  def serve_forever(self) -> None:
    """Serves in the main thread until SIGINT or SIGTERM, then shuts down gracefully and returns."""
    def leave(signum, frame):
      del signum, frame
      raise _Interrupted

    # uvicorn shuts down on these signals, then re-raises them with the handlers it found: ours end the loop here.
    previous = {sig: signal.signal(sig, leave) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
      self.sampler.start()
      _log.info("serving %s (policy version %d) on %s/v1", self.model_name, self.sampler.version, self.url)
      self._server.run(sockets=[self._sock])
    except _Interrupted:
      _log.info("stopped")
    finally:
      for sig, handler in previous.items():
        signal.signal(sig, handler)
      self._stop_sampler()
      self._sock.close()

  def __enter__(self) -> PolicyServer:
    return self.start()

  def __exit__(self, *exc) -> None:
    self.stop()


def build(checkpoint_dir: str, *, step: str = "latest", tokenizer: str | None = None, dtype: str = "",
          model_name: str | None = None, host: str = "127.0.0.1", port: int = 8000, max_queue: int = 256,
          max_seq_len: int | None = None, num_slots: int = 64, page_size: int = 16, num_pages: int = 0,
          memory_fraction: float = 0.8, decode_steps: int = 8, tensor_parallel: int = 1,
          devices: list[jax.Device] | None = None, warmup: bool = True, api_key: str | None = None) -> PolicyServer:
  """A server for `checkpoint_dir` (see `policy.describe`), not started yet.

  Args:
    step: "latest" or a step number of a run's checkpoints.
    tokenizer: tokenizer spec (default: the run's; a HF directory's own).
    dtype: compute dtype of a model directory (default float32; a run's checkpoints keep their own).
    model_name: the id `/v1/models` lists and responses echo (default: the directory's name, `@step` for a run).
    max_queue: requests that may wait for a decode slot; more get 429.
    max_seq_len: prompt + answer tokens per sequence (default: the run's `sampler.max_seq_len`, else the model's
      context up to 4096).
    num_slots, page_size, num_pages, memory_fraction, decode_steps: the sampler (see `SamplerConfig`); num_slots is
      rounded up to a multiple of the data shards.
    tensor_parallel, devices: the sampling mesh, data x tensor over `devices` (default: all).
    warmup: compile every prefill and decode program before serving (no compile stall on a first request).
    api_key: if set, every request but `/health` must carry `Authorization: Bearer <api_key>` (else 401).
  """
  source = policy.describe(checkpoint_dir, step=step, dtype=dtype)
  tokenizer = tokenizer or source.tokenizer
  if not tokenizer:
    raise ValueError(f"{checkpoint_dir}: no run config.json beside it to take the tokenizer from; pass --tokenizer")
  tok = load_tokenizer(tokenizer)
  cfg = source.model_cfg
  if cfg.vocab_size < tok.vocab_size:
    raise ValueError(f"model vocab_size {cfg.vocab_size} < tokenizer vocab_size {tok.vocab_size} ({tokenizer})")
  mesh = make_mesh(devices or jax.devices(), {"data": -1, "tensor": tensor_parallel})
  data = mesh.shape["data"]
  seq_len = max_seq_len or source.run_sampler.get("max_seq_len") or min(cfg.max_position_embeddings, 4096)
  sampler_cfg = SamplerConfig(num_slots=-(-num_slots // data) * data, page_size=page_size, num_pages=num_pages,
                              memory_fraction=memory_fraction, max_seq_len=seq_len, max_new_tokens=seq_len,
                              decode_steps=decode_steps, vocab_limit=tok.vocab_size)
  engine = Engine(model=policy.abstract_model(cfg), config=sampler_cfg, mesh=mesh)
  params = policy.load_params(source, engine)
  eos_ids = sorted({tok.eos_id, *source.eos_ids})
  sampler = Sampler(engine=engine, params=params, version=source.version, eos_ids=eos_ids, max_queue=max_queue,
                    warmup=warmup, name="serve-sampler")
  return PolicyServer(sampler=sampler, tokenizer=tok, model_name=model_name or source.name, host=host, port=port,
                      api_key=api_key)
