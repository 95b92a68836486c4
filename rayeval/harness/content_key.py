"""The content key of an ``lm_eval:`` or ``lmms_eval:`` entry's rendering (``render_cache``),
computed without importing lm-eval or lmms-eval, and the files a rendering opened that the key
does not cover.

    key(library, spec, extra)   the library's (and datasets', pyarrow's, jinja2's, Python's)
                                versions, rayeval's rendering code, the entry's settings,
                                every file under include_path, what its YAMLs ``include:`` and
                                ``!function`` from outside it, the local data files they name;
                                NotKeyed (with why) where that cannot say what renders
    Recording / read_elsewhere  the files renderings in this process opened (an audit hook),
                                less those the key covers and the libraries' own
    fingerprint(path)           a file by content (over 1 MiB: size and modification time, as
                                the data sets' fingerprints are), a folder by its listing
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
from dataclasses import asdict

FORMAT = "kept-rendering-v1"
SMALL = 1 << 20                   # files up to this size are fingerprinted by their content
MAX_FILES = 20_000                # a folder with more is not keyed (rendered every run)
# datasets' packaged builders: a dataset_path of one of these reads data_files, not the Hub
BUILDERS = {"json", "csv", "parquet", "text", "arrow", "pandas", "imagefolder", "audiofolder",
            "videofolder", "webdataset", "xml", "sql"}
# A chat template's tokenizer: the files of the folder it is loaded from
TOKENIZER_FILES = ("tokenizer", "special_tokens_map", "added_tokens", "chat_template", "vocab",
                   "merges", "spiece", "sentencepiece", "config.json")
_HERE = os.path.dirname(os.path.abspath(__file__))
CODE = tuple(os.path.join(_HERE, f) for f in ("render.py", "requests.py", "groups.py",
                                               "store.py", "render_cache.py", "content_key.py",
                                               "entries.py")) + tuple(
    os.path.join(os.path.dirname(_HERE), "lmms", f)
    for f in ("render.py", "requests.py", "entries.py", "judge_server.py"))
VERSIONS = {"lm-eval": ("lm_eval", "datasets", "pyarrow", "jinja2"),
            "lmms-eval": ("lmms_eval", "datasets", "pyarrow", "jinja2", "pillow")}


class NotKeyed(Exception):
    """The entry's rendering cannot be keyed by content (the reason, in words)."""


# --- fingerprints -----------------------------------------------------------------------------

def fingerprint(path: str) -> str:
    """A file by its content (over ``SMALL``: size and modification time); a folder by its
    files' (names, sizes, modification times); a missing path as missing."""
    try:
        st = os.stat(path)
    except OSError:
        return "missing"
    if os.path.isdir(path):
        parts = []
        for name, sub in _walk(path, ()):
            try:
                s = os.stat(sub)
            except OSError:
                continue
            parts.append(f"{name}:{s.st_size}:{s.st_mtime_ns}")
        return "dir:" + hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]
    if st.st_size > SMALL:
        return f"stat:{st.st_size}:{st.st_mtime_ns}"
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            h.update(f.read())
    except OSError:
        return "unreadable"
    return h.hexdigest()[:32]


def _walk(root: str, skip: tuple[str, ...]):
    """(path relative to ``root``, path) of every file under ``root``, sorted, leaving out
    ``__pycache__``, hidden entries, lock files and the folders in ``skip``; NotKeyed past
    ``MAX_FILES``."""
    found = []
    for here, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith(".")
                         and os.path.join(here, d) not in skip)
        for name in files:
            if name.startswith(".") or name.endswith((".pyc", ".lock")):
                continue
            path = os.path.join(here, name)
            found.append((os.path.relpath(path, root), path))
            if len(found) > MAX_FILES:
                raise NotKeyed(f"more than {MAX_FILES} files under {root}")
    return sorted(found)


# --- the YAMLs ---------------------------------------------------------------------------------

class _Tagged(str):
    """A YAML scalar with a tag (lm-eval's ``!function utils.fn``)."""
    tag = ""


def _yaml_loader():
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    def tagged(loader, suffix, node):
        if isinstance(node, yaml.ScalarNode):
            value = _Tagged(loader.construct_scalar(node))
            value.tag = "!" + suffix
            return value
        if isinstance(node, yaml.SequenceNode):
            return loader.construct_sequence(node, deep=True)
        return loader.construct_mapping(node, deep=True)

    Loader.add_multi_constructor("!", tagged)
    return Loader


def _strings(value):
    """Every string in a YAML value (nested), with the key it is under."""
    if isinstance(value, dict):
        for k, v in value.items():
            for key, s in _strings(v):
                yield (key if key is not None else k), s
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)
    elif isinstance(value, str):
        yield None, value


