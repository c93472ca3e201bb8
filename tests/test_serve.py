"""`ggrun serve`: a real uvicorn server in a subprocess on SmolLM2, driven by the `openai` and
`ollama` clients and by httpx (raw SSE, disconnects, error bodies). The servers run with -t 1:
on 2 cores, a second thread of Numba's workers spinning against whatever else runs slows
decoding tens of times."""
from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from runner.serve.options import ServeOptions

from .test_chat import _harmony_reply, harmony_model  # noqa: F401 (a fixture)

openai = pytest.importorskip("openai")
ollama = pytest.importorskip("ollama")

N_CTX = 1024
SYSTEM = "You answer in one short sentence."
FRANCE = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]


class Server:
    """`ggrun serve MODEL ARGS --port 0` in a subprocess; its log in a file, its URL from the first line."""

    def __init__(self, tmp_path, model, *args):
        self.log_path = tmp_path / f"serve-{time.monotonic_ns()}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "runner", "serve", str(model), "--port", "0", "-t", "1",
                                      *map(str, args)], stdout=self._log, stderr=subprocess.STDOUT,
                                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        deadline = time.monotonic() + 60
        while not (found := re.search(r"listening on (http://\S+)", self.log())):
            self._alive_until(deadline)
            time.sleep(0.05)
        self.url = found.group(1)

    def _alive_until(self, deadline: float) -> None:
        if self.proc.poll() is None and time.monotonic() < deadline:
            return
        self.proc.kill()
        self.proc.wait()
        pytest.fail(f"the server ended or did not answer in time:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_ready(self, timeout: float = 300) -> list[httpx.Response]:
        """The /health answers until the first 200."""
        answers, deadline = [], time.monotonic() + timeout
        while not answers or answers[-1].status_code != 200:
            self._alive_until(deadline)
            answers.append(httpx.get(self.url + "/health"))
            time.sleep(0.02)
        return answers

    def stop(self, sig=signal.SIGINT) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(60)
        finally:
            self._log.close()

    def metrics(self, headers=None) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", headers=headers).text
        return {line.split()[0].removeprefix("ggrun:"): float(line.split()[1])
                for line in text.splitlines() if line.startswith("ggrun:")}

    def resident_bytes(self) -> int:
        """The server process's resident memory."""
        status = open(f"/proc/{self.proc.pid}/status").read()
        return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) << 10

    def openai(self, **kwargs):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kwargs.pop("api_key", "none"), max_retries=0,
                             **kwargs)


@pytest.fixture
def start(tmp_path):
    """Server(tmp_path, ...) for a test of its own, killed after it where it still runs."""
    started = []

    def start(model, *args) -> Server:
        started.append(Server(tmp_path, model, *args))
        return started[-1]
    yield start
    for s in started:
        if s.proc.poll() is None:
            s.proc.kill()
            s.stop()


@pytest.fixture(scope="module")
def server(smollm_path, tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("serve"), smollm_path, "-c", N_CTX, "-np", 4, "--temp", 0)
    s.wait_ready()
    yield s
    assert s.stop() == 130 and "Traceback" not in s.log()


@pytest.fixture(scope="module")
def name(server):
    return server.openai().models.list().data[0].id


