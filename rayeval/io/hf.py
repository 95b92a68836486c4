"""Hugging Face folders: models built from their config.json, and their tokenizers.

A checkpoint folder with a ``config.json`` (and ``model.safetensors``, sharded safetensors or
``pytorch_model.bin``) needs no ``model.factory``: the model is built from the folder's config
with ``transformers``' causal-LM auto class, parameters on the meta device (no memory, no
random init) and buffers that are not in checkpoints (rotary frequencies) real, then loaded
lean like any checkpoint (``loading.LeanLoader``). The tokenizer comes from the folder or from
``model.tokenizer``.

``transformers`` is an optional extra: nothing here imports it at module level, and a sweep
that needs it without it installed fails in one line naming the extra.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
from dataclasses import dataclass
from typing import Any

from rayeval import compat
from rayeval.io import paths
from rayeval import errors
from rayeval.errors import CheckpointError, SpecError
from rayeval.lazy import lazy_module

torch = lazy_module("torch")        # imported on first use (rayeval.lazy)

CONFIG = "config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                   "spiece.model", "special_tokens_map.json", "merges.txt",
                   "added_tokens.json")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".distcp", ".ckpt")
DEFAULT_MAX_LENGTH = 2048               # lm-evaluation-harness's, when nothing says otherwise
_HUGE = 10 ** 18                        # a tokenizer's model_max_length when it is unset


def require() -> Any:
    """The ``transformers`` module, or a SpecError naming the extra that installs it."""
    try:
        import transformers
    except ImportError:
        raise SpecError("Hugging Face checkpoints and text tasks need transformers: "
                        "pip install 'rayeval[hf]'") from None
    return transformers


def available() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformers") is not None


def describe(folder: str) -> dict:
    """What ``rayeval inspect`` shows of a Hugging Face folder, from its config.json as JSON
    (no transformers needed): the model type, its context and vocabulary, the tokenizer files."""
    import json

    try:
        with open(os.path.join(folder, CONFIG), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{folder}: cannot read {CONFIG}: {e}") from None
    text = config.get("text_config") or config
    context = next((text[k] for k in ("n_positions", "max_position_embeddings", "n_ctx")
                    if isinstance(text.get(k), int)), None)
    return {"model_type": config.get("model_type", "?"),
            "architectures": list(config.get("architectures") or []),
            "vocab_size": text.get("vocab_size"), "context": context,
            "tokenizer_files": [n for n in TOKENIZER_FILES
                                if os.path.exists(os.path.join(folder, n))]}


def is_folder(location: str) -> bool:
    """Whether a checkpoint location is a Hugging Face folder (holds a config.json)."""
    if paths.is_uri(location):
        import pyarrow.fs as pafs

        fs, path = paths.filesystem(location)
        return fs.get_file_info(f"{path.rstrip('/')}/{CONFIG}").type == pafs.FileType.File
    return os.path.isfile(os.path.join(location, CONFIG))


def has_tokenizer(folder: str) -> bool:
    return any(os.path.exists(os.path.join(folder, n)) for n in TOKENIZER_FILES)


def small_files(location: str, cache_dir: str) -> str:
    """A local folder with a checkpoint folder's config and tokenizer files (not its weights):
    what the driver needs of a remote folder before any worker fetches the whole of it."""
    if not paths.is_uri(location):
        return location
    import pyarrow.fs as pafs

    fs, path = paths.filesystem(location)
    digest = hashlib.sha256(location.encode()).hexdigest()[:16]
    target = os.path.join(cache_dir, "small-" + digest)
    os.makedirs(target, exist_ok=True)
    for info in fs.get_file_info(pafs.FileSelector(path.rstrip("/"))):
        name = info.path.rsplit("/", 1)[-1]
        if info.type == pafs.FileType.File and not name.endswith(WEIGHT_SUFFIXES):
            with fs.open_input_stream(info.path) as src, open(os.path.join(target, name),
                                                             "wb") as dst:
                dst.write(src.read())
    return target


@contextlib.contextmanager
def _parameters_on_meta():
    """Modules built inside get their parameters on the meta device as they are registered
    (allocated empty, never initialised), while buffers computed in ``__init__`` (rotary
    frequencies, masks) stay real: those are not in checkpoints."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            own = compat.own_parameters(module)
            own[name] = torch.nn.Parameter(own[name].to("meta"),
                                           requires_grad=own[name].requires_grad)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