class _Scan:
    """The YAMLs under an include path and what they name outside it."""

    def __init__(self, include_path: str):
        self.root = os.path.abspath(include_path)
        self.loader = _yaml_loader()
        self.configs: list[tuple[str, dict]] = []      # (yaml file, its mapping)
        self.outside: set[str] = set()                 # files named from outside the root
        self.data: set[str] = set()                    # local data files and folders named
        self.skip: set[str] = set()                    # datasets caches (written by a render)

    def read(self, path: str, seen: set[str]) -> None:
        import yaml

        path = os.path.abspath(path)
        if path in seen:
            return
        seen.add(path)
        if not path.startswith(os.path.join(self.root, "")):
            self.outside.add(path)
        try:
            with open(path, "rb") as f:
                config = yaml.load(f, Loader=self.loader)   # noqa: S506 - SafeLoader's subclass
        except (OSError, yaml.YAMLError) as e:
            raise NotKeyed(f"{path} is not read as YAML here ({type(e).__name__})") from None
        if not isinstance(config, dict):
            return
        self.configs.append((path, config))
        base = os.path.dirname(path)
        includes = config.get("include")
        for inc in includes if isinstance(includes, list) else [includes] if includes else []:
            if isinstance(inc, str):
                self.read(inc if os.path.isabs(inc) else os.path.join(base, inc), seen)
        for key, s in _strings(config):
            if isinstance(s, _Tagged) and s.tag == "!function":
                self.function(s, base)
        self.datasets(config, base)

    def function(self, qual: str, base: str) -> None:
        """A ``!function``: ``base/a/b.py`` for ``a.b.fn`` (lm-eval's first choice), else an
        importable module, which only the library's own may be."""
        module, _, _ = str(qual).rpartition(".")
        file = os.path.join(base, module.replace(".", "/") + ".py")
        if os.path.isfile(file):
            if not os.path.abspath(file).startswith(os.path.join(self.root, "")):
                self.outside.add(os.path.abspath(file))
            return
        if module.split(".")[0] not in ("lm_eval", "lmms_eval"):
            raise NotKeyed(f"!function {qual} is a module outside {self.root}")

    def datasets(self, config: dict, base: str) -> None:
        path = config.get("dataset_path")
        kwargs = config.get("dataset_kwargs") if isinstance(config.get("dataset_kwargs"),
                                                            dict) else {}
        cache = kwargs.get("cache_dir")
        if isinstance(cache, str):
            self.skip.add(os.path.abspath(cache if os.path.isabs(cache)
                                          else os.path.join(base, cache)))
        named = [s for key, s in _strings(kwargs) if key != "cache_dir"]
        if any("://" in s for s in named):
            raise NotKeyed("a data file is named by URL")
        if isinstance(path, str):
            named.append(path)
        for s in named:
            for where in _places(s, base, self.root):
                self.data.add(where)
        if isinstance(path, str) and path not in BUILDERS and not _places(path, base, self.root):
            raise NotKeyed(f"dataset_path {path!r} is not local (a Hub data set)")

    def defines(self, name: str) -> bool:
        """Whether some YAML here defines ``name``: a task (``task: NAME``), a group
        (``group: NAME``) or a tag. A name only listed among a group's tasks is not defined
        here (lm-eval would look for it in its own registry: a Hub task)."""
        for _, config in self.configs:
            tags = config.get("tag")
            if name in (config.get("task"), config.get("group")) or name == tags or \
                    (isinstance(tags, list) and name in tags):
                return True
        return False


def _places(s: str, base: str, root: str) -> list[str]:
    """Where a string of a YAML's data set settings is a local file or folder (absolute, or
    relative to the YAML, the include path or the working folder)."""
    if not s or "\n" in s or "://" in s or len(s) > 4096:
        return []
    candidates = [s] if os.path.isabs(s) else [os.path.join(base, s), os.path.join(root, s),
                                               os.path.abspath(s)]
    out = []
    for c in candidates:
        c = os.path.abspath(c)
        if c not in ("/", os.path.expanduser("~")) and os.path.exists(c):
            out.append(c)
    return sorted(set(out))


# --- the key -----------------------------------------------------------------------------------

_VERSIONS: dict[str, str] = {}
SKIP: dict[str, list[str]] = {}        # key -> folders whose files its key covers, or caches
_CODE: list[str] = []


def _versions(library: str) -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist in VERSIONS[library]:
        if dist not in _VERSIONS:
            try:
                _VERSIONS[dist] = version(dist)
            except PackageNotFoundError:
                _VERSIONS[dist] = "-"
        out[dist] = _VERSIONS[dist]
    return out


