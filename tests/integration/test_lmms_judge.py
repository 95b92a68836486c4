"""An lmms-eval task judged by a local model (docs/lmms-judges.md), against lmms-eval's own run.

The task is written here as MM-Vet is written: a YAML over easy-vqa items (real 64x64 images,
``tests/vlm_support.py``) whose ``utils.py`` makes its judge at import with
``lmms_eval.llm_judge.get_server(API_TYPE, ServerConfig(...))``, grades each response with
one chat message, reads "yes"/"no" from the judge's first word, and retries an unreadable
verdict with the temperature raised by 0.5 up to 1.0 (then the document fails). The evaluated
model is the tiny untrained Idefics3 of ``tests/conftest.py`` (``tiny_vlm``); the judge is the
hand-built Llama of ``tests/judge_support.py`` (its verdict is a function of the prompt's last
token, so it varies with the response: yes, no, or no verdict at all).

The reference is lmms-eval's command line with ``API_TYPE=local`` and ``LLM_JUDGE_URL`` at a
server this module runs on loopback: plain transformers, greedy, the judge tokenizer's chat
template (``Reference``). rayeval runs the sweep once on local Ray with two standing workers,
each serving the judge on its own loopback. Figures, per-document values and responses must equal
lmms-eval's; the bad inputs are one line before Ray.
"""

import contextlib
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
import yaml

pytest.importorskip("transformers")
pytest.importorskip("lmms_eval")
pytest.importorskip("easy_vqa")

from lmms_reference import OFFLINE_ENV, read_output, run_cli  # noqa: E402
from vlm_support import easy_vqa_items  # noqa: E402

from rayeval.errors import SpecError  # noqa: E402
from rayeval.plan.loader import load_sweep  # noqa: E402

for _key, _value in OFFLINE_ENV.items():
    os.environ.setdefault(_key, _value)

TASK = "rayeval_judged_vqa"
PLAIN = "rayeval_plain_vqa"
N = 8
METRICS = ("judge_score", "judge_failed", "judge_retries")
MAX_NEW_TOKENS = 6

