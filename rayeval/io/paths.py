"""Locations: local paths and object-store URIs, resolved and globbed through pyarrow.fs.

A location is a string: an absolute local path or a URI with a scheme (``s3://bucket/key``).
Relative paths in a sweep file are resolved against the sweep file's folder before they get here.
"""

from __future__ import annotations

import fnmatch
import functools
import os
import re
import uuid
from typing import Iterable

import pyarrow.fs as pafs

from rayeval import errors

_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")
_GLOB_CHARS = set("*?[")


def is_uri(location: str) -> bool:
    """True for ``scheme://...`` locations (object stores), False for local paths."""
    return bool(_SCHEME.match(location))


def resolve(location: str, base_dir: str) -> str:
    """An absolute local path or an untouched URI; relative paths are taken from ``base_dir``."""
    if is_uri(location):
        return location
    expanded = os.path.expanduser(location)
    if not os.path.isabs(expanded):
        expanded = os.path.join(base_dir, expanded)
    return os.path.normpath(expanded)


S3_MAX_ATTEMPTS = 10    # RAYEVAL_S3_MAX_ATTEMPTS overrides


def filesystem(location: str) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem for a location and the path inside it."""
    if not is_uri(location):
        return pafs.LocalFileSystem(), os.path.abspath(location)
    scheme, rest = location.split("://", 1)
    if scheme.lower() == "s3":
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        attempts = int(os.environ.get("RAYEVAL_S3_MAX_ATTEMPTS", S3_MAX_ATTEMPTS))
        return _s3(rest.split("/", 1)[0], endpoint, max(1, attempts)), rest
    fs, path = pafs.FileSystem.from_uri(location)
    return fs, path


@functools.lru_cache(maxsize=64)
def _s3(bucket: str, endpoint: str | None, attempts: int) -> pafs.S3FileSystem:
    """One S3 filesystem per bucket, endpoint and retry budget: credentials from the standard
    AWS chain (variables, profiles, roles); transient errors retried with the SDK's standard
    strategy (exponential backoff with jitter)."""
    kwargs: dict = {"retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=attempts)}
    if endpoint:
        kwargs["endpoint_override"] = endpoint
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        kwargs["region"] = region
    elif not endpoint:
        try:
            kwargs["region"] = pafs.resolve_s3_region(bucket)
        except (OSError, ValueError):
            pass                       # the SDK's default; errors surface on first use
    return pafs.S3FileSystem(**kwargs)


def clear_cache() -> None:
    """Forget the S3 filesystems (after the environment changed)."""
    _s3.cache_clear()


def bucket_of(location: str) -> str | None:
    return location.split("://", 1)[1].split("/", 1)[0] if is_uri(location) else None


def explain(error: Exception, location: str) -> str:
    """One line for an object-store error: a missing bucket, denied access, no connection."""
    text = str(error)
    bucket = bucket_of(location)
    if "NO_SUCH_BUCKET" in text or "NoSuchBucket" in text or "To create buckets" in text:
        return f"bucket '{bucket}' does not exist ({location}); create it or correct the name"
    if "ACCESS_DENIED" in text or "AccessDenied" in text or "Forbidden" in text \
            or "INVALID_ACCESS_KEY" in text or "SIGNATURE_DOES_NOT_MATCH" in text:
        return (f"access denied to {location}; check the credentials (AWS_PROFILE, or "
                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY) and the bucket's policy")
    if "NETWORK_CONNECTION" in text or "curlCode" in text:
        detail = errors.line(text.split("Details:", 1)[-1]) or errors.reason(error)
        return (f"cannot reach the object store for {location} ({detail}); check "
                "AWS_ENDPOINT_URL and the network")
    return f"{location}: {errors.reason(error)}"


def missing_bucket(location: str) -> str | None:
    """For an object-store location whose bucket does not exist (or cannot be read): why."""
    if not is_uri(location):
        return None
    try:
        fs, _ = filesystem(location)
        info = fs.get_file_info(bucket_of(location))
    except OSError as e:
        return explain(e, location)
    if info.type == pafs.FileType.NotFound:
        return f"bucket '{bucket_of(location)}' does not exist ({location}); create it or " \
               "correct the name"
    return None


def to_location(fs: pafs.FileSystem, path: str, like: str) -> str:
    """Turn a filesystem path back into a location of the same kind as ``like``."""
    if not is_uri(like):
        return path
    scheme = like.split("://", 1)[0]
    return f"{scheme}://{path}"


def has_glob(pattern: str) -> bool:
    return any(c in _GLOB_CHARS for c in pattern)


def glob(pattern: str) -> list[str]:
    """Locations matching a pattern (files and folders), sorted; a plain location matches itself
    when it exists. ``*`` does not cross ``/``; ``**`` does."""
    fs, path = filesystem(pattern)
    if not has_glob(path):
        info = fs.get_file_info(path)
        return [pattern] if info.type != pafs.FileType.NotFound else []
    parts = path.split("/")
    fixed = []
    for part in parts:
        if has_glob(part):
            break
        fixed.append(part)
    root = "/".join(fixed) or "/"
    depth = len(parts) - len(fixed)
    recursive = "**" in path
    if fs.get_file_info(root).type != pafs.FileType.Directory:
        return []
    selector = pafs.FileSelector(root, recursive=recursive, allow_not_found=True)
    if not recursive and depth > 1:
        selector = pafs.FileSelector(root, recursive=True, allow_not_found=True)
    regex = _glob_regex(path)
    matches = []
    for info in fs.get_file_info(selector):
        if regex.fullmatch(info.path):
            matches.append(to_location(fs, info.path, pattern))
    return sorted(matches)


def _glob_regex(pattern: str) -> re.Pattern:
    out = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[":
            end = pattern.find("]", i + 1)
            if end == -1:
                out.append(re.escape("["))
                i += 1
            else:
                out.append(fnmatch.translate(pattern[i : end + 1])[4:-3])
                i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out))


def is_dir(location: str) -> bool:
    fs, path = filesystem(location)
    return fs.get_file_info(path).type == pafs.FileType.Directory


def list_files(location: str, suffixes: Iterable[str] | None = None) -> list[str]:
    """Every file under a folder (recursively), sorted; hidden (``.``/``_``) names skipped."""
    fs, path = filesystem(location)
    out = []
    for info in fs.get_file_info(pafs.FileSelector(path, recursive=True)):
        if info.type != pafs.FileType.File:
            continue
        rel = info.path[len(path) :].lstrip("/")
        if any(part.startswith((".", "_")) for part in rel.split("/")):
            continue
        if suffixes is not None and not info.path.endswith(tuple(suffixes)):
            continue
        out.append(to_location(fs, info.path, location))
    return sorted(out)


def put(fs: pafs.FileSystem, folder: str, name: str, data: bytes) -> str:
    """Write ``data`` as ``folder/name`` (a filesystem path of ``fs``) so that a reader sees
    the whole file or none: locally a hidden temporary synced and renamed into place, on
    object storage one PUT. Returns the file's path; OSError as the filesystem raises it."""
    target = f"{folder}/{name}"
    fs.create_dir(folder, recursive=True)
    if isinstance(fs, pafs.LocalFileSystem):
        tmp = f"{folder}/.tmp-{uuid.uuid4().hex}-{name}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    else:
        with fs.open_output_stream(target) as f:
            f.write(data)
    return target
