"""A process that runs several sweeps imports each sweep's own module from that sweep's folder:
two folders' ``my_models`` (a notebook running two projects' sweeps, a service, a test run)
and a file edited between two runs. Without the rule the first folder's module answered for
both (found when the suite ran in another order: a unit test's ``my_models`` built a Linear
for the digits example's checkpoints)."""

import os
import sys

import pytest

from rayeval.io.model import import_callable


def write(folder, value: int) -> None:
    folder.mkdir(exist_ok=True)
    (folder / "own_mod_probe.py").write_text(f"def build():\n    return {value}\n")


@pytest.fixture
def clean(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield
    for name in [n for n in sys.modules if n.startswith("own_mod_probe")]:
        del sys.modules[name]


def test_each_folder_gets_its_own_module_of_a_shared_name(tmp_path, clean):
    write(tmp_path / "a", 1)
    write(tmp_path / "b", 2)
    assert import_callable("own_mod_probe:build", str(tmp_path / "a"))() == 1
    assert import_callable("own_mod_probe:build", str(tmp_path / "b"))() == 2
    assert import_callable("own_mod_probe:build", str(tmp_path / "a"))() == 1
    assert sys.path[0] == str(tmp_path / "a")      # the sweep's folder first, once
    assert sys.path.count(str(tmp_path / "a")) == 1


def test_an_edited_file_is_imported_again(tmp_path, clean):
    write(tmp_path / "a", 1)
    assert import_callable("own_mod_probe:build", str(tmp_path / "a"))() == 1
    write(tmp_path / "a", 3)
    path = tmp_path / "a" / "own_mod_probe.py"
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))   # a later edit, surely
    assert import_callable("own_mod_probe:build", str(tmp_path / "a"))() == 3
    module = sys.modules["own_mod_probe"]
    assert import_callable("own_mod_probe:build", str(tmp_path / "a"))() == 3
    assert sys.modules["own_mod_probe"] is module       # unchanged: not imported again


def test_a_module_only_on_the_path_is_left_as_it_is(tmp_path, clean):
    write(tmp_path / "lib", 5)
    sys.path.insert(0, str(tmp_path / "lib"))
    (tmp_path / "sweep").mkdir()
    assert import_callable("own_mod_probe:build", str(tmp_path / "sweep"))() == 5
    module = sys.modules["own_mod_probe"]
    assert import_callable("own_mod_probe:build", str(tmp_path / "sweep"))() == 5
    assert sys.modules["own_mod_probe"] is module