def run_json(smollm_path, *args) -> dict:
    """`ggrun run`'s greedy result, the reference for the server's."""
    r = subprocess.run([sys.executable, "-m", "runner", "run", str(smollm_path), "--temp", "0", "--json", "-t", "1",
                        "-c", str(N_CTX), "--no-ring", *args], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def chat(server, name, messages, **kwargs):
    return server.openai().chat.completions.create(model=name, messages=messages, temperature=0, **kwargs)


def test_greedy_text_equals_run(server, name, smollm_path):
    """Chat (whole and streamed) and completions at temperature 0 say what `ggrun run` says."""
    question = "What is the capital of France?"
    reference = run_json(smollm_path, "-p", question, "-sys", SYSTEM, "-n", "24")
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    whole = chat(server, name, messages, max_tokens=24)
    assert whole.choices[0].message.content == reference["text"]
    assert whole.usage.prompt_tokens == reference["prompt_tokens"]
    assert whole.usage.completion_tokens == reference["generated_tokens"]
    assert whole.choices[0].finish_reason == {"eos": "stop", "length": "length"}[reference["stop_reason"]]
    chunks = list(chat(server, name, messages, max_tokens=24, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reference["text"]
    assert chunks[-1].usage.completion_tokens == reference["generated_tokens"] and not chunks[-1].choices
    assert 0 < chunks[-1].usage.prompt_tokens_details.cached_tokens < reference["prompt_tokens"]  # (the same prompt)

    prompt = "The capital of France is"
    reference = run_json(smollm_path, "-p", prompt, "-n", "12")
    done = server.openai().completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0)
    assert done.choices[0].text == reference["text"] and done.usage.prompt_tokens == reference["prompt_tokens"]
    streamed = server.openai().completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0,
                                                  stream=True)
    assert "".join(c.choices[0].text for c in streamed) == reference["text"]


def test_models_logprobs_and_stops(server, name):
    client = server.openai()
    assert [m.id for m in client.models.list().data] == [name] and client.models.retrieve(name).id == name
    messages = [{"role": "user", "content": "Name three colours."}]
    r = chat(server, name, messages, max_tokens=8, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert "".join(t.token for t in content) == r.choices[0].message.content and len(content) == 8
    for t in content:  # greedy: the chosen token is the likeliest
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob) and t.logprob <= 0
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob >= t.top_logprobs[2].logprob
    streamed = list(chat(server, name, messages, max_tokens=8, logprobs=True, stream=True))
    assert [t.token for c in streamed if c.choices and c.choices[0].logprobs
            for t in c.choices[0].logprobs.content] == [t.token for t in content]
    old = client.completions.create(model=name, prompt="One, two,", max_tokens=4, temperature=0, logprobs=2)
    lp = old.choices[0].logprobs
    assert "".join(lp.tokens) == old.choices[0].text and all(len(top) == 2 for top in lp.top_logprobs)

    # a stop string ends the reply before it, whole and streamed (where it spans tokens too)
    full = chat(server, name, FRANCE, max_tokens=24)
    text = full.choices[0].message.content
    assert "Paris" in text, text
    for stop in ("Paris", "aris", text[text.index("Paris") - 3:text.index("Paris") + 2]):
        cut = chat(server, name, FRANCE, max_tokens=24, stop=[stop, "never said"])
        assert cut.choices[0].message.content == text[:text.index(stop)] and cut.choices[0].finish_reason == "stop"
        parts = chat(server, name, FRANCE, max_tokens=24, stop=stop, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in parts) == text[:text.index(stop)]


def test_ollama_client(server, name):
    client = ollama.Client(host=server.url)
    messages = FRANCE
    whole = chat(server, name, messages, max_tokens=10)
    reference = whole.choices[0].message.content
    options = {"temperature": 0, "num_predict": 10}
    r = client.chat(model=name, messages=messages, options=options)
    assert r.message.content == reference and r.done and r.done_reason == whole.choices[0].finish_reason
    assert r.eval_count == whole.usage.completion_tokens and r.prompt_eval_count == whole.usage.prompt_tokens
    parts = list(client.chat(model=name, messages=messages, options=options, stream=True))
    assert "".join(p.message.content for p in parts) == reference and parts[-1].done and not parts[0].done
    generated = client.generate(model=name, prompt=FRANCE[1]["content"], system=FRANCE[0]["content"], options=options)
    assert generated.response == reference and generated.prompt_eval_count == r.prompt_eval_count
    raw = "".join(p.response for p in client.generate(model=name, prompt="The capital of France is", raw=True,
                                                        options={"temperature": 0, "num_predict": 4}, stream=True))
    assert "Paris" in raw
    stopped = client.chat(model=name, messages=messages, options={**options, "stop": ["Paris"]})
    assert stopped.message.content == reference[:reference.index("Paris")] and stopped.done_reason == "stop"
    assert [m.model for m in client.list().models] == [name]
    shown = client.show(name)
    assert shown.details.family == "llama" and shown.details.format == "gguf" and "<|im_start|>" in shown.template
    assert shown.modelinfo["llama.context_length"] == 8192
    assert httpx.get(server.url + "/api/version").json()["version"]
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="no-such-model", messages=messages)
    assert e.value.status_code == 404 and "no-such-model" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=name, messages=messages, format={"type": "hiccup"})
    assert e.value.status_code == 400 and "format: invalid JSON schema" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model=name, prompt="Hi", options={"temperature": "hot"})
    assert e.value.status_code == 400 and "temperature" in e.value.error


