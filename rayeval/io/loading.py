"""Fitting a checkpoint's tensors to the sweep's model, and loading them lean.

Matching: the model's state dict is looked for under a key path of the checkpoint (the sweep's
``checkpoint.key``, else none, ``model``, ``state_dict``, ``model_state_dict``, ``module``,
``ema``), with the ``checkpoint.strip_prefix`` of the sweep, DDP's ``module.``, torch.compile's
``_orig_mod.`` and a LightningModule's attribute prefix (``model.``, ``net.``...) removed where
that makes more of the model's keys match. The match must then be exact: missing, unexpected
and mis-shaped keys are an error that names them.

Lean loading: the model is built on the meta device and the checkpoint's (memory-mapped)
tensors are assigned to it (``load_state_dict(assign=True)``), so the weights are never held
twice; only then does the model move to the worker's device.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Mapping

from rayeval import compat
from rayeval.io import layouts
from rayeval.io.checkpoints import parse_epoch, parse_step
from rayeval.config.schema import CheckpointSpec
from rayeval import errors
from rayeval.errors import CheckpointError
from rayeval.lazy import lazy_module

torch = lazy_module("torch")        # imported on first use (rayeval.lazy)

WRAPPER_KEYS = ("model", "state_dict", "model_state_dict", "module", "ema")
_PREFIXES = ("module.", "_orig_mod.")
_WRAPPED = "module./_orig_mod."      # in Match.stripped: strip_wrappers was applied
PREFIX_SOURCES = {"module.": "DDP", "_orig_mod.": "torch.compile"}


@functools.cache
def dtypes() -> dict[str, torch.dtype]:
    """``model.dtype``'s names and their torch dtypes."""
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
            "float64": torch.float64}


@dataclass
class Match:
    mapping: dict[str, str]           # checkpoint key -> model key
    wrapper: str                      # the key path the state dict was under ("" for none)
    stripped: list[str] = field(default_factory=list)   # prefixes removed


def _unwrap(key: str) -> tuple[str, set[str]]:
    """A key without DDP's ``module.`` and torch.compile's ``_orig_mod.`` wrappers, and which
    of them it had."""
    found = set()
    changed = True
    while changed:
        changed = False
        for prefix in _PREFIXES:
            if key.startswith(prefix):
                key = key[len(prefix):]
                found.add(prefix)
                changed = True
    if "._orig_mod." in key:          # a compiled submodule
        found.add("_orig_mod.")
    return key.replace("._orig_mod.", "."), found


def strip_wrappers(key: str) -> str:
    """Drop DDP's ``module.`` and torch.compile's ``_orig_mod.`` wrappers from a key."""
    return _unwrap(key)[0]


def wrappers_in(keys) -> list[str]:
    """The wrappers ``strip_wrappers`` would remove from these keys, in ``_PREFIXES`` order."""
    found = set().union(*(_unwrap(k)[1] for k in keys))
    return [p for p in _PREFIXES if p in found]


strip_prefixes = strip_wrappers     # the name earlier versions exported


def _common_first(keys: list[str]) -> str | None:
    firsts = {k.split(".", 1)[0] for k in keys if "." in k}
    if len(firsts) == 1 and all("." in k for k in keys):
        return firsts.pop() + "."
    return None


def match(keys, model_keys, spec: CheckpointSpec = CheckpointSpec()) -> Match:
    """The best mapping of checkpoint keys onto model keys (see the module docstring)."""
    model_keys = set(model_keys)
    keys = list(keys)
    if spec.key:      # the user said where the state dict is: look nowhere else
        wrappers = [spec.key.strip(".") + "."]
        if not any(k.startswith(wrappers[0]) for k in keys):
            raise CheckpointError(f"checkpoint.key: nothing under {spec.key!r} in the "
                                  "checkpoint; `rayeval inspect` shows its keys")
    else:
        wrappers = [""] + [w + "." for w in WRAPPER_KEYS]
    best: tuple[int, int, Match] | None = None
    for order, wrapper in enumerate(wrappers):
        inside = [k for k in keys if k.startswith(wrapper)]
        if not inside:
            continue
        for candidate in _transforms([k[len(wrapper):] for k in inside], spec):
            mapping = dict(zip(inside, candidate[0]))
            # more matched keys first; then fewer prefixes stripped; then the wrapper order
            score = (len(model_keys & set(mapping.values())), -len(candidate[1]), -order)
            if best is None or score > best[0]:
                best = (score, order, Match(mapping, wrapper.rstrip("."), candidate[1]))
    if best is None:
        return Match({k: k for k in keys}, "")
    return best[2]