def _code() -> list[str]:
    if not _CODE:
        _CODE.extend(fingerprint(p) for p in CODE)
    return list(_CODE)


def key(library: str, spec, extra: dict | None = None) -> str:
    """The content key of an entry's rendering (``spec``: its LmEvalSpec or LmmsEvalSpec;
    ``extra``: what else it renders with), or NotKeyed."""
    if spec.include_path is None:
        raise NotKeyed("a task without include_path (a Hub task)")
    root = os.path.abspath(spec.include_path)
    if not os.path.isdir(root):
        raise NotKeyed(f"no folder at {root}")
    scan = _Scan(root)
    seen: set[str] = set()
    for _, path in _walk(root, ()):
        if path.endswith((".yaml", ".yml")):
            scan.read(path, seen)
    if not scan.defines(spec.task):
        raise NotKeyed(f"{spec.task!r} is not defined by {root}'s YAMLs")
    files = {name: fingerprint(path) for name, path in _walk(root, tuple(sorted(scan.skip)))}
    ident = {
        "format": FORMAT, "library": library, "versions": _versions(library),
        "python": list(sys.version_info[:2]), "code": _code(),
        "spec": asdict(spec), "extra": extra or {}, "include_path": root, "files": files,
        "outside": {p: fingerprint(p) for p in sorted(scan.outside)},
        "data": {p: fingerprint(p) for p in sorted(scan.data)
                 if not p.startswith(os.path.join(root, "")) and p != root},
    }
    blob = json.dumps(ident, sort_keys=True, default=str).encode("utf-8")
    k = hashlib.sha256(blob).hexdigest()[:32]
    SKIP[k] = [root, *sorted(scan.skip)]
    return k


def tokenizer_files(folder: str) -> dict:
    """A chat template's tokenizer, as a cached rendering's key holds it: its folder and the
    fingerprints of its tokenizer files (the model's weights left out)."""
    from rayeval.io import paths

    if paths.is_uri(folder):
        raise NotKeyed(f"the tokenizer is at {folder}, not a local folder")
    found = {}
    for name in sorted(os.listdir(folder)):
        if name.startswith(TOKENIZER_FILES):
            found[name] = fingerprint(os.path.join(folder, name))
    return {"tokenizer": os.path.abspath(folder), "files": found}


# --- what rendering read -----------------------------------------------------------------------

_RECORDING = threading.local()
_HOOKED = []


def _hook(event, args):
    if event != "open":
        return
    files = getattr(_RECORDING, "files", None)
    if files is None:
        return
    try:
        path, mode, flags = args[0], args[1], args[2]
        if not isinstance(path, str):
            return
        if mode is None:                  # os.open: by its flags
            if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC):
                return
        elif any(c in str(mode) for c in "wax+"):
            return
        files.add(path)
    except Exception:               # noqa: BLE001 - an audit hook must never raise
        pass


# Every file any rendering in this process opened: a module a task's ``utils.py`` imports
# reads its files once per process, in whichever rendering imported it first, and every later
# rendering depends on them as much (so each cached rendering lists them all).
_READ: set[str] = set()


class Recording:
    """The files renderings in this process opened for reading (``files``), this block's
    included."""

    def __enter__(self):
        if not _HOOKED:
            sys.addaudithook(_hook)
            _HOOKED.append(True)
        self.files = _READ
        _RECORDING.files = self.files
        return self

    def __exit__(self, *exc):
        _RECORDING.files = None
        return False


def read_elsewhere(files, roots: list[str], cache: str | None) -> dict[str, str]:
    """Of the files rendering opened, those no key covers (outside ``roots``: the include
    path; not the libraries' or Python's own, nor the datasets and Hugging Face caches), with
    their fingerprints."""
    import sysconfig

    skip = {os.path.abspath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix,
                                          *filter(None, (sysconfig.get_paths().get(k)
                                                         for k in ("stdlib", "purelib",
                                                                   "platlib"))))}
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "huggingface")
    skip |= {os.path.abspath(p) for p in (home, os.environ.get("HF_DATASETS_CACHE"),
                                          os.environ.get("HF_HUB_CACHE"), cache) if p}
    skip |= {os.path.abspath(p) for p in sys.path if p and "site-packages" in p}
    prefixes = tuple(os.path.join(p, "") for p in skip | {os.path.abspath(r) for r in roots})
    out = {}
    for f in sorted(files):
        path = os.path.abspath(f)
        if path.startswith(prefixes) or path.startswith(("/proc/", "/sys/", "/dev/", "/etc/")):
            continue
        if os.path.isfile(path):
            out[path] = fingerprint(path)
    return out
