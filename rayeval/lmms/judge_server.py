"""An lmms-eval task's judge, served on the scoring worker's loopback (docs/lmms-judges.md).

lmms-eval 0.7.3's judged tasks (MM-Vet, LLaVA-Bench in-the-wild, MathVista, ...) ask
``lmms_eval.llm_judge.get_server(API_TYPE, ServerConfig(...))`` for their judge inside their
own ``process_results``; its ``local`` provider POSTs OpenAI chat completions to
``LLM_JUDGE_URL`` and reads ``choices[0].message.content`` (``is_available`` GETs ``/models``).
With ``judge: {model: FOLDER}`` on an ``lmms_eval:`` entry, each scoring worker serves that model
there while the task's pass runs, so the task's prompts, parsing and aggregation run unchanged:

    JudgeServer   the judge (``core.judge_model.load``) behind a small OpenAI-compatible
                  server on 127.0.0.1 (a free port, a thread of the worker): POST
                  ``/v1/chat/completions`` (the messages through the judge tokenizer's chat
                  template, greedy, at most the request's ``max_tokens``), GET ``/v1/models``
    routed        while the pass runs: ``API_TYPE=local`` and ``LLM_JUDGE_URL`` in the
                  environment, every lmms-eval judge provider in the process posting as
                  the ``local`` one posts, to that server, and every chat-completions POST
                  the task's own API client makes (``requests``, ``httpx``, and ``httpx2``
                  under the ``openai`` SDK) sent there too (``redirected``; all restored)
    PassJudge     the pass hook (``core.tasks.base.Task.pass_service``): the server started
                  and routed to before an lmms-eval evaluation's pass, stopped after; and
                  around the task's own aggregation on rank 0 (MMBench asks its judge there)
    rendering     on the driver: an entry's tasks built with ``API_TYPE=local``, so the
                  providers their modules make at import are ``local`` ones (plain data that
                  travels to the workers with the task, never an API client), and with an
                  API key that opens nothing, so a client a module makes at import is made

Greedy only: a request's ``temperature``/``top_p`` is not followed (MM-Vet retries an
unparseable verdict at a higher temperature, and gets the same answer); the requests that asked
for one are counted and said once per pass in the worker's log.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

log = logging.getLogger("rayeval")

CHAT_PATH = "/v1/chat/completions"
MODELS_PATH = "/v1/models"
# What a driver's rendering points the judged tasks' import-time providers at: nothing listens
# there (port 9 is "discard"); a worker routes every provider to its own server during a pass.
NOWHERE = "http://127.0.0.1:9/v1/chat/completions"
ENV = ("API_TYPE", "LLM_JUDGE_URL", "NO_PROXY", "no_proxy")
# The keys a task module reads at import to make its own API client (the ``openai`` SDK
# raises without one: 7 lmms-eval 0.7.3 tasks did not build): set, where unset, to a value
# that opens nothing; every request such a client makes in a pass goes to the served judge.
KEYS = ("OPENAI_API_KEY", "JUDGE_API_KEY")
NO_KEY = "rayeval-served-judge"


# --- the server ------------------------------------------------------------------------------

class JudgeServer:
    """The judge behind ``/v1/chat/completions`` on 127.0.0.1 (``url``), one request at a time
    (the worker's scoring thread waits on each), until ``close``."""

    def __init__(self, backend, tok, name: str, dataset_spec, device, max_new_tokens: int):
        self.backend, self.tok, self.name = backend, tok, name
        self.spec, self.device, self.default_tokens = dataset_spec, device, max_new_tokens
        self.sampled = 0                  # requests that asked for sampling: served greedily
        self.served = 0
        self.httpd = HTTPServer(("127.0.0.1", 0), _handler(self))
        self.thread = threading.Thread(target=self.httpd.serve_forever,
                                       kwargs={"poll_interval": 0.1},
                                       name="rayeval-lmms-judge", daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}{CHAT_PATH}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=10)

    def complete(self, body: dict) -> tuple[int, dict]:
        """(HTTP status, JSON body) for one chat-completions request."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return 400, _error("messages: expected a non-empty list of chat messages")
        try:
            chat = [{"role": m["role"], "content": _text_of(m.get("content"))} for m in messages]
        except (KeyError, TypeError, ValueError) as e:
            return 400, _error(f"messages: {e}")
        if float(body.get("temperature") or 0) > 0 or float(body.get("top_p") or 1) < 1:
            self.sampled += 1
        limit = int(body.get("max_tokens") or body.get("max_completion_tokens")
                    or self.default_tokens)
        tokens = self.tokens(chat)
        room = self.tok.max_length - len(tokens)
        if limit < 1 or room < 1:
            return 400, _error(f"This model's maximum context length is {self.tok.max_length} "
                               f"tokens; the messages have {len(tokens)} and max_tokens is "
                               f"{limit}. Please reduce the length of the messages.")
        limit = min(limit, room)
        text, new = self.generate(tokens, limit)
        self.served += 1
        return 200, {
            "id": f"chatcmpl-rayeval-{self.served}", "object": "chat.completion",
            "created": int(time.time()), "model": body.get("model") or self.name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": "length" if new >= limit else "stop"}],
            "usage": {"prompt_tokens": len(tokens), "completion_tokens": new,
                      "total_tokens": len(tokens) + new}}

    def tokens(self, chat: list[dict]) -> list[int]:
        """The messages through the judge tokenizer's chat template with the generation
        prompt (the text of the last message as is when it has no template)."""
        inner = self.tok.tokenizer
        if getattr(inner, "chat_template", None):
            text = inner.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            return inner.encode(text, add_special_tokens=False)
        return inner.encode("\n".join(m["content"] for m in chat))

    def generate(self, tokens: list[int], limit: int) -> tuple[str, int]:
        """The judge's greedy text after ``tokens`` (cut at its end-of-sequence token) and
        about how many tokens it is (the usage a server reports; no task reads it)."""
        from rayeval.config.schema import Generation
        from rayeval.core.backends.base import Context

        ctx = Context(spec=self.spec, task="generation", text=self.tok, batch=1,
                      generation=Generation(until=(), max_new_tokens=limit), device=self.device)
        text = self.backend.generate([tokens], None, ctx)[0][0]
        return text, len(self.tok.tokenizer.encode(text, add_special_tokens=False))


def _text_of(content) -> str:
    """A message's content as text: a string, or OpenAI's parts (text parts joined); an
    image part is refused (the judge is a language model)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if part.get("type") != "text":
                raise ValueError(f"a {part.get('type')!r} part; this judge reads text only")
            parts.append(part.get("text", ""))
        return "\n".join(parts)
    raise ValueError(f"content of type {type(content).__name__}")


