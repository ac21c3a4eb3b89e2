"""Publish weights as a Hugging Face model directory with its `PUBLISHED.json`, and check one against it.

The trainer's side of weight sync, and the file helpers the vLLM worker plugin (`engine/plugin.py`) shares:
a trainer-side state dict in Hugging Face names becomes a directory that any HF reader loads (safetensors,
config, tokenizer) plus the publication marker (`legorl.api.weights`: version, sha256, files, tensor count,
bytes). Written to a temporary sibling and renamed, so a reader never sees half a version.

Imported inside vLLM's worker processes (through the plugin): nothing heavy beyond torch and safetensors.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch

from legorl.api.weights import PUBLISHED_MARKER, PublishedWeights

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 4 << 30
# Files of a Hugging Face model directory that are not weights but that a reader needs next to them.
AUX_FILES = ("config.json", "generation_config.json", "special_tokens_map.json", "added_tokens.json")
AUX_GLOBS = ("tokenizer*", "chat_template*", "vocab.*", "merges.txt")
REJECTED = "legorl weight sync rejected the update"
"""Prefix of the engine plugin's errors about the payload itself: the fleet client does not retry them."""
_HASH_CHUNK = 8 << 20


class WeightSyncError(RuntimeError):
    """Weights could not be published, read or synced; the message says what is wrong and what to do."""


# ---------------------------------------------------------------------------------------------------------
# Checkpoint files (shared by the publisher, the reader and the engine plugin)
# ---------------------------------------------------------------------------------------------------------

TensorSpec = dict[str, tuple[tuple[int, ...], str]]
"""Tensor name → (shape, safetensors dtype name), as read from safetensors headers."""


def save_readable(tensors: Mapping[str, torch.Tensor], path: Path) -> None:
    """`safetensors.torch.save_file`, leaving the file readable by all (0644) as `open()` would under the
    usual umask: safetensors creates it 0600, which an engine running as another uid (or a copy onto a
    volume) cannot read ("No such file or directory", as vLLM reports it)."""
    safetensors.torch.save_file(dict(tensors), str(path), metadata={"format": "pt"})
    path.chmod(0o644)


def checkpoint_files(directory: Path) -> list[Path]:
    """The safetensors files of a Hugging Face checkpoint directory, in shard order."""
    directory = Path(directory)
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise WeightSyncError(f"{index} is not a safetensors index ({exc})") from exc
        names = sorted(set(weight_map.values()))
        files = [directory / name for name in names]
        missing = [str(f.name) for f in files if not f.is_file()]
        if missing:
            raise WeightSyncError(f"{index} lists shards that do not exist: {missing[:5]}")
        return files
    single = directory / SINGLE_FILE
    if single.is_file():
        return [single]
    if not directory.is_dir():
        raise WeightSyncError(f"weights directory {directory} does not exist (or is not a directory)")
    raise WeightSyncError(f"{directory} holds neither {SINGLE_FILE} nor {INDEX_FILE}: not a HF checkpoint")


def read_tensor_spec(files: Sequence[Path]) -> TensorSpec:
    """Names, shapes and dtypes of every tensor in `files`, from the headers only (no tensor data read)."""
    spec: TensorSpec = {}
    for path in files:
        try:
            with safetensors.safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 -- safe_open is not a mapping
                    if name in spec:
                        raise WeightSyncError(f"tensor {name!r} appears in more than one shard ({path.name})")
                    tensor_slice = handle.get_slice(name)
                    spec[name] = (tuple(tensor_slice.get_shape()), str(tensor_slice.get_dtype()))
        except WeightSyncError:
            raise
        except Exception as exc:  # safetensors raises its own error types for unreadable files
            raise WeightSyncError(f"{path} is not a readable safetensors file: {exc}") from exc
    return spec