def _transforms(keys: list[str], spec: CheckpointSpec):
    """(transformed keys, prefixes removed), from the least change to the most."""
    out = [(keys, [])]
    if spec.strip_prefix:
        p = spec.strip_prefix
        out.append(([k[len(p):] if k.startswith(p) else k for k in keys], [p]))
    for base, removed in list(out):
        wrapped = [strip_wrappers(k) for k in base]
        if wrapped != base:
            out.append((wrapped, removed + [_WRAPPED]))
    for base, removed in list(out):
        first = _common_first(base)
        if first:
            out.append(([k[len(first):] for k in base], removed + [first]))
            again = [strip_wrappers(k[len(first):]) for k in base]
            out.append((again, removed + [first, _WRAPPED]))
    return out


def aliases(model: torch.nn.Module) -> dict[str, str]:
    """State-dict keys that are one tensor under several names (tied weights: a language
    model's output layer is its input embedding), each mapped to the first name of its group.
    Checkpoints often hold only one of the names (Hugging Face's save_pretrained does)."""
    groups: dict[int, list[str]] = {}
    for key, t in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(t), []).append(key)
    return {k: names[0] for names in groups.values() if len(names) > 1 for k in names}


def satisfied_by_ties(missing: set[str], present: set[str], tied: Mapping[str, str]) -> set[str]:
    """The missing keys a tied name that is present stands in for."""
    groups: dict[str, set[str]] = {}
    for k, root in tied.items():
        groups.setdefault(root, set()).add(k)
    return {k for k in missing if k in tied and groups[tied[k]] & present}


def fit_problems(shapes: Mapping[str, tuple], expected: Mapping[str, tuple],
                 tied: Mapping[str, str] = {}) -> list[str]:
    """What keeps a checkpoint from fitting: missing, unexpected, mis-shaped keys (a missing
    tied name is not missing when another name of its tensor is there)."""
    missing = set(expected) - set(shapes)
    missing = sorted(missing - satisfied_by_ties(missing, set(shapes), tied))
    unexpected = sorted(set(shapes) - set(expected))
    mismatched = sorted(k for k in set(expected) & set(shapes)
                        if tuple(shapes[k]) != tuple(expected[k]))
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing key(s): {few(missing)}")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected key(s): {few(unexpected)}")
    if mismatched:
        shown = [f"{k} {list(shapes[k])} vs model {list(expected[k])}" for k in mismatched]
        parts.append(f"{len(mismatched)} shape mismatch(es): {few(shown)}")
    return parts


def check_fit(path: str, shapes: Mapping[str, tuple], model: torch.nn.Module) -> None:
    """Raise a CheckpointError naming every missing, unexpected and mis-shaped key."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    parts = fit_problems(shapes, expected, aliases(model))
    if parts:
        raise CheckpointError(f"{path}: does not fit the model: " + "; ".join(parts)
                              + "; check model.factory and model.kwargs")


def few(items: list[str], n: int = 5) -> str:
    shown = ", ".join(items[:n])
    return shown + (f" and {len(items) - n} more" if len(items) > n else "")


def model_state(raw: layouts.Raw, model: torch.nn.Module, spec: CheckpointSpec = CheckpointSpec()
                ) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under the model's keys, checked to fit it exactly."""
    expected = model.state_dict()
    shapes, back = renamed(raw.shapes, model)
    try:
        m = match(shapes, expected, spec)
    except CheckpointError as e:
        raise CheckpointError(f"{raw.path}: {e.message}") from None
    selected = {back.get(ck, ck): mk for ck, mk in m.mapping.items()}
    check_fit(raw.path, {mk: raw.shapes[ck][0] for ck, mk in selected.items()}, model)
    if raw.tensors is None:
        tensors = layouts.read_dcp_tensors(raw, list(selected))
    else:
        tensors = raw.tensors
    return {mk: tensors[ck] for ck, mk in selected.items()}


def renamed(shapes: Mapping, model: torch.nn.Module) -> tuple[dict, dict]:
    """A checkpoint's keys as transformers renames them for this model (``hf.key_renamer``),
    and the way back to the stored keys; unchanged for other models."""
    from rayeval.io import hf

    rename = hf.key_renamer(model)
    if rename is None:
        return dict(shapes), {}
    back = {rename(k): k for k in shapes}
    return {k: shapes[v] for k, v in back.items()}, {k: v for k, v in back.items() if k != v}