def _error(message: str) -> dict:
    return {"object": "error", "error": {"message": message, "type": "BadRequestError",
                                         "code": 400}}


def _handler(server: JudgeServer):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):                       # noqa: N802 - http.server's name
            if self.path.rstrip("/") in (MODELS_PATH, "/models"):
                self.reply(200, {"object": "list", "data": [
                    {"id": server.name, "object": "model", "owned_by": "rayeval"}]})
            else:
                self.reply(404, _error(f"no {self.path} here"))

        def do_POST(self):                      # noqa: N802
            if self.path.rstrip("/") not in (CHAT_PATH, "/chat/completions"):
                self.reply(404, _error(f"no {self.path} here"))
                return
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            except ValueError as e:
                self.reply(400, _error(f"not JSON: {e}"))
                return
            try:
                status, out = server.complete(body)
            except Exception as e:              # noqa: BLE001 - the judge model itself
                log.error("the lmms-eval judge failed on a request: %s: %s",
                          type(e).__name__, e)
                status, out = 500, {"object": "error", "error": {
                    "message": f"{type(e).__name__}: {e}", "type": "InternalServerError",
                    "code": 500}}
            self.reply(status, out)

        def reply(self, status: int, out: dict) -> None:
            data = json.dumps(out).encode("utf-8")
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):           # one line per request is noise in a run
            pass

    return Handler


# --- the providers, routed --------------------------------------------------------------------

@contextlib.contextmanager
def environment(url: str):
    """``API_TYPE=local`` and ``LLM_JUDGE_URL=url`` for the block, 127.0.0.1 in ``NO_PROXY``,
    the API keys of ``KEYS`` that are unset set to ``NO_KEY`` (all restored after)."""
    saved = {k: os.environ.get(k) for k in ENV + KEYS}
    os.environ.update({"API_TYPE": "local", "LLM_JUDGE_URL": url})
    os.environ.update({k: NO_KEY for k in KEYS if not saved[k]})
    for key in ("NO_PROXY", "no_proxy"):          # loopback never through a proxy
        os.environ[key] = ",".join(filter(None, [saved[key], "127.0.0.1"]))
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def rendering():
    """On the driver, while an entry's tasks are built: their modules' import-time
    providers are ``local`` ones pointing nowhere (a worker routes them to its server)."""
    return environment(NOWHERE)


@contextlib.contextmanager
def routed(url: str):
    """For the block: every lmms-eval judge provider (each subclass of lmms-eval 0.7.3's
    ``llm_judge.base.ServerInterface``: its ``evaluate``, ``evaluate_async`` and
    ``is_available``) answers as the ``local`` provider does, posting to ``url``; and the
    environment says ``local`` at ``url`` for providers made during the block. A task's
    providers are made when its module is imported (on the driver, or on the worker where
    the module is importable, MathVista's), so a URL read then cannot be ours: the classes
    are routed instead of the instances."""
    from lmms_eval.llm_judge.base import ServerInterface
    from lmms_eval.llm_judge.providers.local import LocalProvider

    post = LocalProvider.__dict__["evaluate"]          # the local provider's own request
    available = LocalProvider.__dict__["is_available"]

    def local(self) -> LocalProvider:
        proxy = LocalProvider.__new__(LocalProvider)
        proxy.config, proxy.api_url = self.config, url
        return proxy

    def evaluate(self, request):
        return post(local(self), request)

    async def evaluate_async(self, request):
        return post(local(self), request)

    def is_available(self):
        return available(local(self))

    patched = {"evaluate": evaluate, "evaluate_async": evaluate_async,
               "is_available": is_available}
    saved = []
    for cls in _subclasses(ServerInterface):
        for name, fn in patched.items():
            if name == "evaluate_async" and not hasattr(cls, name):
                continue
            saved.append((cls, name, cls.__dict__.get(name, _ABSENT)))
            setattr(cls, name, fn)
    try:
        with environment(url), redirected(url):
            yield
    finally:
        for cls, name, old in reversed(saved):
            if old is _ABSENT:
                delattr(cls, name)
            else:
                setattr(cls, name, old)


