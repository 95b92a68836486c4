"""The served judge of an lmms-eval task (rayeval/lmms/judge_server.py) without a model: the
OpenAI chat-completions protocol lmms-eval's ``local`` provider speaks, on loopback, with a
stand-in backend; and lmms-eval's providers routed to it and back."""

import json
import os
import urllib.error
import urllib.request

import pytest

pytest.importorskip("lmms_eval")

from rayeval.config.schema import DatasetSpec  # noqa: E402
from rayeval.lmms.judge_server import JudgeServer, routed  # noqa: E402


class _Inner:
    chat_template = None

    @staticmethod
    def encode(text, add_special_tokens=True):
        return [1 + ord(c) % 50 for c in text]


class _Tok:                          # the surface of io.hf.Tokenizer the server reads
    max_length = 40
    eos_id = 0
    tokenizer = _Inner()


class _Backend:
    def __init__(self):
        self.asked = []

    def generate(self, contexts, ids, ctx):
        self.asked.append((contexts, ctx.generation.max_new_tokens))
        return [[f"yes after {len(c)}"] for c in contexts]


@pytest.fixture
def server():
    s = JudgeServer(_Backend(), _Tok(), "judge", DatasetSpec(path="x"), "cpu", 7)
    yield s
    s.close()


def _post(url, body):
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_chat_completions_greedy_and_counted(server):
    status, out = _post(server.url, {"model": "gpt-4o", "max_tokens": 3, "temperature": 0.5,
                                     "messages": [{"role": "user", "content": "abc"}]})
    assert status == 200
    assert out["choices"][0]["message"] == {"role": "assistant", "content": "yes after 3"}
    assert out["model"] == "gpt-4o" and server.sampled == 1
    assert server.backend.asked == [([[1 + ord(c) % 50 for c in "abc"]], 3)]
    _post(server.url, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert server.backend.asked[-1] == ([[1 + ord(c) % 50 for c in "a\nb"]], 7)   # default
    assert server.sampled == 1
    with urllib.request.urlopen(server.url.replace("/chat/completions", "/models"),
                                timeout=10) as r:
        assert json.loads(r.read())["data"][0]["id"] == "judge"


@pytest.mark.parametrize("body, message", [
    ({"messages": [{"role": "user", "content": "x" * 50}]}, "reduce the length"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "text only"),
    ({"messages": []}, "non-empty list")])
def test_bad_requests_are_400(server, body, message):
    status, out = _post(server.url, body)
    assert status == 400 and message in out["error"]["message"]


def test_providers_routed_and_restored(server):
    from lmms_eval.llm_judge import Request, ServerConfig
    from lmms_eval.llm_judge.providers.dummy import DummyProvider
    from lmms_eval.llm_judge.providers.local import LocalProvider

    config = ServerConfig(model_name="m", max_tokens=2, num_retries=1, retry_delay=0)
    made = DummyProvider(config)                # made before: routed all the same
    own = {c: dict(c.__dict__) for c in (DummyProvider, LocalProvider)}
    environment = {k: os.environ.get(k) for k in ("API_TYPE", "LLM_JUDGE_URL")}
    request = Request(messages=[{"role": "user", "content": "hi"}], config=config)
    with routed(server.url):
        assert os.environ["API_TYPE"] == "local" and os.environ["LLM_JUDGE_URL"] == server.url
        assert made.is_available()
        assert made.evaluate(request).content == "yes after 2"
    assert {c: dict(c.__dict__) for c in own} == own
    assert {k: os.environ.get(k) for k in environment} == environment