class Builder:
    """Causal LMs from Hugging Face folders' configs, one build per distinct config."""

    def __init__(self):
        self._configs: dict[str, Any] = {}

    def config(self, folder: str):
        path = os.path.join(folder, CONFIG)
        try:
            with open(path, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
        except OSError:
            raise CheckpointError(f"{folder}: no {CONFIG}: not a Hugging Face folder; set "
                                  "model.factory for other checkpoints") from None
        if digest not in self._configs:
            transformers = require()
            try:
                self._configs[digest] = transformers.AutoConfig.from_pretrained(folder)
            except Exception as e:       # noqa: BLE001 - a config transformers cannot read
                raise errors.wrap(e, CheckpointError, f"{path}: transformers cannot read it",
                                  typed=True, location=path) from None
        return self._configs[digest]

    def meta(self, folder: str) -> torch.nn.Module:
        """The folder's model, parameters on the meta device, in eval mode."""
        config = self.config(folder)
        transformers = require()
        # Image-text-to-text models (Idefics3, LLaVA, Qwen2-VL, ...) are not causal-LM auto
        # classes: their own auto class builds them, with the vision tower.
        auto = (transformers.AutoModelForImageTextToText
                if is_vision_type(getattr(config, "model_type", None))
                else transformers.AutoModelForCausalLM)
        try:
            with _parameters_on_meta():
                model = auto.from_config(config)
        except ValueError as e:
            raise errors.wrap(e, CheckpointError, f"{folder}: {CONFIG} is not a causal "
                              "language model transformers knows", location=folder) from None
        return model.eval()


def is_vision_type(kind: str | None) -> bool:
    """Whether transformers builds a ``model_type`` with ``AutoModelForImageTextToText`` (a
    vision-language model: ``io.vision``)."""
    if not kind:
        return False
    require()
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return kind in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def key_renamer(model: torch.nn.Module):
    """How transformers renames a folder's saved keys to its model's keys when it loads it
    (``save_pretrained`` writes some families, LLaVA among them, under their original names:
    ``language_model.model.*`` for ``model.language_model.*``), as a function of a key; None
    for a model with no renaming (or not a transformers model). Renames only: a folder that
    needs transformers' other weight conversions (fused experts, ...) fails the key check."""
    if not hasattr(model, "base_model_prefix") or not hasattr(model, "config"):
        return None
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key
    except ImportError:                   # an older transformers: keys as they are
        return None
    renamings = [c for c in get_model_conversion_mapping(model)
                 if isinstance(c, WeightRenaming)]
    if not renamings:
        return None
    known = set(model.state_dict())
    prefix = model.base_model_prefix

    def rename(key: str) -> str:
        if key in known:
            return key
        return rename_source_key(key, renamings, [], prefix, None)[0]

    return rename


def max_length(model: torch.nn.Module | None, tokenizer, configured: int | None) -> int:
    """The model's context in tokens, as lm-evaluation-harness resolves it: the sweep's
    ``model.max_length``, else the config's n_positions / max_position_embeddings / n_ctx
    (its text_config first), else the tokenizer's model_max_length when set, else 2048."""
    if configured:
        return configured
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    for attr in ("n_positions", "max_position_embeddings", "n_ctx"):
        value = getattr(config, attr, None)
        if value is not None:
            return int(value)
    limit = getattr(tokenizer, "model_max_length", None)
    if limit is not None and limit < _HUGE:
        return int(limit)
    return DEFAULT_MAX_LENGTH


def tokenizer_digest(folder: str) -> str:
    """The identity of a folder's tokenizer files: checkpoints that share it share one
    tokenization of every data set."""
    return files_digest(folder, TOKENIZER_FILES)


def files_digest(folder: str, names, seed: bytes = b"") -> str:
    """A digest of ``seed`` and, in order, the name and bytes of each of ``names`` that is a
    file in ``folder`` (a missing one counts as nothing)."""
    h = hashlib.sha256(seed)
    for name in names:
        p = os.path.join(folder, name)
        if os.path.isfile(p):
            h.update(name.encode())
            with open(p, "rb") as f:
                h.update(f.read())
    return h.hexdigest()[:16]


@dataclass
class Tokenizer:
    """A tokenizer with the conventions of lm-evaluation-harness's Hugging Face model, which
    its users' numbers depend on; ``key`` identifies it (decoded batches are kept per key)."""
    tokenizer: Any
    max_length: int
    key: str

    @property
    def eos_id(self) -> int | None:
        return self.tokenizer.eos_token_id

    @property
    def prefix_id(self) -> int:
        """What an empty context and the first rolling window are conditioned on: BOS, else
        EOS."""
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @functools.cached_property
    def prefix_text(self) -> str:
        return self.tokenizer.decode([self.prefix_id])

    def encode(self, text: str, special: bool | None = None) -> list[int]:
        """The tokenizer's own default for special tokens, except that a string that already
        starts with the BOS text gets none added."""
        kwargs = {} if special is None else {"add_special_tokens": special}
        if special is None and text.startswith(self.prefix_text):
            kwargs["add_special_tokens"] = False
        return self.tokenizer.encode(text, **kwargs)

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Context and continuation tokens: trailing spaces of the context move to the
        continuation, the two are encoded together and split at the context's token count
        (so the continuation's first token is the one the model really sees); an empty context
        is the prefix token."""
        if not context:
            cont = self.encode(continuation, special=False)
            if cont and cont[0] == self.prefix_id:
                return cont[:1], cont[1:]
            return [self.prefix_id], cont
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            continuation = context[-n_spaces:] + continuation
            context = context[:-n_spaces]
        whole = self.encode(context + continuation)
        ctx = self.encode(context)
        return ctx, whole[len(ctx):]

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)


def load_tokenizer(folder: str, *, what: str, model: torch.nn.Module | None = None,
                   configured_max: int | None = None) -> Tokenizer:
    """The tokenizer in a folder; CheckpointError (a checkpoint's) or SpecError
    (``model.tokenizer``'s) when there is none or transformers cannot read it."""
    transformers = require()
    error = SpecError if what == "model.tokenizer" else CheckpointError
    if not os.path.isdir(folder) or not has_tokenizer(folder):
        raise error(f"{what}: {folder}: no tokenizer files (tokenizer.json, "
                    "tokenizer_config.json, ...); save the tokenizer beside the model "
                    "(tokenizer.save_pretrained) or set model.tokenizer to a folder that "
                    "holds one")
    tok = from_folder(transformers.AutoTokenizer, folder, what, error, "tokenizer",
                      key_path=what if error is SpecError else None)
    check_prefix_token(tok, error, f"{what}: {folder}", "; text tasks need one to condition on")
    length = context_length(tok, model, configured_max)
    return Tokenizer(tok, length, f"{tokenizer_digest(folder)}:{length}")


def from_folder(auto, folder: str, what: str, error: type, noun: str, **fields):
    """``auto.from_pretrained(folder)`` (a transformers auto class: the tokenizer's, the
    processor's), or ``error`` in one line naming ``what``, the folder and the ``noun``, with
    ``fields`` (key_path, ...)."""
    try:
        return auto.from_pretrained(folder)
    except Exception as e:               # noqa: BLE001 - files transformers cannot read
        raise errors.wrap(e, error, f"{what}: {folder}: transformers cannot load the {noun}",
                          typed=True, location=folder, **fields) from None


def check_prefix_token(tok, error: type, where: str, why: str = "") -> None:
    """``error`` (``where``: the key and folder; ``why``: the message's tail) for a
    transformers tokenizer with neither EOS nor BOS, which a prefix or a stop needs."""
    if tok.eos_token_id is None and tok.bos_token_id is None:
        raise error(f"{where}: the tokenizer has neither an end-of-sequence nor a "
                    f"beginning-of-sequence token{why}")


def context_length(tok, model: torch.nn.Module | None, configured_max: int | None) -> int:
    """The model's context in tokens (``max_length``), with the transformers tokenizer told
    never to truncate: long documents are cut into windows here, never truncated by the
    tokenizer, whose warning that a text is longer than the model's context would only
    mislead."""
    length = max_length(model, tok, configured_max)
    tok.model_max_length = _HUGE
    return length