_ABSENT = object()


def to_judge(method: str, target: str) -> bool:
    """Whether a request a task's own code makes is its judge's: a POST to an OpenAI-style
    chat-completions path (OpenAI's, Azure's deployments, any base URL), or to an address
    that is no URL at all (the placeholder a module kept when its key was unset at import:
    MMBench's ``"YOUR_API_URL"`` under ``API_TYPE=local``)."""
    if method.upper() != "POST":
        return False
    from urllib.parse import urlsplit

    parts = urlsplit(target)
    return parts.scheme not in ("http", "https") or \
        parts.path.rstrip("/").endswith("/chat/completions")


@contextlib.contextmanager
def redirected(url: str):
    """For the block: the judge's requests (``to_judge``) that a task's own code makes with
    ``requests``, ``httpx`` or ``httpx2`` (the ``openai`` SDK's transport, sync and async) sent
    to ``url`` instead; every other request as it was. The clients are made at the task module's import
    with the URL it read then, so the request is redirected, not the client."""
    import importlib

    patches = []
    try:
        import requests
    except ImportError:
        requests = None
    if requests is not None:
        request = requests.Session.request

        def session_request(self, method, target=None, *args, **kwargs):
            if target is None:            # by keyword, as requests.post passes it
                target = kwargs.pop("url")
            return request(self, method, url if to_judge(method, str(target)) else target,
                           *args, **kwargs)

        patches.append((requests.Session, "request", request, session_request))
    # httpx2: the openai SDK's own fork of httpx (openai 3.x), beside httpx itself
    for name in ("httpx", "httpx2"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        for cls in (module.Client, module.AsyncClient):
            patches.append((cls, "send", cls.send, _send(cls.send, url, module)))
    for cls, name, _, new in patches:
        setattr(cls, name, new)
    try:
        yield
    finally:
        for cls, name, old, _ in reversed(patches):
            setattr(cls, name, old)


def _send(send, url: str, httpx):
    """``httpx``'s ``Client.send`` (or ``AsyncClient.send``) with a judge's request sent to
    ``url`` (the same method, headers and body)."""
    import inspect

    def moved(request):
        if to_judge(request.method, str(request.url)):
            request.url = httpx.URL(url)
            request.headers["Host"] = request.url.netloc.decode("ascii")
        return request

    if inspect.iscoroutinefunction(send):
        async def asend(self, request, *args, **kwargs):
            return await send(self, moved(request), *args, **kwargs)
        return asend

    def ssend(self, request, *args, **kwargs):
        return send(self, moved(request), *args, **kwargs)
    return ssend


def _subclasses(cls) -> list[type]:
    found, todo = [], list(cls.__subclasses__())
    while todo:
        sub = todo.pop()
        if sub not in found:
            found.append(sub)
            todo.extend(sub.__subclasses__())
    return found


# --- the pass hook ----------------------------------------------------------------------------

class PassJudge:
    """The judge of an lmms-eval evaluation's pass on one worker: ``start`` loads it, serves
    it and routes lmms-eval's providers to it; ``close`` undoes all three (always called)."""

    def __init__(self, spec, device, model_spec):
        self.spec, self.device, self.model_spec = spec, device, model_spec
        self.server: JudgeServer | None = None
        self.judge = None
        self.route = None

    def start(self) -> None:
        from rayeval.core import judge_model

        js = self.spec.judge
        # "hf" unless the sweep names another: the judge runs beside the evaluated model in
        # the same worker (docs/lmms-judges.md), not after it as a generation judge does.
        self.judge = judge_model.load(js, js.backend or "hf", self.device, self.model_spec)
        self.server = JudgeServer(self.judge.backend, self.judge.tokenizer,
                                  os.path.basename(js.model.rstrip("/")),
                                  self.spec.dataset, self.device, js.max_new_tokens)
        self.route = routed(self.server.url)
        self.route.__enter__()

    def close(self) -> None:
        if self.route is not None:
            self.route.__exit__(None, None, None)
            self.route = None
        if self.server is not None:
            if self.server.sampled:
                log.warning("%s: the judge was asked %d time(s) to sample (temperature or "
                            "top_p); it answered greedily each time (docs/lmms-judges.md)",
                            self.spec.name, self.server.sampled)
            self.server.close()
            self.server = None
        if self.judge is not None:          # as a judge stage lets its judge go
            self.judge.close()
            self.judge = None