def test_tokenize_props_and_health(server):
    tokens = httpx.post(server.url + "/tokenize", json={"content": "Hello world", "with_pieces": True}).json()
    assert tokens == {"tokens": [{"id": 19556, "piece": "Hello"}, {"id": 905, "piece": " world"}]}
    assert httpx.post(server.url + "/tokenize", json={"content": "<|im_start|>"}).json() == {"tokens": [1]}
    assert httpx.post(server.url + "/detokenize", json={"tokens": [19556, 905]}).json() == {"content": "Hello world"}
    props = httpx.get(server.url + "/props").json()
    assert props["total_slots"] == 4 and props["default_generation_settings"]["n_ctx"] == N_CTX
    assert "<|im_start|>" in props["chat_template"]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def _wait_for(condition, seconds: float = 10):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def _error(r: httpx.Response, status: int, *words) -> str:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) >= {"message", "type", "code"} and error["code"] == status
    assert all(w in error["message"] for w in words), error["message"]
    return error["message"]


def test_client_mistakes_are_4xx_in_openai_shape(server, name):
    url = server.url + "/v1/chat/completions"
    hello = [{"role": "user", "content": "Hello"}]

    def post(body, path=url):
        return httpx.post(path, content=body if isinstance(body, bytes) else json.dumps(body))
    _error(post(b"{not json"), 400, "not valid JSON")
    _error(post(b"[1, 2]"), 400, "JSON object")
    _error(post({"messages": hello, "temprature": 0}), 400, "unknown field temprature")
    _error(post({"messages": hello, "temperature": "hot"}), 400, "temperature")
    _error(post({"messages": hello, "top_p": 2}), 400, "top_p")
    _error(post({"messages": hello, "max_tokens": -1}), 400, "max_tokens")
    _error(post({"messages": hello, "seed": 1.5}), 400, "seed")
    _error(post({"messages": hello, "stop": [""]}), 400, "stop")
    _error(post({"messages": hello, "n": 2}), 400, "n must be")
    _error(post({"messages": hello, "top_logprobs": 2}), 400, "logprobs")
    _error(post({"messages": "Hello"}), 400, "messages must be an array")
    _error(post({}), 400, "messages is required")
    _error(post({"messages": [{"role": "robot", "content": "Hi"}]}), 400, "role")
    _error(post({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}), 400,
           "only text")
    _error(post({"messages": hello, "response_format": {"type": "sound"}}), 400, "response_format.type")
    _error(post({"messages": hello, "chat_template_kwargs": {"messages": []}}), 400, "messages")
    too_long = post({"messages": [{"role": "user", "content": "word " * 1100}]})
    n_prompt = too_long.json()["error"]["n_prompt_tokens"]
    assert n_prompt > 1100 and too_long.json()["error"]["n_ctx"] == N_CTX
    _error(too_long, 400, f"prompt has {n_prompt} tokens", str(N_CTX))
    message = _error(post({"messages": hello, "max_tokens": 2000}), 400, "2000", str(N_CTX))
    assert re.search(r"prompt has \d+ tokens", message)
    assert post({"messages": hello, "max_tokens": 2000}).json()["error"]["type"] == "exceed_context_size_error"
    _error(post({"prompt": "x", "max_tokens": 4, "echo": 3}, server.url + "/v1/completions"), 400, "echo")
    _error(post({"prompt": {"x": 1}}, server.url + "/v1/completions"), 400, "prompt")
    _error(post({"tokens": [10**9]}, server.url + "/detokenize"), 400, "vocabulary")
    _error(post({"model": "gpt-4o", "messages": hello}), 404, "gpt-4o")
    _error(httpx.get(server.url + "/v1/models/gpt-4o"), 404, "gpt-4o")
    _error(httpx.get(server.url + "/v1/nothing"), 404, "/v1/nothing")
    _error(httpx.get(url), 405)
    with pytest.raises(openai.BadRequestError):
        chat(server, name, hello, max_tokens=N_CTX + 1)
    assert "Traceback" not in server.log() and " 500 " not in server.log()