def sha256_files(files: Sequence[Path]) -> str:
    """sha256 over the files' bytes in order (for one file: that file's sha256)."""
    digest = hashlib.sha256()
    for path in files:
        with path.open("rb") as handle:
            while chunk := handle.read(_HASH_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def natural_key(name: str) -> tuple[Any, ...]:
    """Sort key that orders `layers.2` before `layers.10`, so each decoder layer's tensors arrive together."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


def compare_specs(expected: TensorSpec, actual: TensorSpec, *, what: str) -> list[str]:
    """Human-readable differences between two tensor specs (names and shapes; dtypes may differ)."""
    problems: list[str] = []
    missing = sorted(set(expected) - set(actual), key=natural_key)
    unexpected = sorted(set(actual) - set(expected), key=natural_key)
    if missing:
        problems.append(f"{len(missing)} tensor(s) missing from {what}, e.g. {missing[:5]}")
    if unexpected:
        problems.append(
            f"{len(unexpected)} tensor(s) in {what} that the model does not have, e.g. {unexpected[:5]}"
        )
    wrong = [
        f"{name}: {list(actual[name][0])} instead of {list(shape)}"
        for name, (shape, _) in sorted(expected.items(), key=lambda item: natural_key(item[0]))
        if name in actual and actual[name][0] != shape
    ]
    if wrong:
        problems.append(f"{len(wrong)} tensor(s) in {what} with the wrong shape, e.g. {wrong[:5]}")
    not_float = sorted(n for n, (_, dtype) in actual.items() if not dtype.startswith(("F", "BF")))
    if not_float:
        problems.append(f"{len(not_float)} tensor(s) in {what} are not floating point, e.g. {not_float[:5]}")
    return problems


# ---------------------------------------------------------------------------------------------------------
# Publisher and reader
# ---------------------------------------------------------------------------------------------------------


def check_version(version: str) -> None:
    if not isinstance(version, str) or not version.strip() or len(version) > 200:
        raise WeightSyncError(
            f"weights version must be a non-empty string of at most 200 chars, got {version!r}"
        )


def publish_weights(
    state_dict: Mapping[str, torch.Tensor],
    out_dir: Path,
    *,
    version: str,
    source_dir: Path,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    strict: bool = True,
    marker: bool = True,
) -> PublishedWeights:
    """Write `state_dict` (Hugging Face names) as a HF model directory at `out_dir`, atomically.

    The tensors go to `model.safetensors` (or `model-0000i-of-0000n.safetensors` shards plus an index once
    they pass `max_shard_bytes`) in their own dtype; config, generation config and tokenizer files are
    copied from `source_dir` (the checkpoint the engines serve). With `strict`, the tensor names and shapes
    must match `source_dir`'s checkpoint exactly — a trainer-side conversion bug is caught here rather than
    in every engine. Everything is written to a hidden sibling directory and renamed into place, so
    `out_dir` either does not exist or is complete; it must not exist beforehand (one directory per
    version).

    With `marker`, the directory holds its `PUBLISHED.json` when it appears (a version published on its own);
    the trainer passes False and has the run store record the version (`RunStore.record_weights`), so a
    version is published once the store says so.
    """
    check_version(version)
    out_dir = Path(out_dir)
    source_dir = Path(source_dir)
    if out_dir.exists():
        raise WeightSyncError(f"{out_dir} already exists: publish each version to a new directory")
    if not state_dict:
        raise WeightSyncError("state dict is empty: nothing to publish")
    if max_shard_bytes <= 0:
        raise WeightSyncError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    if not source_dir.is_dir():
        raise WeightSyncError(f"source_dir {source_dir} is not a directory (the served HF checkpoint)")

    names = sorted(state_dict, key=natural_key)
    for name in names:
        value = state_dict[name]
        if not isinstance(value, torch.Tensor):
            raise WeightSyncError(f"state dict entry {name!r} is a {type(value).__name__}, not a tensor")
        if not value.is_floating_point():
            raise WeightSyncError(f"state dict entry {name!r} has dtype {value.dtype}; weights must be float")
    if strict:
        expected = read_tensor_spec(checkpoint_files(source_dir))
        actual: TensorSpec = {name: (tuple(state_dict[name].shape), "F32") for name in names}
        problems = compare_specs(expected, actual, what="the state dict")
        if problems:
            raise WeightSyncError(
                f"state dict does not match the checkpoint in {source_dir}: "
                + "; ".join(problems)
                + " (convert to the served model's Hugging Face names and shapes)"
            )

    shards = _plan_shards(state_dict, names, max_shard_bytes)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.partial-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    try:
        files = _write_shards(state_dict, shards, tmp)
        for aux in _aux_files(source_dir):
            shutil.copy2(aux, tmp / aux.name)
        published = PublishedWeights(
            version=version,
            sha256=sha256_files(files),
            files=tuple(f.name for f in files),
            published_at=datetime.now(UTC).isoformat(timespec="milliseconds"),
            num_tensors=len(names),
            bytes=sum(f.stat().st_size for f in files),
            path=str(out_dir),
        )
        if marker:
            (tmp / PUBLISHED_MARKER).write_text(json.dumps(published.to_json(), indent=2) + "\n")
        _fsync_tree(tmp)
        # rename() is atomic within one filesystem: readers see no directory or a complete one.
        tmp.rename(out_dir)
        _fsync_dir(out_dir.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return published


def _plan_shards(state_dict: Mapping[str, torch.Tensor], names: list[str], max_bytes: int) -> list[list[str]]:
    """Greedy shards of at most `max_bytes` (a bigger tensor gets a shard of its own), in layer order."""
    shards: list[list[str]] = [[]]
    size_so_far = 0
    for name in names:
        size = state_dict[name].numel() * state_dict[name].element_size()
        if shards[-1] and size_so_far + size > max_bytes:
            shards.append([])
            size_so_far = 0
        shards[-1].append(name)
        size_so_far += size
    return shards


def _write_shards(
    state_dict: Mapping[str, torch.Tensor], shards: list[list[str]], directory: Path
) -> list[Path]:
    """Write the shards (plus an index when there are several); returns the files in shard order."""
    if len(shards) == 1:
        file_names = [SINGLE_FILE]
    else:
        file_names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    seen_storage: set[int] = set()
    weight_map: dict[str, str] = {}
    for shard, file_name in zip(shards, file_names, strict=True):
        tensors: dict[str, torch.Tensor] = {}
        for name in shard:
            tensor = state_dict[name].detach().to("cpu").contiguous()
            # safetensors refuses tensors that share storage (tied weights, views of one buffer).
            if tensor.untyped_storage().data_ptr() in seen_storage:
                tensor = tensor.clone()
            seen_storage.add(tensor.untyped_storage().data_ptr())
            tensors[name] = tensor
            weight_map[name] = file_name
        save_readable(tensors, directory / file_name)
        del tensors
    files = [directory / name for name in file_names]
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(f.stat().st_size for f in files)}, "weight_map": weight_map}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return files


def _aux_files(source_dir: Path) -> list[Path]:
    found = {source_dir / name for name in AUX_FILES if (source_dir / name).is_file()}
    for pattern in AUX_GLOBS:
        found.update(p for p in source_dir.glob(pattern) if p.is_file())
    return sorted(found)


def _fsync_tree(directory: Path) -> None:
    for path in directory.iterdir():
        if path.is_file():
            with path.open("rb") as handle:
                os.fsync(handle.fileno())
    _fsync_dir(directory)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_published(path: str | os.PathLike[str], *, verify_sha256: bool = True) -> PublishedWeights:
    """Read the `PUBLISHED.json` of a published directory and check the directory against it.

    Checks that the listed safetensors files exist with the recorded total size and tensor count and, with
    `verify_sha256`, that their bytes hash to the recorded sha256 (reads every byte once).
    """
    path = Path(path)
    manifest_path = path / PUBLISHED_MARKER
    if not manifest_path.is_file():
        if not path.is_dir():
            raise WeightSyncError(f"published weights {path} do not exist")
        raise WeightSyncError(
            f"{path} has no {PUBLISHED_MARKER}: it was not written by publish_weights, or the publish did "
            "not finish (publish again)"
        )
    try:
        published = PublishedWeights.from_json(json.loads(manifest_path.read_text()), path=str(path))
    except (OSError, ValueError) as exc:
        raise WeightSyncError(f"{manifest_path} is not a valid manifest: {exc}") from exc

    file_names = published.files
    if any(Path(name).name != name for name in file_names):
        raise WeightSyncError(f"{manifest_path} lists files outside its directory: {list(file_names)}")
    files = [path / name for name in file_names]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise WeightSyncError(f"{path} is missing the safetensors file(s) its manifest lists: {missing}")
    on_disk = sum(f.stat().st_size for f in files)
    if published.bytes is not None and on_disk != published.bytes:
        raise WeightSyncError(
            f"{path}: safetensors files hold {on_disk} bytes but the manifest records {published.bytes} "
            "(truncated or rewritten after publishing; publish again)"
        )
    if published.num_tensors is not None:
        count = len(read_tensor_spec(files))
        if count != published.num_tensors:
            raise WeightSyncError(
                f"{path}: {count} tensors on disk but the manifest records {published.num_tensors}"
            )
    if verify_sha256:
        actual = sha256_files(files)
        if actual != published.sha256:
            raise WeightSyncError(
                f"{path}: safetensors sha256 is {actual} but the manifest records {published.sha256} "
                "(corrupted or rewritten after publishing; publish again)"
            )
    return published
