"""The OpenAI-compatible server, driven by the real `openai` client over localhost.

One server for the module, in this process (uvicorn on a thread, on a free port), serving the embedded pair
with 8 rows, so that 32 clients make requests join and leave rows mid-run. Every answer (greedy, or sampled
with a seed) is compared with `generate` on its prompt alone; the load test reports aggregate tok/s and TTFT (docs/serving.md).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import http.client
import json
import socket
import threading
import time

import pytest

pytest.importorskip("starlette")
pytest.importorskip("prometheus_client")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

import jax  # noqa: E402
from starlette.requests import Request  # noqa: E402

from dsparkjax import chat  # noqa: E402
from dsparkjax.decoding.generate import Result, generate  # noqa: E402
from dsparkjax.decoding.proposer import load_drafter  # noqa: E402
from dsparkjax.decoding.sampling import SamplingParams  # noqa: E402
from dsparkjax.embedded import embedded_pair  # noqa: E402
from dsparkjax.errors import ArgumentError  # noqa: E402
from dsparkjax.serve import EMBEDDED_MODEL  # noqa: E402
from dsparkjax.serve.app import build_app, read_body  # noqa: E402
from dsparkjax.serve.metrics import Metrics  # noqa: E402
from dsparkjax.serve.protocol import MAX_BODY_BYTES, GenerationRequest, RequestError, SamplingFields  # noqa: E402
from dsparkjax.serve.sampling import admission_options  # noqa: E402
from dsparkjax.serve.scheduler import Job, QueueFull, Scheduler, serving_engine  # noqa: E402
from dsparkjax.serve.text import TextStream  # noqa: E402
from dsparkjax.target_api import load_target  # noqa: E402
from dsparkjax.testing import serve_load  # noqa: E402

ROWS, CONTEXT = 8, 128
LONGEST = 64  # offline references generate this many tokens once per prompt and are cut to each request's

PROMPTS = serve_load.PROMPTS

_compiles: dict[str, int] = {}  # thread name -> XLA compilations, counted from the module's start


def _count_compiles(event: str, duration: float, **kwargs) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        name = threading.current_thread().name
        _compiles[name] = _compiles.get(name, 0) + 1


class _Served:
    """The module's server: its address and the objects behind it."""

    def __init__(self):
        target_path, draft_path = embedded_pair()
        self.target = load_target(target_path)
        self.drafter = load_drafter(draft_path, self.target)
        self.tokenizer = self.target.tokenizer
        self.metrics = Metrics()
        engine = serving_engine(self.target, self.drafter, max_batch=ROWS, max_context=CONTEXT)
        self.scheduler = Scheduler(engine, self.metrics, max_queue=32)
        app = build_app(self.scheduler, self.tokenizer, EMBEDDED_MODEL, frozenset({self.target.config.eos_token_id}))
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.05)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key="unused", max_retries=0)

    def raw(self, method: str, path: str, body: bytes | None = None) -> tuple[int, dict]:
        """An HTTP request outside the openai client (for bodies it would never send): (status, JSON body)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        status, data = response.status, response.read()
        conn.close()
        return status, json.loads(data) if data.startswith((b"{", b"[")) else {"text": data.decode()}

    def send(self, head: bytes, body: bytes = b"") -> tuple[int, dict]:
        """POST /v1/completions with the header lines `head` (for framing no client sends): (status, JSON body)."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=60) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + head
                         + b"\r\n" + body)
            response = http.client.HTTPResponse(sock)
            response.begin()
            return response.status, json.loads(response.read())

    def metric(self, name: str) -> float:
        """The sum of a metric's samples whose name and labels start with `name` (Prometheus text format)."""
        _, body = self.raw("GET", "/metrics")
        return sum(float(line.rsplit(" ", 1)[1]) for line in body["text"].splitlines() if line.startswith(name))

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    # -- offline references -------------------------------------------------------------------------------

    def chat_ids(self, content: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(chat.render_chat([{"role": "user", "content": content}])))

    def text_ids(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(text, add_bos=True))

    @functools.lru_cache(maxsize=None)
    def alone(self, ids: tuple[int, ...], new_tokens: int, sampling: tuple[float, float, int] | None) -> Result:
        if sampling is None:
            return generate(self.target, [list(ids)], drafter=self.drafter, max_new_tokens=new_tokens)[0]
        # Plain sampling (exact speculative sampling equals it): two programs to compile, not every width's.
        temperature, top_p, seed = sampling
        return generate(self.target, [list(ids)], drafter=self.drafter, mode="ar", max_new_tokens=new_tokens,
                        temperature=temperature, top_p=top_p, seed=seed)[0]

    def expected(self, ids: tuple[int, ...], max_tokens: int, offline: int = LONGEST,
                 sampling: tuple[float, float, int] | None = None) -> tuple[str, str, int]:
        """(text, finish reason, completion tokens) of `generate` on `ids` alone (greedy, or plain sampling with
        (temperature, top_p, seed)), stopped at `max_tokens`: cut from one offline run of `offline` tokens per
        prompt (runs whose prompt and `offline` round to the same state size share compiled programs)."""
        assert max_tokens <= offline
        tokens = self.alone(ids, offline, sampling).token_ids[:max_tokens]
        eos = self.target.config.eos_token_id
        if eos in tokens:
            tokens = tokens[: tokens.index(eos) + 1]
            return self.tokenizer.decode(tokens[:-1], skip_special=True), "stop", len(tokens)
        return self.tokenizer.decode(tokens, skip_special=True), "length", len(tokens)