def test_prefix_reuse(server, name):
    """A second request with the same long system prompt prefills only what follows it; a second
    turn prefills only its new tokens. What the reused prefix holds is that prompt's: the first
    token's distribution is a fresh prefill's (within the rounding of passes of other sizes)."""
    system = " ".join(f"Rule {i}: answer politely and briefly, item {i}." for i in range(40))
    n_system = len(httpx.post(server.url + "/tokenize", json={"content": system}).json()["tokens"])
    assert n_system > 400
    first = chat(server, name, [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}],
                 max_tokens=6)
    assert first.usage.prompt_tokens_details.cached_tokens < n_system  # (its system prompt was new)
    before = server.metrics()["prompt_tokens_cached_total"]
    question = [{"role": "system", "content": system}, {"role": "user", "content": "Name a fruit."}]
    second = chat(server, name, question, max_tokens=6, logprobs=True, top_logprobs=5)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= n_system and second.usage.prompt_tokens - cached < 12
    assert second.model_extra["timings"]["prompt_n"] == second.usage.prompt_tokens - cached
    assert server.metrics()["prompt_tokens_cached_total"] - before == cached
    fresh = chat(server, name, question, max_tokens=6, logprobs=True, top_logprobs=5,
                 extra_body={"cache_prompt": False})
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0
    reused_top, fresh_top = ({t.token: t.logprob for t in r.choices[0].logprobs.content[0].top_logprobs}
                             for r in (second, fresh))
    assert len(set(reused_top) & set(fresh_top)) >= 3
    assert all(abs(reused_top[t] - fresh_top[t]) < 0.5 for t in set(reused_top) & set(fresh_top))
    turn = question + [{"role": "assistant", "content": second.choices[0].message.content},
                       {"role": "user", "content": "And a vegetable?"}]
    chat(server, name, question, max_tokens=6)  # (the cache holds this question and its reply again)
    third = chat(server, name, turn, max_tokens=6)
    new_turn = third.usage.prompt_tokens - third.usage.prompt_tokens_details.cached_tokens
    assert third.usage.prompt_tokens_details.cached_tokens > second.usage.prompt_tokens and new_turn < 20


