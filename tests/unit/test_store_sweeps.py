"""Tier 1: the sweep files a result store keeps (``io.store.sweeps``), on a local folder."""

import os

from rayeval.config.schema import Sweep
from rayeval.io.store import layout as store_layout, sweeps as store_sweeps
from rayeval.io.store import ResultStore
from rayeval.plan.loader import load_sweep
from support import write_sweep

A = "name: t  # the first form\r\nworkers: 1\n"
B = "name: t\nworkers: 2\n"


def kept_files(root) -> list[str]:
    folder = root / "sweeps" / store_layout.sweep_folder("t")
    return sorted(os.listdir(folder))


def test_one_file_per_text_and_the_newest_is_read(tmp_path):
    store = ResultStore(str(tmp_path))
    assert store.sweep_texts() == {} and store.sweep_files() == {}
    path = store.keep_sweep("t", A)
    assert path == f"{tmp_path}/sweeps/{store_layout.sweep_folder('t')}/" \
        f"{store_sweeps.file_name(A)}"
    assert store.sweep_texts() == {"t": A}          # as written, line ends and comments too
    assert store.keep_sweep("t", A) is None          # a re-run of the same file
    assert kept_files(tmp_path) == [store_sweeps.file_name(A)]

    assert store.keep_sweep("t", B) is not None      # an edit adds a file
    assert store.sweep_texts() == {"t": B}
    assert [text for _, text in store.sweep_files()["t"]] == [B, A]
    assert store.keep_sweep("t", A) is not None      # reverted: the older text is newest again
    assert store.sweep_texts() == {"t": A}
    assert kept_files(tmp_path) == sorted(store_sweeps.file_name(t) for t in (A, B))
    assert store.sweep_texts("t") == {"t": A} and store.sweep_texts("other") == {}


def test_each_sweep_its_own_and_odd_names_read_back(tmp_path):
    store = ResultStore(str(tmp_path))
    odd = 'a "sweep"\nwith\u2028 everything / é'
    store.keep_sweep("t", A)
    store.keep_sweep(odd, B)
    assert store.sweep_texts() == {"t": A, odd: B}
    assert store.sweep_texts(odd) == {odd: B}


def test_a_file_without_the_header_and_a_writer_s_temporary_are_skipped(tmp_path):
    store = ResultStore(str(tmp_path))
    store.keep_sweep("t", A)
    folder = tmp_path / "sweeps" / store_layout.sweep_folder("t")
    (folder / "0123456789abcdef.yaml").write_text("name: t\n")
    (folder / ".tmp-1-fedcba9876543210.yaml").write_text("# rayeval: {\"sweep\": \"t\", "
                                                         "\"kept\": \"9999\"}\nhalf")
    assert store.sweep_texts() == {"t": A}


def test_the_rows_readers_and_compaction_do_not_see_the_sweep_files(tmp_path):
    store = ResultStore(str(tmp_path))
    store.keep_sweep("s", A)
    assert store.read().num_rows == 0
    store.write_cell("abc", [{"sweep": "s", "checkpoint": "/c/a.pt", "step": 1, "evaluation": "d",
                              "metric": "accuracy", "value": 0.5, "ci_low": None,
                              "ci_high": None, "num_samples": 10, "world_size": 1,
                              "higher_is_better": True}])
    store.compact()
    assert store.read().column("value").to_pylist() == [0.5]
    assert store.sweep_texts() == {"s": A}


def test_a_loaded_sweep_carries_its_file_s_text_and_one_built_in_python_none(tmp_path):
    path = write_sweep(str(tmp_path))
    with open(path, "a", newline="") as f:
        f.write("# a comment\r\n")                   # kept as written, CR too
    with open(path, "rb") as f:
        written = f.read()
    sweep = load_sweep(path)
    assert sweep.text.encode("utf-8") == written
    assert sweep.replace(workers=2).text == sweep.text
    assert Sweep(name="x", model=sweep.model, checkpoints=("a",), evals=sweep.evals,
                 workers=1, use_gpu=False, output=str(tmp_path), base_dir=str(tmp_path)).text \
        == ""