def fit_error(path: str, model: torch.nn.Module, spec: CheckpointSpec = CheckpointSpec()
              ) -> str | None:
    """Why the checkpoint at a local path cannot load into ``model`` (built on the meta device:
    only names and shapes are compared, from the checkpoint's headers or memory-mapped
    tensors), or None when it fits."""
    try:
        raw = layouts.read(path, spec.trust_pickle)
        shapes, _ = renamed(raw.shapes, model)
        m = match(shapes, model.state_dict(), spec)
        check_fit(raw.path, {mk: shapes[ck][0] for ck, mk in m.mapping.items()}, model)
    except CheckpointError as e:
        return e.message if e.message.startswith(path) else f"{path}: {e.message}"
    return None


def load_into(model: torch.nn.Module, path: str, spec: CheckpointSpec = CheckpointSpec()) -> str:
    """Copy the checkpoint at a local path into an existing model (strictly); its layout."""
    raw = layouts.read(path, spec.trust_pickle)
    state = model_state(raw, model, spec)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise errors.wrap(e, CheckpointError, f"{path}: cannot load into the model",
                          location=path) from None
    return raw.layout


class LeanLoader:
    """Builds the model once per checkpoint with its parameters on the meta device and assigns
    the checkpoint's tensors to it, so weights are never held twice.

    ``factory()`` builds the sweep's model (called under the meta device; buffers outside the
    state dict get the values of one real build); ``builder(path)`` instead builds the model
    of one checkpoint with its parameters already on the meta device (Hugging Face folders:
    each has its own config)."""

    def __init__(self, factory: Callable[[], torch.nn.Module] | None, device: torch.device,
                 dtype: torch.dtype | None = None, spec: CheckpointSpec = CheckpointSpec(),
                 builder: Callable[[str], torch.nn.Module] | None = None):
        self.factory = factory
        self.builder = builder
        self.device = device
        self.dtype = dtype
        self.spec = spec
        self.extra_buffers = {}
        if builder is not None:
            return
        with torch.device("meta"):
            meta = factory()
        persistent = set(meta.state_dict())
        if any(n not in persistent for n, _ in meta.named_buffers()):
            # Buffers outside the state dict (non-persistent) are not in checkpoints: keep the
            # values the factory gives them, from one real build.
            real = factory()
            self.extra_buffers = {n: b.detach().clone() for n, b in real.named_buffers()
                                  if n not in persistent}
            del real

    def meta(self, path: str) -> torch.nn.Module:
        if self.builder is not None:
            return self.builder(path)
        with torch.device("meta"):
            return self.factory()

    def load(self, path: str, raw: layouts.Raw | None = None
             ) -> tuple[torch.nn.Module, layouts.Raw]:
        """The model with the checkpoint at ``path`` loaded (``raw``: already read)."""
        if raw is None:
            raw = layouts.read(path, self.spec.trust_pickle)
        model = self.meta(path)
        dtypes = {n: t.dtype for n, t in model.state_dict().items()}
        tied = aliases(model)
        state = model_state(raw, model, self.spec)
        for k, t in state.items():
            want = dtypes[k]
            if t.is_floating_point() and self.dtype is not None:
                want = self.dtype
            if t.dtype != want:
                state[k] = t.to(want)
        try:
            missing = model.load_state_dict(state, strict=False, assign=True).missing_keys
        except RuntimeError as e:
            raise errors.wrap(e, CheckpointError, f"{path}: cannot load into the model",
                              location=path) from None
        _tie(model, tied, set(state))
        if set(missing) - satisfied_by_ties(set(missing), set(state), tied):   # fit checked: a bug
            raise CheckpointError(f"{path}: keys left unloaded: {few(sorted(missing))}")
        for name, value in self.extra_buffers.items():
            module_name, _, buffer_name = name.rpartition(".")
            module = model.get_submodule(module_name) if module_name else model
            module.register_buffer(buffer_name, value.clone(), persistent=False)
        return model.to(self.device).eval(), raw


def _tie(model: torch.nn.Module, tied: Mapping[str, str], loaded: set[str]) -> None:
    """Point every name of a tied tensor at the one that was loaded: assigning replaced the
    loaded name's parameter, and the tie must hold again."""
    groups: dict[str, list[str]] = {}
    for k, root in tied.items():
        groups.setdefault(root, []).append(k)
    for names in groups.values():
        source = next((n for n in names if n in loaded), None)
        if source is None:
            continue
        value = model.get_parameter(source) if _is_parameter(model, source) else \
            model.get_buffer(source)
        for n in names:
            if n != source:
                module_name, _, attr = n.rpartition(".")
                setattr(model.get_submodule(module_name) if module_name else model, attr, value)


def _is_parameter(model: torch.nn.Module, name: str) -> bool:
    module_name, _, attr = name.rpartition(".")
    return attr in compat.own_parameters(model.get_submodule(module_name) if module_name
                                         else model)