def test_disconnects_cancel_within_a_token(server, name):
    """A client that leaves a stream, or gives up on a whole reply, stops its sequence."""
    def settled(cancelled):
        _wait_for(lambda: (m := server.metrics())["requests_cancelled_total"] == cancelled
                  and m["requests_processing"] == 0 and m["requests_deferred"] == 0)
        return server.metrics()

    before = server.metrics()
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60,
                      json={"model": name, "messages": [{"role": "user", "content": "Tell me a long story."}],
                            "max_tokens": 500, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(json.loads(line[6:]))
            if len(lines) == 4:
                break
    assert lines[0]["choices"][0]["delta"]["role"] == "assistant" and lines[0]["object"] == "chat.completion.chunk"
    left = settled(before["requests_cancelled_total"] + 1)
    assert left["tokens_predicted_total"] - before["tokens_predicted_total"] < 100  # (of the 500 asked for)
    with pytest.raises(httpx.TimeoutException):  # (a whole reply whose client gives up)
        httpx.post(server.url + "/api/generate", timeout=0.5,
                   json={"model": name, "prompt": "1, 2, 3, 4, 5,", "raw": True, "stream": False,
                         "options": {"num_predict": 1000}})
    gave_up = settled(before["requests_cancelled_total"] + 2)
    assert gave_up["tokens_predicted_total"] - left["tokens_predicted_total"] < 1000
    assert server.log().count("client left") >= 2


def test_concurrent_clients(server, name):
    """16 clients send 64 requests at once: greedy ones (some streamed), some that leave in the
    middle of their stream, some malformed, some that reuse the cache. Every well-formed one is
    answered, the greedy ones with their single-request text; afterwards nothing is in flight and
    the queue is empty. (The greedy ones prefill their whole prompt, cache_prompt false: a reused
    prefix was computed in passes of other sizes, whose rounding may turn a near tie.)"""
    prompts = ["Name a colour.", "Say hello.", "What is 2 + 2?", "Name an animal."]
    fresh = {"max_tokens": 6, "temperature": 0, "cache_prompt": False}
    single = {p: chat(server, name, [{"role": "user", "content": p}], max_tokens=6,
                      extra_body={"cache_prompt": False}).choices[0].message.content for p in prompts}
    answers, failures = {}, []

    async def one(client: httpx.AsyncClient, i: int):
        body = {"model": name, "messages": [{"role": "user", "content": prompts[i % 4]}], **fresh}
        url = server.url + "/v1/chat/completions"
        if i % 8 == 7:  # malformed
            r = await client.post(url, content=b'{"messages": [' if i % 16 == 7 else json.dumps({**body, "top_k": "x"}))
            answers[i] = r.status_code
            return
        if i % 8 in (3, 5):  # streamed; one in two of them leaves after its first chunks
            streamed = {**body, "stream": True, "max_tokens": 40 if i % 8 == 5 else 6}
            async with client.stream("POST", url, json=streamed) as r:
                text = []
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        delta = json.loads(line[6:])["choices"]
                        text.append(delta[0]["delta"].get("content", "") if delta else "")
                    if i % 8 == 5 and len(text) == 3:
                        answers[i] = "left"
                        return
                answers[i] = "".join(text)
                return
        r = await client.post(url, json={**body, "cache_prompt": i % 8 != 6})
        reply = r.json()["choices"][0] if r.status_code == 200 else None
        answers[i] = (r.status_code if reply is None else "reused" if i % 8 == 6 and reply["message"]["content"]
                      and reply["finish_reason"] in ("stop", "length") else reply["message"]["content"])

    async def worker(queue: asyncio.Queue):
        async with httpx.AsyncClient(timeout=300) as client:
            while not queue.empty():
                i = queue.get_nowait()
                try:
                    await one(client, i)
                except Exception as e:  # noqa: BLE001 (reported below)
                    failures.append((i, repr(e)))

    async def storm():
        queue = asyncio.Queue()
        for i in range(64):
            queue.put_nowait(i)
        await asyncio.gather(*(worker(queue) for _ in range(16)))

    resident = []
    for _ in range(2):  # (a second round: memory stays flat)
        answers.clear()
        asyncio.run(storm())
        assert not failures and len(answers) == 64, failures
        for i, answer in answers.items():
            expected = {7: 400, 5: "left", 6: "reused"}.get(i % 8) or single[prompts[i % 4]]
            assert answer == expected, (i, answer, expected)
        _wait_for(lambda: (m := server.metrics())["requests_processing"] == 0 and m["requests_deferred"] == 0)
        m = server.metrics()
        assert m["kv_blocks_used"] == 0 and m["kv_bytes_used"] == 0  # (no sequence or block leaks)
        assert 0 < m["kv_blocks_cached"] <= m["kv_blocks_total"]
        resident.append(server.resident_bytes())
    assert resident[1] <= resident[0] * 1.05 + (16 << 20), resident
    assert "Traceback" not in server.log()


def test_loading_and_load_errors(smollm_path, start):
    """/health is 503 in OpenAI's shape until the model is loaded (in-process, with a load that
    waits), and a model that fails to load ends the server with one error line."""
    from starlette.testclient import TestClient

    from runner.engine.sampler import SamplingOptions
    from runner.serve.app import create_app
    from runner.serve.model import ModelCard
    from runner.serve.server import serving_state
    release = threading.Event()
    state = serving_state(lambda: release.wait() and None, ModelCard.of(None, smollm_path), SamplingOptions(),
                          ServeOptions(n_ctx=64))
    client = TestClient(create_app(state, lambda line: None))
    state.scheduler.start()
    _error(client.get("/health"), 503, "Loading model")
    _error(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]}), 503,
           "Loading model")
    assert client.get("/v1/models").json()["data"][0]["id"] == smollm_path.name
    release.set()

    from runner.engine.backend import resolve_device
    if resolve_device("auto") == "cuda":
        pytest.skip("CUDA is here: -ngl 99 would load")
    s = start(smollm_path, "-ngl", "99")
    assert s.proc.wait(120) == 1
    assert "error:" in s.log() and "CUDA" in s.log() and "Traceback" not in s.log()


