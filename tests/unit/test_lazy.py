"""rayeval.lazy: a module named at the top of another, imported at its first use (a cached run
never imports torch: issue 58)."""

import pickle
import sys

from rayeval.lazy import lazy_module


def test_a_lazy_module_is_imported_at_first_use_and_takes_its_stand_ins_place(tmp_path,
                                                                            monkeypatch):
    (tmp_path / "lazy_probe_mod.py").write_text("VALUE = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "lazy_probe_mod", raising=False)
    first, second = {}, {}
    for namespace in (first, second):
        exec("from rayeval.lazy import lazy_module\nm = lazy_module('lazy_probe_mod')",
             namespace)
    assert "lazy_probe_mod" not in sys.modules, "named, not imported"
    stand_in = first["m"]
    assert stand_in is second["m"] and type(stand_in).__name__ == "_Lazy"
    assert pickle.loads(pickle.dumps(stand_in)) is sys.modules["lazy_probe_mod"]
    assert first["m"].VALUE == 3                                  # the first read imports it
    real = sys.modules["lazy_probe_mod"]
    assert first["m"] is real and second["m"] is real, "both namespaces now hold the module"
    assert stand_in.VALUE == 3             # a stand-in kept elsewhere still reads the module
    real.VALUE = 4
    assert stand_in.VALUE == 4             # ... the module's own attribute, never a copy
    monkeypatch.delitem(sys.modules, "lazy_probe_mod")


def test_an_imported_module_is_returned_itself():
    assert lazy_module("json") is sys.modules.setdefault("json", __import__("json"))