UTILS = '''\
import os

from PIL import Image

from lmms_eval.llm_judge import Request, ServerConfig, get_server

API_TYPE = os.getenv("API_TYPE", "openai")
MODEL_VERSION = os.getenv("MODEL_VERSION", "judge-model")

# As MM-Vet: the judge is made when the module is imported.
server = get_server(server_name=API_TYPE, config=ServerConfig(
    model_name=MODEL_VERSION, temperature=0.0, max_tokens=3, num_retries=1, retry_delay=0))
PROMPT = "Question: {question}\\nReference: {answer}\\nAnswer: {pred}"


def doc_to_visual(doc):
    return [Image.open(doc["image"]).convert("RGB")]


def doc_to_text(doc, lmms_eval_specific_kwargs=None):
    kwargs = lmms_eval_specific_kwargs or {}
    return f"{kwargs.get('pre_prompt', '')}{doc['question']}{kwargs.get('post_prompt', '')}"


def grade(prompt):
    """(1.0 yes / 0.0 no / None, the temperature of the last try): MM-Vet's escalation."""
    temperature = 0.0
    while True:
        config = ServerConfig(model_name=MODEL_VERSION, temperature=temperature, max_tokens=3,
                              num_retries=1, retry_delay=0)
        response = server.evaluate(Request(messages=[{"role": "user", "content": prompt}],
                                           config=config))
        words = response.content.split()
        if words and words[0].lower() in ("yes", "no"):
            return (1.0 if words[0].lower() == "yes" else 0.0), temperature
        if temperature >= 1.0:
            return None, temperature
        temperature += 0.5


def process_results(doc, results):
    pred = results[0].strip()
    score, temperature = grade(PROMPT.format(question=doc["question"], answer=doc["answer"],
                                             pred=pred))
    return {"judge_score": 0.0 if score is None else score,
            "judge_failed": float(score is None), "judge_retries": temperature / 0.5}
'''
# The same items judged as the tasks that call an API themselves do (lmms-eval 0.7.3's
# reasoning tasks, MMBench, HallusionBench, WildVision: not through llm_judge): an OpenAI
# client made at import, asked in process_results; and, as MMBench asks its judge while it
# aggregates, ``requests.post`` to the chat-completions URL the module read at import, once
# per item, inside the task's own aggregation function.
API_TASK = "rayeval_api_judged_vqa"
API_METRICS = ("api_score", "api_agreed")
API_UTILS = '''\
import os

import requests
from openai import OpenAI
from PIL import Image

MODEL_VERSION = os.getenv("MODEL_VERSION", "judge-model")
API_URL = os.getenv("OPENAI_API_URL", "https://api.openai.com/v1/chat/completions")
API_KEY = os.getenv("OPENAI_API_KEY", "YOUR_API_KEY")
client = OpenAI(api_key=os.getenv("JUDGE_API_KEY", "YOUR_API_KEY"),
                base_url=os.getenv("JUDGE_BASE_URL", "https://api.openai.com/v1"))
PROMPT = "Question: {question}\\nReference: {answer}\\nAnswer: {pred}"


''' + UTILS[UTILS.index("def doc_to_visual"):UTILS.index("def grade")] + '''\
def first_word(text):
    words = (text or "").split()
    return words[0].lower() if words else ""


def process_results(doc, results):
    pred = results[0].strip()
    reply = client.chat.completions.create(
        model=MODEL_VERSION, max_tokens=3, temperature=0, messages=[{"role": "user",
        "content": PROMPT.format(question=doc["question"], answer=doc["answer"], pred=pred)}])
    item = {"question": doc["question"], "answer": doc["answer"], "pred": pred}
    return {"api_score": float(first_word(reply.choices[0].message.content) == "yes"),
            "api_agreed": item}


def agreement(items):
    """The share of items the judge does not call right when asked again, reference first."""
    said = 0
    for item in items:
        payload = {"model": MODEL_VERSION, "max_tokens": 3, "temperature": 0,
                   "messages": [{"role": "user", "content": "Reference: {answer}\\nQuestion: "
                                 "{question}\\nAnswer: {pred}".format(**item)}]}
        response = requests.post(API_URL, json=payload, timeout=60,
                                 headers={"Authorization": f"Bearer {API_KEY}"})
        response.raise_for_status()
        said += first_word(response.json()["choices"][0]["message"]["content"]) != "yes"
    return said / len(items)
'''
API_METRIC_LIST = ("  - {metric: api_score, aggregation: mean, higher_is_better: true}\n"
                   "  - {metric: api_agreed, aggregation: !function utils.agreement, "
                   "higher_is_better: false}\n")
# The same task without a judge: its process_results compares texts.
PLAIN_UTILS = UTILS[UTILS.index("def doc_to_visual"):UTILS.index("def grade")] + '''\
def process_results(doc, results):
    return {"judge_score": float(results[0].strip() == doc["answer"]),
            "judge_failed": 0.0, "judge_retries": 0.0}
'''


def write_task(folder, items, name=TASK, utils=UTILS, metric_list=None) -> str:
    os.makedirs(folder, exist_ok=True)
    data = os.path.join(folder, "items.jsonl")
    with open(data, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(it) + "\n" for it in items)
    with open(os.path.join(folder, "utils.py"), "w", encoding="utf-8") as f:
        f.write(("from PIL import Image\n\n\n" if utils is PLAIN_UTILS else "") + utils)
    metrics = metric_list or "".join(
        f"  - {{metric: {m}, aggregation: mean, higher_is_better: true}}\n" for m in METRICS)
    path = os.path.join(folder, f"{name}.yaml")
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"task: {name}\n"
                "dataset_path: json\n"
                "dataset_kwargs:\n"
                f"  data_files: {{test: {json.dumps(data)}}}\n"
                f"  cache_dir: {json.dumps(os.path.join(folder, 'datasets_cache'))}\n"
                "test_split: test\n"
                "output_type: generate_until\n"
                "doc_to_visual: !function utils.doc_to_visual\n"
                "doc_to_text: !function utils.doc_to_text\n"
                "doc_to_target: answer\n"
                "process_results: !function utils.process_results\n"
                "generation_kwargs:\n"
                f"  max_new_tokens: {MAX_NEW_TOKENS}\n"
                "  temperature: 0\n"
                "  do_sample: false\n"
                f"metric_list:\n{metrics}"
                "lmms_eval_specific_kwargs:\n"
                "  default:\n"
                "    pre_prompt: \"\"\n"
                "    post_prompt: \" Answer in one word.\"\n")
    return path