def test_a_kv_pool_larger_than_memory_is_refused(smollm_path, start):
    """--kv-size is checked against free memory before the pool is allocated: one error line."""
    s = start(smollm_path, "--kv-size", "99999999999999")
    assert s.proc.wait(120) == 1
    assert "error:" in s.log() and "KV cache" in s.log() and "Traceback" not in s.log()


def test_api_key_full_queue_and_sigterm(smollm_path, start):
    s = start(smollm_path, "--api-key", "sesame", "--max-queue", "1", "-c", "2048")
    s.wait_ready()  # (/health stays open)
    auth = {"Authorization": "Bearer sesame"}
    count = {"prompt": "1, 2, 3,", "max_tokens": 2000, "stream": True}  # (runs for many seconds)
    _error(httpx.get(s.url + "/v1/models"), 401, "API key")
    _error(httpx.get(s.url + "/v1/models", headers={"Authorization": "Bearer wrong"}), 401, "invalid")
    assert httpx.get(s.url + "/v1/models", headers=auth).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        s.openai(api_key="wrong").models.list()
    assert s.openai(api_key="sesame").models.list().data
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=s.url).list()
    assert e.value.status_code == 401 and "API key" in e.value.error
    assert ollama.Client(host=s.url, headers=auth).list().models

    # one request runs, one waits: the next one finds the queue full
    with httpx.Client(timeout=60, headers=auth) as running, httpx.Client(timeout=60, headers=auth) as waiting:
        with running.stream("POST", s.url + "/v1/completions", json=count) as first:
            first_lines = first.iter_lines()  # (kept: a dropped iterator closes the response)
            next(first_lines)
            _wait_for(lambda: s.metrics(auth)["requests_processing"])
            with waiting.stream("POST", s.url + "/v1/completions", json=count) as second:
                _wait_for(lambda: s.metrics(auth)["requests_deferred"])
                _error(httpx.post(s.url + "/v1/completions", json=count, headers=auth), 503, "busy")
                assert s.metrics(auth)["requests_rejected_total"] == 1
                # SIGTERM: what runs and what waits are cancelled with an error event, and the server ends
                s.proc.send_signal(signal.SIGTERM)
                rests = [list(first_lines), list(second.iter_lines())]
    for rest in rests:
        assert any("shutting down" in line for line in rest) and "data: [DONE]" in rest, rest[-4:]
    assert s.stop() == 143
    log = s.log()
    assert log.rstrip().endswith("terminated") and "Traceback" not in log
    assert re.search(r"GET /v1/models 401 ", log) and re.search(r"POST /v1/completions 503 ", log)