@pytest.fixture(scope="module")
def served():
    jax.monitoring.register_event_duration_secs_listener(_count_compiles)
    _compiles.clear()
    s = _Served()
    yield s
    s.stop()
    jax.monitoring.unregister_event_duration_listener(_count_compiles)


# -- requests and answers --------------------------------------------------------------------------------------


def test_streamed_chat_completion_equals_generate_alone(served):
    stream = served.client().chat.completions.create(
        model=EMBEDDED_MODEL, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=40, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    text, finish, count = served.expected(served.chat_ids(PROMPTS[0]), 40)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [finish]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == count
    assert chunks[-1].usage.prompt_tokens == len(served.chat_ids(PROMPTS[0]))
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")


@pytest.mark.parametrize("as_ids", [False, True])
def test_completion_equals_generate_alone(served, as_ids):
    ids = served.text_ids(PROMPTS[1])
    answer = served.client().completions.create(model=EMBEDDED_MODEL, prompt=list(ids) if as_ids else PROMPTS[1],
                                                max_tokens=33)
    text, finish, count = served.expected(ids, 33)
    assert (answer.choices[0].text, answer.choices[0].finish_reason) == (text, finish)
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (len(ids), count)


def test_non_streamed_chat_completion(served):
    answer = served.client().chat.completions.create(
        model=EMBEDDED_MODEL, messages=[{"role": "system", "content": "Write Python."},
                                        {"role": "user", "content": [{"type": "text", "text": PROMPTS[2]}]}],
        max_completion_tokens=20)
    ids = tuple(served.tokenizer.encode(chat.render_chat([{"role": "system", "content": "Write Python."},
                                                          {"role": "user", "content": PROMPTS[2]}])))
    text, finish, count = served.expected(ids, 20)
    assert (answer.choices[0].message.content, answer.choices[0].finish_reason) == (text, finish)
    assert answer.usage.completion_tokens == count


def test_sampled_requests_with_seeds_equal_generate_alone(served):
    """Sampled requests running together (and beside a greedy one) each give the text plain sampling gives
    their prompt alone with the same temperature, top_p and seed: the engine samples per row, and its exact
    speculative sampling equals plain sampling."""
    asks = [(PROMPTS[4], 0.7, 1.0, 11), (PROMPTS[5], 1.0, 0.9, 12), (PROMPTS[4], 0.7, 1.0, 13), (PROMPTS[6], 0.0, 1.0, 0)]

    def ask(prompt: str, temperature: float, top_p: float, seed: int) -> str:
        answer = served.client().completions.create(model=EMBEDDED_MODEL, prompt=prompt, max_tokens=24,
                                                    temperature=temperature, top_p=top_p, seed=seed)
        return answer.choices[0].text

    with concurrent.futures.ThreadPoolExecutor(len(asks)) as pool:
        texts = list(pool.map(lambda a: ask(*a), asks))
    for (prompt, temperature, top_p, seed), text in zip(asks, texts):
        sampling = (temperature, top_p, seed) if temperature > 0 else None
        assert text == served.expected(served.text_ids(prompt), 24, sampling=sampling)[0]
    assert texts[0] != texts[2]  # another seed, another sample of the same prompt


def test_top_k_and_min_p_reach_the_engine(served):
    """vLLM's top_k and min_p (were ignored as unknown fields): keeping only the most probable token makes a hot
    sampled request greedy; top_k -1 is off, as in vLLM."""
    def ask(**filters) -> str:
        return served.client().completions.create(model=EMBEDDED_MODEL, prompt=PROMPTS[1], max_tokens=24,
                                                  temperature=2.0, seed=5, extra_body=filters).choices[0].text

    greedy, hot = served.expected(served.text_ids(PROMPTS[1]), 24)[0], ask()
    assert hot != greedy
    assert ask(top_k=1) == greedy and ask(min_p=1.0) == greedy and ask(top_k=-1) == hot


@pytest.mark.parametrize("kind, stream", [("completion", True), ("chat", False)])
def test_logprobs_are_the_engines_bits(served, kind, stream):
    """Each generated token's logprob (OpenAI's chat and completions shapes, streamed or whole) is the one
    `generate` reports for its prompt alone, bit for bit: exact mode's logprobs do not depend on the batch."""
    content = PROMPTS[2]
    ids = served.chat_ids(content) if kind == "chat" else served.text_ids(content)
    want = served.alone(ids, LONGEST, None)
    text, _, count = served.expected(ids, 20)
    eos = served.target.config.eos_token_id
    tokens = [t for t in want.token_ids[:count] if t != eos]
    if kind == "chat":
        answer = served.client().chat.completions.create(model=EMBEDDED_MODEL, max_tokens=20, logprobs=True,
                                                         messages=[{"role": "user", "content": content}])
        entries = answer.choices[0].logprobs.content
        got = [e.logprob for e in entries]
        assert b"".join(bytes(e.bytes) for e in entries) == b"".join(served.tokenizer.token_bytes(t) for t in tokens)
    else:
        chunks = list(served.client().completions.create(model=EMBEDDED_MODEL, prompt=content, max_tokens=20,
                                                         logprobs=0, stream=stream))
        parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
        got = [lp for p in parts for lp in p.token_logprobs]
        offsets = [o for p in parts for o in p.text_offset]
        pieces = [t for p in parts for t in p.tokens]
        assert offsets == [sum(map(len, pieces[:i])) for i in range(len(pieces))]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert got == want.logprobs[: len(tokens)]


def test_a_sampled_request_without_a_seed_gets_a_fresh_one():
    fields = SamplingFields(temperature=0.7, top_p=0.9)
    first, second = admission_options(fields), admission_options(fields)
    assert first["sampling"] == SamplingParams(temperature=0.7, top_p=0.9)
    assert first["seed"] != second["seed"] and all(0 <= o["seed"] < 2**32 for o in (first, second))
    assert admission_options(SamplingFields(temperature=0.7, seed=5))["seed"] == 5
    assert admission_options(SamplingFields(temperature=0.0, seed=5)) == {}


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_ends_the_text_before_it(served, stream):
    ids = served.text_ids(PROMPTS[3])
    full, _, _ = served.expected(ids, 48)
    stop = full[12:15]  # a piece of the answer, which may span tokens
    assert len(stop) == 3
    answer = served.client().completions.create(model=EMBEDDED_MODEL, prompt=PROMPTS[3], max_tokens=48,
                                                stop=[stop, "never appears \x00"], stream=stream)
    chunks = list(answer) if stream else [answer]
    assert "".join(c.choices[0].text for c in chunks) == full[: full.find(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_text_stream_holds_back_what_may_start_a_stop_string(served):
    tok = served.tokenizer
    ids = tok.encode("value = compute(alpha, beta)\nreturn value\n")
    stream = TextStream(tok, ("a, b", "zzz"))
    sent = [stream.push(t) for t in ids]
    assert "".join(sent) == "value = compute(alph" and stream.stopped
    assert stream.push(ids[0]) == "" and stream.flush() == ""
    plain = TextStream(tok, ("zzz",))
    assert "".join(plain.push(t) for t in ids) + plain.flush() == tok.decode(ids)


def test_a_prompt_at_the_edge_of_the_context(served):
    """A prompt and max_tokens that fill the context up to the room a decode step needs run to their end."""
    room = 24
    ids = served.text_ids("".join(PROMPTS) * 8)[: served.scheduler.context - 2 * 16 - room]
    assert served.scheduler.room(len(ids)) == room
    answer = served.client().completions.create(model=EMBEDDED_MODEL, prompt=list(ids), max_tokens=room)
    text, finish, count = served.expected(ids, room, offline=room)
    assert (answer.choices[0].text, answer.choices[0].finish_reason, answer.usage.completion_tokens) == (
        text, finish, count)


def test_models_health_and_metrics(served):
    assert [m.id for m in served.client().models.list()] == [EMBEDDED_MODEL]
    status, health = served.raw("GET", "/health")
    assert status == 200 and health["status"] == "ok" and health["rows"] == ROWS
    served.client().completions.create(model=EMBEDDED_MODEL, prompt=PROMPTS[4], max_tokens=8)
    _, body = served.raw("GET", "/metrics")
    for name in ("dsparkjax_requests_total", "dsparkjax_queue_depth", "dsparkjax_tokens_per_second",
                 "dsparkjax_draft_matched_total", "dsparkjax_draft_offered_total", "dsparkjax_draft_acceptance"):
        assert f"\n{name}" in body["text"], name
    assert served.metric('dsparkjax_requests_total{endpoint="/v1/completions",outcome="finished"}') >= 1
    assert served.metric("dsparkjax_tokens_per_second") > 0
    assert served.metric("dsparkjax_draft_offered_total") > 0


# -- robustness -------------------------------------------------------------------------------------------------


def _body(**fields) -> bytes:
    return json.dumps({"model": EMBEDDED_MODEL, "prompt": "def f(", **fields}).encode()


BAD_REQUESTS = [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (json.dumps({"prompt": "x"}).encode(), 400, "model"),
    (_body(model="gpt-4"), 404, "model"),
    (_body(prompt=3), 400, "prompt"),
    (_body(prompt=""), 400, "prompt"),
    (_body(prompt=[1, 99999]), 400, "prompt"),
    (_body(prompt="x" * 2000), 400, "prompt"),  # beyond the 128-position context
    (_body(max_tokens="12"), 400, "max_tokens"),
    (_body(max_tokens=0), 400, "max_tokens"),
    (_body(max_tokens=CONTEXT), 400, "max_tokens"),
    (_body(temperature=-1), 400, "temperature"),
    (_body(temperature=2.5), 400, "temperature"),
    (_body(temperature="warm"), 400, "temperature"),
    (_body(temperature=1e-300), 400, "temperature"),  # 0 in float32: was silently greedy
    (_body(top_p=0), 400, "top_p"),
    (_body(top_p="high"), 400, "top_p"),
    (_body(top_k=-2), 400, "top_k"),  # vLLM's top_k and min_p: were ignored as unknown fields
    (_body(top_k=1.5), 400, "top_k"),
    (_body(top_k=2**31), 400, "top_k"),
    (_body(min_p=-0.1), 400, "min_p"),
    (_body(min_p=1.5), 400, "min_p"),
    (_body(min_p="low"), 400, "min_p"),
    (_body(seed=1.5), 400, "seed"),
    (_body(seed=-1), 400, "seed"),
    (_body(seed=2**32), 400, "seed"),
    (_body(stop=[1]), 400, "stop"),
    (_body(stop=["a", "b", "c", "d", "e"]), 400, "stop"),
    (_body(stream="yes"), 400, "stream"),
    (_body(stream=True, stream_options={"include_usage": 1}), 400, "stream_options.include_usage"),
    (_body(n=2), 400, "n"),
    (_body(logprobs=3), 400, "logprobs"),  # the most likely alternatives are not implemented
    (_body(logprobs=6), 400, "logprobs"),
    (_body(logprobs=True), 400, "logprobs"),  # chat's boolean, on completions
    (_body(response_format={"type": "json_object"}), 400, "response_format"),  # was ignored
    (_body(tool_choice="required"), 400, "tool_choice"),
    (b"[" * 100_000 + b"]" * 100_000, 400, None),  # a RecursionError in json.loads: was a 500
    (_body(prompt="a\ud800b"), 400, "prompt"),  # a lone surrogate, valid JSON: the tokenizer's TypeError, a 500
]


@pytest.mark.parametrize("body,status,param", BAD_REQUESTS, ids=[str(i) for i in range(len(BAD_REQUESTS))])
def test_bad_requests_get_an_openai_error(served, body, status, param):
    got, answer = served.raw("POST", "/v1/completions", body)
    assert got == status
    assert answer["error"]["param"] == param and answer["error"]["message"] and answer["error"]["type"]


def test_a_body_past_the_limit_gets_413_before_it_is_read(served):
    """Any body was read whole. The limit is checked from Content-Length: this request never sends its body."""
    got, answer = served.send(b"Content-Length: %d\r\n" % (MAX_BODY_BYTES + 1))
    assert got == 413 and answer["error"]["code"] == "request_too_large"
    assert f"limit of {MAX_BODY_BYTES} bytes" in answer["error"]["message"]


def test_a_chunked_body_without_a_content_length_gets_411(served):
    """Its size is not known before it is read."""
    body = _body()
    got, answer = served.send(b"Transfer-Encoding: chunked\r\n", b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
    assert got == 411 and answer["error"]["code"] == "length_required"


@pytest.mark.parametrize("length, refusal", [
    (b"10", None), (b"11", "exceeds this server's limit of 10 bytes"), (b"-5", "Content-Length must be a decimal"),
    (b"abc", "Content-Length must be a decimal"), (b"5, 6", "Content-Length must be a decimal"),
    (b"\xb2", "Content-Length must be a decimal"),  # latin-1 "²": str.isdigit() takes it, int() does not
])
def test_the_body_limit_reads_content_length_strictly(length, refusal):
    """uvicorn answers a negative or non-numeric Content-Length itself; another ASGI server may pass it on."""
    async def receive() -> dict:
        return {"type": "http.request", "body": b"x" * 10, "more_body": False}

    http = Request({"type": "http", "headers": [(b"content-length", length)]}, receive)
    if refusal is None:
        assert asyncio.run(read_body(http, 10)) == b"x" * 10
    else:
        with pytest.raises(RequestError, match=refusal):
            asyncio.run(read_body(http, 10))


@pytest.mark.parametrize("messages", [[], [{"role": "robot", "content": "x"}], [{"role": "user", "content": 5}],
                                      "hello", [{"role": "user", "content": [{"type": "image_url"}]}],
                                      [{"role": "user", "content": "\udfff"}]])
def test_bad_chat_messages_get_400(served, messages):
    body = json.dumps({"model": EMBEDDED_MODEL, "messages": messages}).encode()
    got, answer = served.raw("POST", "/v1/chat/completions", body)
    assert got == 400 and answer["error"]["param"] == "messages"


def test_a_context_beyond_the_models_is_refused(served):
    """Rows longer than the model's context would serve positions it was never made for, silently."""
    context = served.target.config.context_length
    with pytest.raises(ArgumentError, match=f"max_context {context + 1} exceeds the context length {context} of "):
        serving_engine(served.target, None, max_batch=1, max_context=context + 1)


def test_unknown_route_gets_an_openai_error(served):
    got, answer = served.raw("GET", "/v1/engines")
    assert got == 404 and answer["error"]["message"]


def test_a_full_queue_answers_429_and_the_server_goes_on(served):
    served.scheduler.max_queue = 0  # every request finds the queue full
    try:
        got, answer = served.raw("POST", "/v1/completions", _body(max_tokens=4))
    finally:
        served.scheduler.max_queue = 32
    assert got == 429 and answer["error"]["code"] == "queue_full"
    assert served.client().completions.create(model=EMBEDDED_MODEL, prompt="x", max_tokens=4).choices[0].text


def test_submit_refuses_beyond_max_queue(served):
    """The bound counts the requests waiting for a row (a scheduler whose thread never starts keeps them)."""
    scheduler = Scheduler(served.scheduler._engine, Metrics(), max_queue=2)
    request = GenerationRequest("completion", (0, 5), 4, (), SamplingFields(), False, False)

    async def submit_three() -> None:
        jobs = [Job(request, 4, {}, served.tokenizer, frozenset()) for _ in range(3)]
        scheduler.submit(jobs[0])
        scheduler.submit(jobs[1])
        with pytest.raises(QueueFull, match="2 requests are already waiting"):
            scheduler.submit(jobs[2])
        scheduler.cancel(jobs[0])
        scheduler.submit(jobs[2])  # a cancelled request leaves the queue

    asyncio.run(submit_three())


def test_a_whole_answer_whose_client_leaves_is_cancelled(served):
    before = served.metric('dsparkjax_requests_total{endpoint="/v1/completions",outcome="cancelled"}')
    sock = socket.create_connection(("127.0.0.1", served.port))
    body = _body(prompt=PROMPTS[5])  # as many tokens as the context leaves
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    time.sleep(0.05)
    sock.close()
    deadline = time.monotonic() + 10
    while served.metric('dsparkjax_requests_total{endpoint="/v1/completions",outcome="cancelled"}') == before:
        assert time.monotonic() < deadline, "the disconnect was not noticed"
        time.sleep(0.05)
    _wait_idle(served)


def _wait_idle(served) -> None:
    deadline = time.monotonic() + 10
    while (health := served.raw("GET", "/health")[1])["running"] or health["waiting"]:
        assert time.monotonic() < deadline, f"rows still held: {health}"
        time.sleep(0.05)


# -- load -------------------------------------------------------------------------------------------------------


def test_32_streaming_clients_some_leaving(served):
    """32 concurrent streams of mixed lengths over 8 rows, every fourth leaving after its first text. Each
    finished stream equals its prompt's `generate` alone; one that left got a prefix of it and its row was
    released; nothing compiled while serving. Prints aggregate tok/s and p50/p99 time to first token."""
    specs = serve_load.mixed_clients(32, LONGEST)
    ids = [served.chat_ids(c.prompt) if c.chat else served.text_ids(c.prompt) for c in specs]
    wanted = [served.expected(i, c.max_tokens) for i, c in zip(ids, specs)]
    leaving = [w for c, w in zip(specs, wanted) if c.leave_early]
    assert all(finish == "length" for _, finish, _ in leaving)  # long answers: still running when they leave
    before = _cancelled(served)

    report = serve_load.run_load(served.base_url, EMBEDDED_MODEL, specs)
    for i, (c, got, (text, finish, count)) in enumerate(zip(specs, report.results, wanted)):
        if c.leave_early:
            assert got.text and text.startswith(got.text), i
        else:
            assert (got.text, got.finish_reason, got.completion_tokens) == (text, finish, count), i
    _wait_idle(served)
    assert _cancelled(served) - before == len(leaving)
    assert _compiles.get("dsparkjax-engine", 0) == 0 and _compiles.get("MainThread", 0) > 0
    assert served.client().completions.create(model=EMBEDDED_MODEL, prompt="x", max_tokens=4).choices[0].text
    summary = report.summary()
    print(f"\nserve load: 32 streaming clients over {ROWS} rows ({len(leaving)} leaving early): "
          f"{summary['completion_tokens']} tokens in {summary['elapsed_s']:.2f} s = {summary['tok_per_s']:.1f} tok/s "
          f"aggregate; TTFT p50 {summary['ttft_p50_ms']:.0f} ms, p99 {summary['ttft_p99_ms']:.0f} ms")


def _cancelled(served) -> float:
    return sum(served.metric(f'dsparkjax_requests_total{{endpoint="{e}",outcome="cancelled"}}')
               for e in ("/v1/chat/completions", "/v1/completions"))


def test_an_engine_failure_fails_its_requests_and_the_server_goes_on(served, monkeypatch):
    """Runs last: the scheduler replaces a failed engine by a fresh one on the same compiled programs."""
    broken = served.scheduler._engine

    def fail() -> None:
        raise RuntimeError("injected engine failure")

    monkeypatch.setattr(broken, "step", fail)
    got, answer = served.raw("POST", "/v1/completions", _body(max_tokens=8))
    assert got == 500 and answer["error"]["type"] == "server_error"
    assert served.scheduler._engine is not broken
    answer = served.client().completions.create(model=EMBEDDED_MODEL, prompt=PROMPTS[6], max_tokens=16)
    assert answer.choices[0].text == served.expected(served.text_ids(PROMPTS[6]), 16)[0]
