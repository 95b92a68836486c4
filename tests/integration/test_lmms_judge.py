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
template (``Reference``). rayeval runs the sweep once on local Ray with two workers, each
serving the judge on its own loopback. Figures, per-document values and responses must equal
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
# The same task without a judge: its process_results compares texts.
PLAIN_UTILS = UTILS[UTILS.index("def doc_to_visual"):UTILS.index("def grade")] + '''\
def process_results(doc, results):
    return {"judge_score": float(results[0].strip() == doc["answer"]),
            "judge_failed": 0.0, "judge_retries": 0.0}
'''


def write_task(folder, items, name=TASK, utils=UTILS) -> str:
    os.makedirs(folder, exist_ok=True)
    data = os.path.join(folder, "items.jsonl")
    with open(data, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(it) + "\n" for it in items)
    with open(os.path.join(folder, "utils.py"), "w", encoding="utf-8") as f:
        f.write(("from PIL import Image\n\n\n" if utils is PLAIN_UTILS else "") + utils)
    metrics = "".join(f"  - {{metric: {m}, aggregation: mean, higher_is_better: true}}\n"
                      for m in METRICS)
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


def write_sweep(root, entry: dict, name="sweep.yaml", workers=2) -> str:
    path = os.path.join(root, name)
    with open(path, "w") as f:
        yaml.safe_dump({"name": "judged-vqa", "checkpoints": ["ckpts/checkpoint-*"],
                        "output": "results", "workers": workers, "evals": [entry]}, f)
    return path


@pytest.fixture(scope="module")
def example(tmp_path_factory, tiny_vlm):
    """The task, the judge, the checkpoint (a link to ``tiny_vlm``) and lmms-eval's own run
    with its judge at the reference server: (root, lmms-eval's output, the requests the
    reference served)."""
    root = tmp_path_factory.mktemp("lmms_judge")
    items = easy_vqa_items(n=N, seed=3)
    tasks = str(root / "tasks")
    write_task(tasks, items)
    judge = build_judge(root / "judge-model", items)
    os.makedirs(root / "ckpts")
    os.symlink(tiny_vlm, root / "ckpts" / "checkpoint-1")
    reference = Reference(judge)
    with reference.serving() as url, environ(API_TYPE="local", LLM_JUDGE_URL=url):
        run_cli(tiny_vlm, tasks, [TASK], str(root / "reference"))
    write_sweep(str(root), {"name": "vqa", "batch_size": 4,
                            "lmms_eval": {"task": TASK, "include_path": "tasks"},
                            "judge": {"model": "judge-model"}})
    return root, read_output(str(root / "reference"), TASK, ("none",)), reference.requests


def test_the_reference_is_not_degenerate(example):
    """The verdicts vary: yes, no and none (then the temperature was raised and the same
    greedy answer came back, twice)."""
    _, theirs, requests = example
    values = {m: [s[m] for s in theirs["samples"]["none"]] for m in METRICS}
    assert theirs["n"] == N
    assert 0 < sum(values["judge_score"]) < N - sum(values["judge_failed"])   # yes and no
    assert 0 < sum(values["judge_failed"]) < N
    assert {r["temperature"] for r in requests} == {0.0, 0.5, 1.0}
    assert len(requests) == N + 2 * sum(values["judge_failed"])


@pytest.mark.ray
def test_a_ray_run_serving_the_judge_equals_lmms_eval(example, ray_cluster):
    import rayeval
    from rayeval.execution.driver import run_sweep
    from rayeval.io.store import ResultStore
    from rayeval.ranking import latest_rows

    root, theirs, _ = example
    environment = {k: os.environ.get(k) for k in ("API_TYPE", "LLM_JUDGE_URL")}
    report = run_sweep(load_sweep(str(root / "sweep.yaml")))
    assert all(o.ok for o in report.outcomes), report.outcomes
    rows = latest_rows(ResultStore(str(root / "results")).read())
    assert sorted(r["metric"] for r in rows) == sorted(METRICS)
    for r in rows:
        assert r["world_size"] == 2 and r["num_samples"] == N
        assert r["value"] == pytest.approx(theirs["results"][f"{r['metric']},none"],
                                           abs=1e-12), r["metric"]
    records = rayeval.samples(str(root / "results"), checkpoint="checkpoint-1",
                              evaluation="vqa").to_pylist()
    assert sorted(r["id"] for r in records) == list(range(N))
    for r in records:
        sample = theirs["samples"]["none"][r["id"]]
        assert r["response"] == sample["filtered_resps"]
        for m in METRICS:
            assert r[m] == sample[m], (r["id"], m)
    assert {k: os.environ.get(k) for k in environment} == environment   # the driver's


def test_the_served_judge_answers_as_the_local_provider_asks(example):
    """In one process: the judge server, lmms-eval's providers routed to it (a provider made
    before, as an ``openai`` one, included), its answers the reference's; all undone after."""
    from lmms_eval.llm_judge import Request, ServerConfig, get_server

    from rayeval.config.schema import DatasetSpec, JudgeSpec, ModelSpec
    from rayeval.core.judge_model import load as load_judge
    from rayeval.lmms.judge_server import JudgeServer, routed

    import torch

    root, _, _ = example
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
    environment = {k: os.environ.get(k) for k in ("API_TYPE", "LLM_JUDGE_URL")}
    try:
        with routed(server.url):
            assert os.environ["API_TYPE"] == "local"
            assert made_before.is_available() and get_server("local", config).is_available()
            for text in ("Question: what shape\nReference: circle\nAnswer: circle",
                         "Question: what colour\nReference: red\nAnswer: blue"):
                request = Request(messages=[{"role": "user", "content": text}], config=config)
                want = reference.answer({"messages": request.messages, "max_tokens": 3})
                assert made_before.evaluate(request).content == want.strip()
        assert server.sampled == 2
        assert type(made_before).__dict__["evaluate"] is own
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
        "lmms_eval.llm_judge); remove judge:"),
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
    environment = {k: os.environ.get(k) for k in ("API_TYPE", "LLM_JUDGE_URL")}
    sweep = load_sweep(path)
    js = sweep.evals[0].judge
    assert js is not None and not js.staged
    assert js.model == str(plain / "judge-model") and js.key_path == "evals[0].judge"
    assert {k: os.environ.get(k) for k in environment} == environment