def prefix_label(prefix: str, spec: CheckpointSpec = CheckpointSpec()) -> str:
    """A stripped prefix with where it comes from: ``module. (DDP)``."""
    if prefix in PREFIX_SOURCES:
        why = PREFIX_SOURCES[prefix]
    elif prefix == spec.strip_prefix:
        why = "checkpoint.strip_prefix"
    else:
        why = "shared by every key, e.g. a LightningModule attribute"
    return f"{prefix} ({why})"


def _replay(keys: list[str], stripped: list[str]) -> list[str]:
    """``Match.stripped`` with its wrapper step named by the wrappers the keys really had (none
    when it changed nothing), by applying the steps to the keys in order."""
    out = []
    for step in stripped:
        if step == _WRAPPED:
            out += wrappers_in(keys)
            keys = [strip_wrappers(k) for k in keys]
        else:
            out.append(step)
            keys = [k[len(step):] if k.startswith(step) else k for k in keys]
    return list(dict.fromkeys(out))


def _ddp_wrapper(wrapper: str | None, keys, spec: CheckpointSpec) -> bool:
    """Whether the state dict "under module" is DDP's ``module.`` prefix: flattened keys cannot
    tell ``{"module": sd}`` from a DDP model's own state dict, and ``match`` prefers the wrapper
    (fewer prefixes). Reported as the prefix when it holds every tensor and the user did not
    name it (checkpoint.key), so inspect says the same with and without a model."""
    return wrapper == "module" and not spec.key and all(k.startswith("module.") for k in keys)


def _prefixes(raw: layouts.Raw, model: torch.nn.Module | None, spec: CheckpointSpec
              ) -> tuple[str | None, list[str], Match | None]:
    """(the key the state dict is under, the prefixes stripped to reach the model's keys, the
    match). Without a model: the wrapper found by name, and what ``match``'s fixed rules (DDP's
    ``module.``, torch.compile's ``_orig_mod.``) would strip; a shared first part such as a
    LightningModule attribute is stripped only when a model's keys show it is not part of the
    model."""
    keys = list(raw.shapes)
    m = None
    if model is None:
        groups = {k.split(".", 1)[0] for k in keys if "." in k}
        wrapper = spec.key or next((w for w in WRAPPER_KEYS if w in groups), None)
        stripped = [_WRAPPED]
    else:
        m = match(raw.shapes, model.state_dict(), spec)
        wrapper, stripped = m.wrapper or None, m.stripped
    if _ddp_wrapper(wrapper, keys, spec):
        wrapper, stripped = None, ["module."] + stripped
    if wrapper:
        cut = wrapper.strip(".") + "."
        keys = [k[len(cut):] for k in keys if k.startswith(cut)]
    return wrapper, _replay(keys, stripped), m


def describe(path: str, model: torch.nn.Module | None = None,
             spec: CheckpointSpec = CheckpointSpec()) -> dict:
    """What ``rayeval inspect`` shows: the layout, tensors, parameters, dtypes, the step and
    epoch, where the state dict is and the prefixes stripped from its keys (see ``_prefixes``),
    and with a model, how its keys map and whether it fits."""
    import math
    from collections import Counter

    raw = layouts.read(path, spec.trust_pickle)
    dtypes = Counter()
    params = 0
    size = 0
    for shape, dtype in raw.shapes.values():
        n = math.prod(shape)
        dtypes[str(dtype).replace("torch.", "")] += n
        params += n
        size += n * torch.empty((), dtype=dtype).element_size()
    groups = Counter(k.split(".", 1)[0] if "." in k else "(top level)" for k in raw.shapes)
    wrapper, prefixes, m = _prefixes(raw, model, spec)
    info = {
        "path": path, "layout": raw.layout, "files": list(raw.files), "tensors": len(raw.shapes),
        "parameters": params, "bytes": size, "dtypes": dict(dtypes),
        "step": raw.step if raw.step is not None else parse_step(path),
        "step_from": "file" if raw.step is not None else "name",
        "epoch": parse_epoch(path),
        "key_groups": dict(groups.most_common(8)),
        "wrapper": wrapper, "prefixes_stripped": prefixes,
    }
    if model is None:
        return info
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    mapped = {mk: raw.shapes[ck][0] for ck, mk in m.mapping.items()}
    tied = aliases(model)
    problems = fit_problems(mapped, expected, tied)
    missing = set(expected) - set(mapped)
    info.update({
        "fits": not problems, "problems": problems,
        "missing": sorted(missing - satisfied_by_ties(missing, set(mapped), tied)),
        "unexpected": sorted(set(mapped) - set(expected)),
        "mismatched": sorted(k for k in set(expected) & set(mapped)
                             if tuple(mapped[k]) != expected[k]),
    })
    return info
