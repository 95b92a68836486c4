"""judge.backend: vllm on a real local Ray: the evaluated checkpoints generated on vLLM's
engine, that engine shut down (``VllmBackend.close``), then the judge served by an engine of
its own on each worker, every prompt of the worker in one generate call. The reference is
tests/judge_support.py's plain transformers loop (the hf judge's own reference in
test_judge.py), item by item: response, judge prompt, judge text, score or failure; and the
figures (exact_match, judge, judge_failed).

vLLM's CPU attention takes head sizes of 32 to 512 (multiples of 16 or 32), so the fixture's
checkpoints are rebuilt with heads of 32 and its hand-built judge with heads of 64 (its
attention adds nothing: its output projection is zero). One Ray run of 2 workers with eager
engines, ~1.5 minutes on the 2-core machine.
"""

from __future__ import annotations

import os

import pytest
import torch
import yaml

import judge_support
from support import local_ray, need_vllm

import rayeval
from rayeval.io.store import ResultStore, latest_rows

pytestmark = [pytest.mark.vllm, pytest.mark.ray]

need_vllm()


def servable(paths: dict) -> dict:
    """judge_support's fixture with shapes vLLM's CPU attention serves: the checkpoints
    (random, one seed each) with heads of 32, the judge with heads of 64."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(paths["judge"])
    for c, path in enumerate(paths["checkpoints"]):
        torch.manual_seed(c + 1)
        config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                             max_position_embeddings=256, bos_token_id=0, eos_token_id=0,
                             pad_token_id=0)
        LlamaForCausalLM(config).eval().save_pretrained(path)
    built = judge_support.judge_model(tok)
    built.config.head_dim = 64
    judge = LlamaForCausalLM(built.config).eval()
    given = dict(built.named_parameters())
    with torch.no_grad():
        for name, p in judge.named_parameters():
            p.copy_(given[name]) if given[name].shape == p.shape else p.zero_()
    judge.save_pretrained(paths["judge"])
    return paths


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return servable(judge_support.build(str(tmp_path_factory.mktemp("judged_vllm")),
                                        items=40))


@pytest.fixture(scope="module")
def loop(built):
    return judge_support.plain_loop(built)


@pytest.fixture(scope="module")
def report(built):
    path = judge_support.sweep(built, workers=2, batch_size=16, name="vllm.yaml",
                               output="out", backend="vllm")
    with open(path) as f:
        raw = yaml.safe_load(f)
    raw["model"] = {"backend": "vllm", "vllm": {"enforce_eager": True}}
    with open(path, "w") as f:
        yaml.safe_dump(raw, f, sort_keys=False)
    with local_ray():
        result = rayeval.run(path)
        logs = _worker_logs()
    return result, logs


def _worker_logs() -> str:
    """The text of this Ray session's worker logs (vLLM's lines among them)."""
    import glob

    import ray

    folder = os.path.join(ray._private.worker._global_node.get_session_dir_path(), "logs")
    text = []
    for name in sorted(glob.glob(os.path.join(folder, "worker-*"))):
        with open(name, errors="replace") as f:
            text.append(f.read())
    return "\n".join(text)


def test_the_vllm_judge_equals_the_plain_loop_item_by_item(built, loop, report):
    report, logs = report
    assert not report.failures, report.failures
    # the judge ran on an engine of its own on each worker (vLLM's own log line)
    assert logs.count(f"Starting to load model {built['judge']}") == 2, \
        logs[-3000:]
    store = ResultStore(os.path.join(built["folder"], "out"))
    rows = {(r["checkpoint"], r["metric"]): r for r in latest_rows(store.read())}
    kinds = set()
    for ckpt, items in loop.items():
        judge, failed = rows[(ckpt, "judge")], rows[(ckpt, "judge_failed")]
        assert judge["world_size"] == 2
        table = store.read_samples(judge["cell"], judge["samples"])
        score = "judge_score" if "judge_score" in table.column_names else "judge"
        records = {r["id"]: r for r in table.to_pylist()}
        assert sorted(records) == sorted(items)
        for ident, (response, prompt, said, expected) in items.items():
            rec = records[ident]
            assert rec["response"] == response, ident
            assert rec["judge_prompt"] == prompt, ident
            assert rec["judge_output"] == said, ident
            assert rec[score] == expected, ident
            assert (rec["judge_failed"] is None) == (expected is not None), ident
        scores = [s for *_, s in items.values()]
        kinds |= {"fail" if s is None else s for s in scores}
        given = [s for s in scores if s is not None]
        assert judge["value"] == pytest.approx(sum(given) / len(given), abs=1e-12)
        assert failed["value"] == scores.count(None)
        hits = [float(r.strip() == str(i % 7)) for i, (r, *_) in items.items()]
        assert rows[(ckpt, "exact_match")]["value"] == pytest.approx(sum(hits) / len(hits))
    # the judge's verdicts vary: yes, no and unreadable all occur
    assert kinds == {0.0, 1.0, "fail"}, kinds