def test_torch_backend_and_sigint(smollm_path, start):
    """The torch backend (on the CPU) serves a chat; Ctrl-C stops the server with status 130."""
    pytest.importorskip("torch")
    s = start(smollm_path, "--device", "torch-cpu", "-c", "256")
    s.wait_ready()
    r = s.openai().chat.completions.create(model=smollm_path.name, temperature=0, max_tokens=8,
                                           messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert r.choices[0].message.content and r.usage.completion_tokens <= 8
    assert s.stop(signal.SIGINT) == 130
    assert "interrupted" in s.log() and "Traceback" not in s.log()


def test_a_reasoning_models_thinking_comes_apart(harmony_model, monkeypatch):
    """gpt-oss's analysis channel: reasoning_content (OpenAI), thinking (Ollama), apart from the
    answer, whole and streamed; chat_template_kwargs reach the template. (In-process, the
    model's sampler scripted.)"""
    import numpy as np
    from starlette.testclient import TestClient

    from runner.engine.sampler import Choice, SamplingOptions
    from runner.serve import scheduler
    from runner.serve.app import create_app
    from runner.serve.model import ModelCard
    from runner.serve.server import serving_state
    lm = harmony_model
    script = []

    class Scripted(scheduler._RecordingSampler):
        def __init__(self, options, top_logprobs):
            super().__init__(options, top_logprobs)
            script[:] = [lm.tokenizer.vocab.tokens.index(t) for t in _harmony_reply([120, 121], [130, 131])]

        def choose(self, logits, history):
            token = script.pop(0)
            return Choice(token, np.array([token]), np.zeros(1), logits)
    monkeypatch.setattr(scheduler, "_RecordingSampler", Scripted)
    state = serving_state(lambda: lm, ModelCard.of(None, lm.file.path), SamplingOptions(temperature=0),
                          ServeOptions(n_ctx=512), log=lambda line: None)
    state.scheduler.start()
    client = TestClient(create_app(state, lambda line: None))
    _wait_for(lambda: client.get("/health").status_code == 200)
    hi = {"messages": [{"role": "user", "content": " w7"}], "max_tokens": 32}
    message = client.post("/v1/chat/completions", json=hi).json()["choices"][0]["message"]
    assert (message["content"], message["reasoning_content"]) == (" w130 w131", "w120 w121")
    deltas = [json.loads(line[6:])["choices"] for line in client.post("/v1/chat/completions",
                                                                       json={**hi, "stream": True}).iter_lines()
              if line.startswith("data: {")]
    parts = [d[0]["delta"] for d in deltas if d]
    assert "".join(p.get("reasoning_content", "") for p in parts).strip() == "w120 w121"
    assert "".join(p.get("content", "") for p in parts) == " w130 w131"
    r = client.post("/api/chat", json={"model": lm.file.path.name, "messages": hi["messages"], "stream": False,
                                       "options": {"num_predict": 32}}).json()
    assert (r["message"]["content"], r["message"]["thinking"]) == (" w130 w131", "w120 w121")
    usage = [client.post("/v1/chat/completions", json={**hi, "chat_template_kwargs": {"reasoning_effort": effort}})
             .json()["usage"]["prompt_tokens"] for effort in ("low", "medium")]
    assert usage[0] != usage[1]  # (gpt-oss's template writes "Reasoning: low" or "Reasoning: medium")
    state.scheduler.stop()


def test_a_lone_request_speculates_with_the_same_text(start, smollm_path):
    """--lookup: speculative decoding while one request runs alone; the greedy text is run's."""
    prompt = "Count: 1, 2, 3, 1, 2, 3, 1, 2, 3,"
    reference = run_json(smollm_path, "-p", prompt, "-n", "24")
    s = start(smollm_path, "-c", N_CTX, "--lookup", 3, "--draft-max", 6)
    s.wait_ready()
    client = s.openai()
    reply = client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=24,
                                      temperature=0)
    assert reply.choices[0].text == reference["text"]
    assert s.stop(signal.SIGTERM) == 143 and "Traceback" not in s.log()


def test_ignore_eos_runs_to_max_tokens(server, name):
    """llama-server's ignore_eos (which benchmarks use): the reply goes on past the end of
    generation, to max_tokens."""
    hello = [{"role": "user", "content": "Say OK."}]
    short = chat(server, name, hello, max_tokens=40)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 40
    long = chat(server, name, hello, max_tokens=40, extra_body={"ignore_eos": True})
    assert long.choices[0].finish_reason == "length" and long.usage.completion_tokens == 40
    assert long.choices[0].message.content.startswith(short.choices[0].message.content)
