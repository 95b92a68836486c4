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


def test_a_factory_its_file_defines_is_digested_without_running_the_file(tmp_path, clean):
    """A cell's key holds a digest of the factory's file. A fully cached run reads it without
    importing the module (and the torch it imports: issue 58); a name the file takes from
    elsewhere, or wraps in a decorator, is still found by importing, as before."""
    import hashlib

    from rayeval.io.model import source_digest

    def digest(path):
        return hashlib.sha256(path.read_bytes()).hexdigest()[:16]

    ran = tmp_path / "ran"
    (tmp_path / "own_mod_probe.py").write_text(
        f"open({str(ran)!r}, 'a').write('plain ')\ndef build():\n    return 1\n")
    (tmp_path / "own_mod_probe_elsewhere.py").write_text(
        f"open({str(ran)!r}, 'a').write('elsewhere ')\ndef build():\n    return 2\n")
    (tmp_path / "own_mod_probe_reexport.py").write_text(
        f"open({str(ran)!r}, 'a').write('reexport ')\n"
        "from own_mod_probe_elsewhere import build\n")
    (tmp_path / "own_mod_probe_wrapped.py").write_text(
        f"import functools\nopen({str(ran)!r}, 'a').write('wrapped ')\n"
        "@functools.lru_cache\ndef build():\n    return 3\n")
    (tmp_path / "own_mod_probe_rebound.py").write_text(
        f"open({str(ran)!r}, 'a').write('rebound ')\ndef build():\n    return 4\n"
        "if True:\n    from own_mod_probe_elsewhere import build\n")
    folder = str(tmp_path)
    assert source_digest("own_mod_probe:build", folder) == digest(tmp_path / "own_mod_probe.py")
    assert not ran.exists(), "the file defines build: read, never run"
    assert source_digest("own_mod_probe_reexport:build", folder) == \
        digest(tmp_path / "own_mod_probe_elsewhere.py")          # the file build comes from
    assert source_digest("own_mod_probe_wrapped:build", folder) == \
        digest(tmp_path / "own_mod_probe_wrapped.py")
    assert source_digest("own_mod_probe_rebound:build", folder) == \
        digest(tmp_path / "own_mod_probe_elsewhere.py")          # rebound: found by importing
    assert ran.read_text().split() == ["reexport", "elsewhere", "wrapped", "rebound"]
