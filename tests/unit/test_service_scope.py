"""Which service a plain `rayeval run` may use (integrations.service_client): one file per
user and Python environment, none under CI unless named, and the words for a client whose
install differs from the service's. The services themselves: tests/e2e/test_service.py."""

import os
import sys

from rayeval.integrations import service_client as sc


def test_each_python_environment_has_its_own_service_file(monkeypatch, tmp_path):
    monkeypatch.delenv(sc.SERVICE_FILE_ENV, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    here = sc.service_file()
    assert os.path.dirname(here) == str(tmp_path / ".rayeval")
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "another-venv"))
    other = sc.service_file()
    assert other != here and os.path.dirname(other) == os.path.dirname(here)
    monkeypatch.setenv(sc.SERVICE_FILE_ENV, str(tmp_path / "mine.json"))
    assert sc.service_file() == str(tmp_path / "mine.json")      # named: that one


def test_under_ci_no_service_is_looked_for_unless_named(monkeypatch, tmp_path):
    looked = []
    monkeypatch.setattr(sc, "local", lambda: looked.append(1))
    monkeypatch.delenv(sc.SERVICE_FILE_ENV, raising=False)
    for value, ci in (("true", True), ("1", True), ("yes", True), ("false", False),
                      ("0", False), ("", False)):
        monkeypatch.setenv("CI", value)
        assert sc.in_ci() is ci, value
    monkeypatch.setenv("CI", "true")
    assert sc.find(None) is None and not looked
    monkeypatch.setenv(sc.SERVICE_FILE_ENV, str(tmp_path / "s.json"))
    sc.find(None)
    assert looked == [1]
    monkeypatch.delenv("CI")
    monkeypatch.delenv(sc.SERVICE_FILE_ENV)
    sc.find(None)
    assert looked == [1, 1]


def test_what_differs_is_said_in_words():
    me = sc.identity()
    assert me["version"] and os.path.isdir(me["where"]) and len(me["source"]) == 16
    assert sc.identity() == me                         # nothing changed: the same
    assert sc.differs(me, me) is None
    assert sc.differs({**me, "version": "0.0.1"}, me).startswith(
        f"it runs rayeval 0.0.1 from {me['where']}, this command rayeval {me['version']}")
    assert "have changed since it started" in sc.differs({**me, "source": "0" * 16}, me)
    older = {**me, "extras": [m for m in me["extras"] if m != "lm_eval"]}
    if "lm_eval" in me["extras"]:
        assert sc.differs(older, me) == "it started without the package(s) lm_eval"
    # a service named by URL (another machine) is asked for the version only
    assert sc.differs({**me, "where": "/opt/image", "source": "1" * 16, "extras": []},
                      {"version": me["version"]}) is None
    assert sc.differs({**me, "version": "9"}, {"version": me["version"]}) == (
        f"it runs rayeval 9 from {me['where']}, this command rayeval {me['version']}")
    both = {**me, "plugins": ["old = gone:register"]}
    mine = {**me, "plugins": ["new = here:register"]}
    assert sc.differs(both, mine) == ("it started without the plugin(s) new = here:register "
                                      "and with the plugin(s) old = gone:register, since "
                                      "removed")


def test_an_edited_or_reinstalled_file_changes_the_source_digest(tmp_path):
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    (tmp_path / "pkg" / "sub" / "b.py").write_text("y = 2\n")
    first = sc.source_digest(str(tmp_path / "pkg"))
    (tmp_path / "pkg" / "__pycache__").mkdir()                     # compiled: not the source
    (tmp_path / "pkg" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0")
    assert sc.source_digest(str(tmp_path / "pkg")) == first
    st = os.stat(tmp_path / "pkg" / "sub" / "b.py")
    os.utime(tmp_path / "pkg" / "sub" / "b.py", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    touched = sc.source_digest(str(tmp_path / "pkg"))              # the same bytes, rewritten
    assert touched != first
    (tmp_path / "pkg" / "a.py").write_text("x = 10\n")
    assert sc.source_digest(str(tmp_path / "pkg")) not in (first, touched)