def build_judge(folder, items) -> str:
    """The hand-built judge (tests/judge_support.py) with a tokenizer trained here on the
    prompts' words; a chat template without a generation prompt, so the rendered chat ends
    with the response's last token, which the verdict depends on."""
    import torch
    from judge_support import CHAT, VERDICT_WORDS, judge_model
    from support import tiny_tokenizer

    texts = [f"Question: {it['question']}\nReference: {it['answer']}\nAnswer: {it['answer']}"
             for it in items] + ["yes no maybe " * 20, "Question Reference Answer"] * 5
    tok = tiny_tokenizer(texts, vocab=400)
    tok.chat_template = CHAT
    model = judge_model(tok)
    # Its rule, token a -> verdict (a * 7) % 3, says "maybe" after 7 of these 8 responses:
    # (a // 5) % 3 instead (after a verdict word, " maybe" as before).
    words = [tok.convert_tokens_to_ids(tok.tokenize(w))[0] for w in VERDICT_WORDS]
    with torch.no_grad():
        head = model.lm_head.weight
        head.zero_()
        for a in range(len(tok)):
            head[words[2] if a in words else words[(a // 5) % 3], a] = 1.0
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


class Reference:
    """The judge served by plain transformers on 127.0.0.1 (a free port) for lmms-eval's own
    run: OpenAI's chat completions (``/v1/chat/completions``, ``/v1/models``), greedy, every
    request kept. A daemon thread, shut down when the block ends."""

    def __init__(self, folder):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(folder)
        self.model = AutoModelForCausalLM.from_pretrained(folder).eval()
        self.requests = []

    def answer(self, body: dict) -> str:
        import torch

        self.requests.append(body)
        chat = self.tok.apply_chat_template(body["messages"], tokenize=False,
                                            add_generation_prompt=True)
        ids = torch.tensor([self.tok.encode(chat, add_special_tokens=False)])
        with torch.no_grad():
            out = self.model.generate(ids, do_sample=False, max_new_tokens=body["max_tokens"],
                                      pad_token_id=0, eos_token_id=0)
        new = out[0, ids.shape[1]:].tolist()
        new = new[:new.index(0)] if 0 in new else new
        return self.tok.decode(new, skip_special_tokens=True)

    @contextlib.contextmanager
    def serving(self):
        reference = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):                              # noqa: N802
                self.reply({"object": "list", "data": [{"id": "judge-model"}]})

            def do_POST(self):                             # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                text = reference.answer(body)
                self.reply({"choices": [{"index": 0, "message": {"role": "assistant",
                                                                 "content": text}}],
                            "model": body.get("model")})

            def reply(self, out):
                data = json.dumps(out).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        httpd = HTTPServer(("127.0.0.1", 0), Handler)
        thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                  daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{httpd.server_address[1]}/v1/chat/completions"
        finally:
            httpd.shutdown()
            httpd.server_close()
            thread.join(timeout=10)


@contextlib.contextmanager
def environ(**values):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def write_sweep(root, entry, name="sweep.yaml", workers=2, **top) -> str:
    """A sweep of ``entry`` (an evaluation, or a list of them) over the module's checkpoint."""
    path = os.path.join(root, name)
    with open(path, "w") as f:
        yaml.safe_dump({"name": "judged-vqa", "checkpoints": ["ckpts/checkpoint-*"],
                        "output": "results", "workers": workers, **top,
                        "evals": entry if isinstance(entry, list) else [entry]}, f)
    return path


# The environment of a process run with its judge at ``url`` (lmms-eval's reference): the
# llm_judge provider's, and the URLs and keys the API task's module reads at import.
def reference_environment(url: str) -> dict:
    return dict(API_TYPE="local", LLM_JUDGE_URL=url, OPENAI_API_URL=url,
                JUDGE_BASE_URL=url[:-len("/chat/completions")], OPENAI_API_KEY="reference",
                JUDGE_API_KEY="reference")


KEYS = ("API_TYPE", "LLM_JUDGE_URL", "OPENAI_API_KEY", "JUDGE_API_KEY")


@pytest.fixture(scope="module")
def example(tmp_path_factory, tiny_vlm):
    """The task, the judge, the checkpoint (a link to ``tiny_vlm``) and lmms-eval's own run
    with its judge at the reference server: (root, lmms-eval's output, the requests the
    reference served)."""
    root = tmp_path_factory.mktemp("lmms_judge")
    items = easy_vqa_items(n=N, seed=3)
    tasks = str(root / "tasks")
    write_task(os.path.join(tasks, "served"), items)
    write_task(os.path.join(tasks, "api"), items, name=API_TASK, utils=API_UTILS,
               metric_list=API_METRIC_LIST)
    judge = build_judge(root / "judge-model", items)
    os.makedirs(root / "ckpts")
    os.symlink(tiny_vlm, root / "ckpts" / "checkpoint-1")
    reference = Reference(judge)
    with reference.serving() as url, environ(**reference_environment(url)):
        run_cli(tiny_vlm, tasks, [TASK, API_TASK], str(root / "reference"))
    # 20 replicates: the API task's own aggregation asks the judge once per item per resample
    write_sweep(str(root), [
        {"name": "vqa", "batch_size": 4, "lmms_eval": {"task": TASK, "include_path": "tasks"},
         "judge": {"model": "judge-model"}},
        {"name": "api", "batch_size": 4,
         "lmms_eval": {"task": API_TASK, "include_path": "tasks"},
         "judge": {"model": "judge-model"}}], bootstrap={"replicates": 20})
    return (root, read_output(str(root / "reference"), TASK, ("none",)), reference.requests,
            read_output(str(root / "reference"), API_TASK, ("none",)))


def test_the_reference_is_not_degenerate(example):
    """The verdicts vary: yes, no and none (then the temperature was raised and the same
    greedy answer came back, twice)."""
    _, theirs, requests, api = example
    values = {m: [s[m] for s in theirs["samples"]["none"]] for m in METRICS}
    assert theirs["n"] == N and api["n"] == N
    assert 0 < sum(values["judge_score"]) < N - sum(values["judge_failed"])   # yes and no
    assert 0 < sum(values["judge_failed"]) < N
    assert {r["temperature"] for r in requests} == {0.0, 0.5, 1.0}
    # the llm_judge task's requests, then the API task's: one per item in process_results,
    # one per item in its aggregation
    assert len(requests) == N + 2 * sum(values["judge_failed"]) + 2 * N
    scores = [s["api_score"] for s in api["samples"]["none"]]
    assert 0 < sum(scores) < N and 0 < api["results"]["api_agreed,none"] < 1


@pytest.mark.ray
def test_a_ray_run_serving_the_judge_equals_lmms_eval(example, standing):
    """On the session's standing workers (as a service runs it): each serves the judge for
    its passes, and rank 0 around the API task's own aggregation."""
    import rayeval
    from rayeval.execution.driver import run_sweep
    from rayeval.io.store import ResultStore
    from rayeval.ranking import latest_rows

    root, theirs, _, api = example
    environment = {k: os.environ.get(k) for k in KEYS}
    report = run_sweep(load_sweep(str(root / "sweep.yaml")), standing=standing)
    assert all(o.ok for o in report.outcomes), [o.error for o in report.outcomes]
    rows = latest_rows(ResultStore(str(root / "results")).read())
    assert sorted((r["evaluation"], r["metric"]) for r in rows) == sorted(
        [("vqa", m) for m in METRICS] + [("api", m) for m in API_METRICS])
    for r in rows:
        want = (theirs if r["evaluation"] == "vqa" else api)["results"][f"{r['metric']},none"]
        assert r["world_size"] == 2 and r["num_samples"] == N
        assert r["value"] == pytest.approx(want, abs=1e-12), (r["evaluation"], r["metric"])
    # each document once, its response and per-document values lmms-eval's (the API task's
    # own-aggregation values are kept whole: its mean metric is compared)
    for name, reference, compared in (("vqa", theirs, METRICS), ("api", api, ("api_score",))):
        records = rayeval.samples(str(root / "results"), checkpoint="checkpoint-1",
                                  evaluation=name).to_pylist()
        assert sorted(r["id"] for r in records) == list(range(N))
        for r in records:
            sample = reference["samples"]["none"][r["id"]]
            assert r["response"] == sample["filtered_resps"]
            for m in compared:
                assert r[m] == sample[m], (name, r["id"], m)
    assert {k: os.environ.get(k) for k in environment} == environment   # the driver's


def test_the_served_judge_answers_as_the_local_provider_asks(example):
    """In one process: the judge server, lmms-eval's providers routed to it (a provider made
    before, as an ``openai`` one, included), and a task's own API clients' chat completions
    (``requests`` to a placeholder address or OpenAI's, ``httpx`` to an Azure deployment),
    its answers the reference's; other requests untouched; all undone after."""
    import httpx
    import requests
    from lmms_eval.llm_judge import Request, ServerConfig, get_server

    from rayeval.config.schema import DatasetSpec, JudgeSpec, ModelSpec
    from rayeval.core.judge_model import load as load_judge
    from rayeval.lmms.judge_server import JudgeServer, routed

    import torch

    root, _, _, _ = example
    judge = str(root / "judge-model")
    reference = Reference(judge)
    js = JudgeSpec(model=judge)
    loaded = load_judge(js, "hf", torch.device("cpu"), ModelSpec())
    server = JudgeServer(loaded.backend, loaded.tokenizer, "judge-model", DatasetSpec(path="x"),
                         torch.device("cpu"), 16)
    config = ServerConfig(model_name="judge-model", temperature=0.5, max_tokens=3,
                          num_retries=1, retry_delay=0)
    with environ(OPENAI_API_KEY="never-used"):      # an OpenAI client wants one to be made
        made_before = get_server("openai", config)
    own = type(made_before).__dict__["evaluate"]
    sends = (requests.Session.request, httpx.Client.send, httpx.AsyncClient.send)
    environment = {k: os.environ.get(k) for k in KEYS}
    try:
        with routed(server.url):
            assert os.environ["API_TYPE"] == "local"
            assert made_before.is_available() and get_server("local", config).is_available()
            for text in ("Question: what shape\nReference: circle\nAnswer: circle",
                         "Question: what colour\nReference: red\nAnswer: blue"):
                request = Request(messages=[{"role": "user", "content": text}], config=config)
                want = reference.answer({"messages": request.messages, "max_tokens": 3})
                assert made_before.evaluate(request).content == want.strip()
                body = {"model": "judge-model", "max_tokens": 3, "messages": request.messages}
                for target in ("YOUR_API_URL", "https://api.openai.com/v1/chat/completions"):
                    got = requests.post(target, json=body, timeout=60).json()
                    assert got["choices"][0]["message"]["content"].strip() == want.strip(), \
                        target
                with httpx.Client() as client:
                    got = client.post("https://example.invalid/openai/deployments/judge/chat/"
                                      "completions?api-version=2024-06-01", json=body).json()
                assert got["choices"][0]["message"]["content"].strip() == want.strip()
            with pytest.raises(requests.exceptions.MissingSchema):     # a GET: untouched
                requests.get("YOUR_API_URL", timeout=5)
        assert server.sampled == 2
        assert type(made_before).__dict__["evaluate"] is own
        assert (requests.Session.request, httpx.Client.send, httpx.AsyncClient.send) == sends
        assert {k: os.environ.get(k) for k in environment} == environment
    finally:
        server.close()
        loaded.close()


# --- bad input: one line naming the key, before Ray -------------------------------------------

@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """A task over the same items that asks no judge (its process_results compares texts),
    beside the judged one."""
    root = tmp_path_factory.mktemp("lmms_judge_bad")
    items = easy_vqa_items(n=2, seed=3)
    write_task(str(root / "tasks" / "judged"), items)
    write_task(str(root / "tasks" / "plain"), items, name=PLAIN, utils=PLAIN_UTILS)
    os.makedirs(root / "ckpts" / "checkpoint-1")
    os.makedirs(root / "judge-model")
    (root / "judge-model" / "config.json").write_text("{}")
    os.makedirs(root / "empty")
    return root


BAD = {
    "judge on a task that asks none": (
        {"lmms_eval": {"task": PLAIN, "include_path": "tasks/plain"},
         "judge": {"model": "judge-model"}},
        f"evals[0].judge: lmms-eval task '{PLAIN}' asks no judge (nothing in it calls "
        "lmms_eval.llm_judge or an API client); remove judge:"),
    "a prompt": (
        {"lmms_eval": {"task": TASK, "include_path": "tasks/judged"},
         "judge": {"model": "judge-model", "prompt": "{{ response }}"}},
        "evals[0].judge.prompt: an lmms_eval entry's judge is prompted and read by the task's "
        "own code; remove the key"),
    "a verdict": (
        {"lmms_eval": {"task": TASK, "include_path": "tasks/judged"},
         "judge": {"model": "judge-model", "verdict": {"yes": 1}}},
        "evals[0].judge.verdict: an lmms_eval entry's judge is prompted and read by the "
        "task's own code; remove the key"),
    "a judge that is no folder": (
        {"lmms_eval": {"task": TASK, "include_path": "tasks/judged"},
         "judge": {"model": "empty"}},
        "evals[0].judge.model: "),
    "a judged task without a judge": (
        {"lmms_eval": {"task": TASK, "include_path": "tasks/judged"}},
        f"evals[0].lmms_eval.task: lmms-eval task '{TASK}' is judged by an API model "
        "(process_results in utils.py uses lmms_eval.llm_judge); rayeval does not call API "
        "judges: give the entry judge: {model: FOLDER}"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_line_before_ray(plain, case):
    entry, message = BAD[case]
    path = write_sweep(str(plain), {"name": "vqa", **entry}, name=f"{case[:12]}.yaml")
    with pytest.raises(SpecError) as error:
        load_sweep(path)
    assert message in str(error.value)
    assert "\n" not in str(error.value)
    assert not (plain / "results").exists()


def test_a_judged_entry_puts_the_judge_in_its_key(plain):
    """The judge reaches the evaluation (and the cell's key); the driver's environment is
    as it was after rendering."""
    path = write_sweep(str(plain), {"name": "vqa", "lmms_eval": {
        "task": TASK, "include_path": "tasks/judged"}, "judge": {"model": "judge-model"}},
        name="judged.yaml")
    environment = {k: os.environ.get(k) for k in KEYS}
    sweep = load_sweep(path)
    js = sweep.evals[0].judge
    assert js is not None and not js.staged
    assert js.model == str(plain / "judge-model") and js.key_path == "evals[0].judge"
    assert {k: os.environ.get(k) for k in environment} == environment
