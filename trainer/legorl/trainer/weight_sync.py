"""Weight sync: publish Hugging Face safetensors from the trainer and load them into running vLLM engines.

Three parts, usable apart:

- The publisher (`publish_weights`, `read_published`): a trainer-side state dict in Hugging Face names
  becomes a directory that any HF reader loads (safetensors, config, tokenizer) plus a small manifest
  (`legorl-weights.json`: version, sha256, tensor count). Written to a temporary sibling and renamed, so a
  reader never sees half a version.
- The engine side (`FilesystemWeightTransfer`, the backend `legorl_filesystem`): a vLLM worker extension
  whose import registers a weight-transfer backend that reads such a directory and loads it in place with
  vLLM's layer-wise reload. It checks the payload against the served checkpoint *before* touching the model
  (a failed load after vLLM's reload started leaves layers on the meta device and the next forward kills
  the engine), re-packs the CPU fused-MoE weights that vLLM's reload leaves in checkpoint layout (else the
  CPU engine serves garbage with every call returning 200), and rolls back to the last good weights if
  loading fails half way.
- The trainer-side client: `FleetWeightSync` drives the HTTP sequence on every replica (pause, start,
  update with bounded retries, finish with the version, reset the prefix cache, resume — always resume —
  and confirm `/weight_info`). The NCCL path (vLLM's own `nccl` backend, GPU only) is `nccl_sync.py`.

Imported inside vLLM's worker processes: no megatron and nothing heavy at import beyond torch and
safetensors; vLLM is imported inside functions, httpx only by the clients.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

import safetensors
import safetensors.torch
import torch

if TYPE_CHECKING:
    import httpx

log = logging.getLogger(__name__)

BACKEND_NAME = "legorl_filesystem"
"""The vLLM weight-transfer backend this module registers (`--weight-transfer-config '{"backend": ...}'`)."""
MANIFEST_NAME = "legorl-weights.json"
MANIFEST_FORMAT = "legorl-weights/1"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 4 << 30
# Files of a Hugging Face model directory that are not weights but that a reader needs next to them.
AUX_FILES = ("config.json", "generation_config.json", "special_tokens_map.json", "added_tokens.json")
AUX_GLOBS = ("tokenizer*", "chat_template*", "vocab.*", "merges.txt")
REJECTED = "legorl weight sync rejected the update"
"""Prefix of engine-side errors about the payload itself: retrying the same payload cannot help."""
_HEX64 = re.compile(r"[0-9a-f]{64}")
_WORKER_ERROR = re.compile(r"Worker failed with error '(.*)', please check the stack trace", re.DOTALL)
_HASH_CHUNK = 8 << 20

PauseMode = Literal["keep", "wait", "abort"]


class WeightSyncError(RuntimeError):
    """Weights could not be published, read or synced; the message says what is wrong and what to do."""


# ---------------------------------------------------------------------------------------------------------
# Checkpoint files (shared by the publisher, the reader and the engine side)
# ---------------------------------------------------------------------------------------------------------

TensorSpec = dict[str, tuple[tuple[int, ...], str]]
"""Tensor name → (shape, safetensors dtype name), as read from safetensors headers."""


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


def _natural_key(name: str) -> tuple[Any, ...]:
    """Sort key that orders `layers.2` before `layers.10`, so each decoder layer's tensors arrive together."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


def compare_specs(expected: TensorSpec, actual: TensorSpec, *, what: str) -> list[str]:
    """Human-readable differences between two tensor specs (names and shapes; dtypes may differ)."""
    problems: list[str] = []
    missing = sorted(set(expected) - set(actual), key=_natural_key)
    unexpected = sorted(set(actual) - set(expected), key=_natural_key)
    if missing:
        problems.append(f"{len(missing)} tensor(s) missing from {what}, e.g. {missing[:5]}")
    if unexpected:
        problems.append(
            f"{len(unexpected)} tensor(s) in {what} that the model does not have, e.g. {unexpected[:5]}"
        )
    wrong = [
        f"{name}: {list(actual[name][0])} instead of {list(shape)}"
        for name, (shape, _) in sorted(expected.items(), key=lambda item: _natural_key(item[0]))
        if name in actual and actual[name][0] != shape
    ]
    if wrong:
        problems.append(f"{len(wrong)} tensor(s) in {what} with the wrong shape, e.g. {wrong[:5]}")
    not_float = sorted(n for n, (_, dtype) in actual.items() if not dtype.startswith(("F", "BF")))
    if not_float:
        problems.append(f"{len(not_float)} tensor(s) in {what} are not floating point, e.g. {not_float[:5]}")
    return problems


# ---------------------------------------------------------------------------------------------------------
# Publisher (trainer side)
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PublishedWeights:
    """One published weights version: a HF model directory plus its manifest."""

    path: Path
    """The directory (HF layout: safetensors, config.json, tokenizer files, `legorl-weights.json`)."""
    version: str
    """The policy version the engines will report in `/weight_info`."""
    sha256: str
    """sha256 over the safetensors files' bytes in shard order."""
    num_tensors: int
    bytes: int
    """Total size of the safetensors files."""

    def update_info(self, *, with_sha256: bool = True) -> dict[str, str]:
        """The `update_info` of the `legorl_filesystem` backend for this version."""
        info = {"path": str(self.path), "version": self.version}
        if with_sha256:
            info["sha256"] = self.sha256
        return info


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
) -> PublishedWeights:
    """Write `state_dict` (Hugging Face names) as a HF model directory at `out_dir`, atomically.

    The tensors go to `model.safetensors` (or `model-0000i-of-0000n.safetensors` shards plus an index once
    they pass `max_shard_bytes`) in their own dtype; config, generation config and tokenizer files are
    copied from `source_dir` (the checkpoint the engines serve). With `strict`, the tensor names and shapes
    must match `source_dir`'s checkpoint exactly — a trainer-side conversion bug is caught here rather than
    in every engine. Everything is written to a hidden sibling directory and renamed into place, so
    `out_dir` either does not exist or is complete; it must not exist beforehand (one directory per
    version).
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

    names = sorted(state_dict, key=_natural_key)
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
            path=out_dir,
            version=version,
            sha256=sha256_files(files),
            num_tensors=len(names),
            bytes=sum(f.stat().st_size for f in files),
        )
        manifest = {
            "format": MANIFEST_FORMAT,
            "version": version,
            "sha256": published.sha256,
            "num_tensors": published.num_tensors,
            "bytes": published.bytes,
            "files": [f.name for f in files],
            "created": datetime.now(UTC).isoformat(timespec="milliseconds"),
        }
        (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
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
        safetensors.torch.save_file(tensors, str(directory / file_name), metadata={"format": "pt"})
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


def read_published(path: Path, *, verify_sha256: bool = True) -> PublishedWeights:
    """Read and check the manifest of a directory written by `publish_weights`.

    Checks that the listed safetensors files exist with the recorded total size and tensor count and, with
    `verify_sha256`, that their bytes hash to the recorded sha256 (reads every byte once).
    """
    path = Path(path)
    manifest_path = path / MANIFEST_NAME
    if not manifest_path.is_file():
        if not path.is_dir():
            raise WeightSyncError(f"published weights {path} do not exist")
        raise WeightSyncError(
            f"{path} has no {MANIFEST_NAME}: it was not written by publish_weights, or the publish did not "
            "finish (publish again)"
        )
    try:
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"format {manifest.get('format')!r} is not {MANIFEST_FORMAT!r}")
        version = manifest["version"]
        sha256 = manifest["sha256"]
        num_tensors = manifest["num_tensors"]
        total = manifest["bytes"]
        file_names = manifest["files"]
        if not isinstance(version, str) or not isinstance(sha256, str) or not _HEX64.fullmatch(sha256):
            raise ValueError("version must be a string and sha256 64 lowercase hex digits")
        if not isinstance(num_tensors, int) or not isinstance(total, int):
            raise ValueError("num_tensors and bytes must be integers")
        if (
            not isinstance(file_names, list)
            or not file_names
            or not all(isinstance(f, str) for f in file_names)
        ):
            raise ValueError("files must be a non-empty list of file names")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise WeightSyncError(f"{manifest_path} is not a valid manifest: {exc}") from exc

    files = [path / name for name in file_names]
    if any(Path(name).name != name for name in file_names):
        raise WeightSyncError(f"{manifest_path} lists files outside its directory: {file_names}")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise WeightSyncError(f"{path} is missing the safetensors file(s) its manifest lists: {missing}")
    on_disk = sum(f.stat().st_size for f in files)
    if on_disk != total:
        raise WeightSyncError(
            f"{path}: safetensors files hold {on_disk} bytes but the manifest records {total} "
            "(truncated or rewritten after publishing; publish again)"
        )
    count = len(read_tensor_spec(files))
    if count != num_tensors:
        raise WeightSyncError(f"{path}: {count} tensors on disk but the manifest records {num_tensors}")
    if verify_sha256:
        actual = sha256_files(files)
        if actual != sha256:
            raise WeightSyncError(
                f"{path}: safetensors sha256 is {actual} but the manifest records {sha256} "
                "(corrupted or rewritten after publishing; publish again)"
            )
    return PublishedWeights(path=path, version=version, sha256=sha256, num_tensors=num_tensors, bytes=total)


# ---------------------------------------------------------------------------------------------------------
# Engine side: the vLLM worker extension and the `legorl_filesystem` weight-transfer backend
# ---------------------------------------------------------------------------------------------------------


@dataclass
class LoadRecord:
    """What the engine-side backend last loaded (reported by the worker extension)."""

    path: str | None = None
    version: str | None = None
    sha256: str | None = None
    seconds: float | None = None
    moe_layers_repacked: int = 0
    rolled_back: bool = False
    updates: int = 0


class FilesystemWeightTransfer:
    """vLLM worker extension (`--worker-extension-cls legorl.trainer.weight_sync.FilesystemWeightTransfer`).

    vLLM resolves this class in each worker before it builds the model; importing this module there
    registers the `legorl_filesystem` weight-transfer backend, which the worker then instantiates for
    `--weight-transfer-config '{"backend":"legorl_filesystem"}'`. vLLM mixes this class into its worker
    class, so its methods run as the worker (`self.weight_transfer_engine` is the backend) and are callable
    through the dev-mode `POST /collective_rpc`. Names carry a `legorl_` prefix because vLLM refuses an
    extension attribute that its worker already has.
    """

    def legorl_weight_sync_state(self) -> dict[str, Any]:
        """The backend's last load: path, version, sha256, seconds, MoE layers re-packed, rollbacks."""
        engine = getattr(self, "weight_transfer_engine", None)
        record = getattr(engine, "record", None)
        if not isinstance(record, LoadRecord):
            return {"backend": None}
        return {"backend": BACKEND_NAME, **asdict(record)}

    def legorl_set_moe_repack(self, enabled: str) -> bool:
        """Diagnostic only: `"0"` turns the CPU fused-MoE re-pack off (to show it matters); `"1"` back on.

        Without the re-pack a CPU engine serves garbage after a reload; never turn it off in production.
        """
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is None or not hasattr(engine, "repack_cpu_moe"):
            raise WeightSyncError(f"the {BACKEND_NAME} backend is not active in this worker")
        engine.repack_cpu_moe = enabled.strip() not in {"0", "false", "False"}
        return bool(engine.repack_cpu_moe)


def register_backend() -> None:
    """Register the `legorl_filesystem` backend with vLLM's weight-transfer factory (idempotent).

    Runs on import when vLLM is already imported (always so in a vLLM worker); call it yourself if you
    import this module before vLLM and build an engine in-process.
    """
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory  # noqa: PLC0415

    if BACKEND_NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND_NAME, _engine_class())


_ENGINE_CLASS: type | None = None


def _engine_class() -> type:
    """Build (once) the backend class; deferred because its base class lives in vLLM."""
    global _ENGINE_CLASS  # noqa: PLW0603 -- one class per process, built on first use
    if _ENGINE_CLASS is None:
        _ENGINE_CLASS = _build_engine_class()
    return _ENGINE_CLASS


def _build_engine_class() -> type:
    from vllm.distributed.weight_transfer.base import (  # noqa: PLC0415
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )

    @dataclass
    class FilesystemInitInfo(WeightTransferInitInfo):
        """Nothing to rendezvous: the weights come from a path both sides can read."""

    @dataclass
    class FilesystemUpdateInfo(WeightTransferUpdateInfo):
        """`update_info` of the `legorl_filesystem` backend."""

        path: str
        """A HF checkpoint directory (model.safetensors or a sharded index), e.g. from publish_weights."""
        version: str | None = None
        """Must match the directory's manifest when both are present."""
        sha256: str | None = None
        """When given, the engine hashes the files it is about to load and refuses a mismatch."""

    class FilesystemWeightTransferEngine(WeightTransferEngine[FilesystemInitInfo, FilesystemUpdateInfo]):
        """Loads a HF checkpoint directory in place with vLLM's layer-wise reload.

        Each `update_weights` call carries one whole checkpoint and is complete when it returns:
        validate (nothing touched yet) → `initialize_layerwise_reload` → `load_weights` →
        `finalize_layerwise_reload` → re-pack CPU fused-MoE weights → check nothing is left on the meta
        device. `start_weight_update` / `finish_weight_update` therefore touch no weights, and a rejected
        payload leaves the engine serving the previous weights.
        """

        init_info_cls = FilesystemInitInfo
        update_info_cls = FilesystemUpdateInfo
        # Draft (speculative) models would need their own served checkpoint to validate against.
        supports_draft_weight_update = False

        def __init__(
            self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module
        ) -> None:
            super().__init__(config, vllm_config, device, model)
            self.record = LoadRecord()
            self.repack_cpu_moe = True
            self._served_spec: TensorSpec | None = None
            served = _served_checkpoint_dir(vllm_config)
            self._served_dir = served
            self._last_good: Path | None = served

        # -- the weight-transfer engine API ---------------------------------------------------------

        def parse_update_info(self, update_dict: dict[str, Any]) -> FilesystemUpdateInfo:
            if not isinstance(update_dict, dict):
                raise WeightSyncError(f"{REJECTED}: update_info must be an object, got {type(update_dict)}")
            unknown = sorted(set(update_dict) - {"path", "version", "sha256"})
            if unknown:
                raise WeightSyncError(f"{REJECTED}: unknown update_info field(s) {unknown}")
            path, version, sha = (
                update_dict.get("path"),
                update_dict.get("version"),
                update_dict.get("sha256"),
            )
            if not isinstance(path, str) or not path:
                raise WeightSyncError(f"{REJECTED}: update_info.path must be a directory path, got {path!r}")
            if version is not None and not isinstance(version, str):
                raise WeightSyncError(f"{REJECTED}: update_info.version must be a string, got {version!r}")
            if sha is not None and not (isinstance(sha, str) and _HEX64.fullmatch(sha)):
                raise WeightSyncError(f"{REJECTED}: update_info.sha256 must be 64 lowercase hex digits")
            return FilesystemUpdateInfo(path=path, version=version, sha256=sha)

        def init_transfer_engine(self, init_info: FilesystemInitInfo) -> None:
            """Nothing to set up (the optional `/init_weight_transfer_engine` call is accepted)."""

        def start_weight_update(self) -> None:
            """Nothing to do: each update is self-contained (see the class docstring)."""

        def update_weights(self, update_info: dict[str, Any]) -> None:
            # The base class ends with torch.accelerator.synchronize(), which raises on CPU-only torch;
            # our copies are synchronous on CPU and stream-ordered on CUDA, so sync only on CUDA.
            self.receive_weights(self.parse_update_info(update_info))
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

        def receive_weights(self, update_info: FilesystemUpdateInfo) -> None:
            started = time.perf_counter()
            directory = Path(update_info.path)
            files = self._validate(directory, update_info)
            repacked = self._load(files)
            self.record = LoadRecord(
                path=str(directory),
                version=update_info.version,
                sha256=update_info.sha256,
                seconds=time.perf_counter() - started,
                moe_layers_repacked=repacked,
                updates=self.record.updates + 1,
            )
            self._last_good = directory
            log.info(
                "legorl_filesystem: loaded %s (version %s) in %.3fs; %d CPU MoE layer(s) re-packed",
                directory,
                update_info.version,
                self.record.seconds,
                repacked,
            )

        def finish_weight_update(self) -> None:
            """Nothing to do: `update_weights` already finalized the reload."""

        def shutdown(self) -> None:
            """No resources held."""

        # -- validation (before anything touches the model) -----------------------------------------

        def _validate(self, directory: Path, info: FilesystemUpdateInfo) -> list[Path]:
            try:
                files = checkpoint_files(directory)
                manifest_path = directory / MANIFEST_NAME
                if manifest_path.is_file():
                    published = read_published(directory, verify_sha256=False)
                    if info.version is not None and published.version != info.version:
                        raise WeightSyncError(
                            f"{directory} holds version {published.version!r}, not {info.version!r}"
                        )
                    if info.sha256 is not None and published.sha256 != info.sha256:
                        raise WeightSyncError(
                            f"{directory} manifest records sha256 {published.sha256}, not {info.sha256}"
                        )
                if info.sha256 is not None:
                    actual = sha256_files(files)
                    if actual != info.sha256:
                        raise WeightSyncError(
                            f"safetensors in {directory} hash to {actual}, not {info.sha256} "
                            "(partial copy or corrupted volume)"
                        )
                actual_spec = read_tensor_spec(files)
                expected = self._expected_spec()
                if expected is not None:
                    problems = compare_specs(expected, actual_spec, what=str(directory))
                    if problems:
                        raise WeightSyncError(
                            "; ".join(problems) + f" (compared with the served checkpoint {self._served_dir})"
                        )
            except WeightSyncError as exc:
                raise WeightSyncError(
                    f"{REJECTED}: {exc}; the engine still serves its previous weights"
                ) from exc
            return files

        def _expected_spec(self) -> TensorSpec | None:
            if self._served_spec is None and self._served_dir is not None:
                self._served_spec = read_tensor_spec(checkpoint_files(self._served_dir))
            if self._served_spec is None:
                log.warning(
                    "legorl_filesystem: the served checkpoint is not a local directory; tensor names and "
                    "shapes are checked only after loading"
                )
            return self._served_spec

        # -- loading ----------------------------------------------------------------------------------

        def _load(self, files: list[Path]) -> int:
            """Load `files` (returns the MoE layers re-packed); on failure restore the last good weights."""
            try:
                return self._reload(files)
            except Exception as exc:
                fallback = self._last_good
                if fallback is None:
                    raise WeightSyncError(
                        f"loading {files[0].parent} failed ({exc}) and there is no local checkpoint to roll "
                        "back to: the engine's weights are inconsistent, restart it"
                    ) from exc
                try:
                    self._reload(checkpoint_files(fallback))
                except Exception as rollback_exc:  # noqa: BLE001 -- any rollback failure means "restart"
                    raise WeightSyncError(
                        f"loading {files[0].parent} failed ({exc}) and rolling back to {fallback} failed too "
                        f"({rollback_exc}): the engine's weights are inconsistent, restart it"
                    ) from exc
                self.record.rolled_back = True
                raise WeightSyncError(
                    f"loading {files[0].parent} failed ({exc}); rolled back to {fallback}, which the engine "
                    "serves again"
                ) from exc

        def _reload(self, files: list[Path]) -> int:
            # finalize_layerwise_reload is an untyped alias of finalize_layerwise_processing.
            from vllm.model_executor.model_loader.reload import (  # noqa: PLC0415
                finalize_layerwise_processing,
                initialize_layerwise_reload,
            )

            model = self.model
            quantized = getattr(self.model_config, "quantization", None) is not None
            expected_params = {name for name, _ in model.named_parameters()}
            initialize_layerwise_reload(model)
            finalized = False
            try:
                with _mtp_check_disabled():
                    loaded = cast(Any, model).load_weights(_iter_tensors(files))
                finalize_layerwise_processing(model, self.model_config)
                finalized = True
            finally:
                if not finalized:
                    # Puts the previous kernel tensors back on layers that got nothing, so no layer stays
                    # on the meta device; the caller then reloads a good checkpoint over everything.
                    with contextlib.suppress(Exception):
                        finalize_layerwise_processing(model, self.model_config)
            if not quantized and isinstance(loaded, set):
                not_loaded = sorted(expected_params - loaded, key=_natural_key)
                if not_loaded:
                    raise WeightSyncError(
                        f"{len(not_loaded)} parameter(s) were not loaded, e.g. {not_loaded[:5]}"
                    )
            repacked = _repack_cpu_fused_moe(model) if self.repack_cpu_moe else 0
            on_meta = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
            if on_meta:
                raise WeightSyncError(f"{len(on_meta)} tensor(s) left on the meta device, e.g. {on_meta[:5]}")
            return repacked

    return FilesystemWeightTransferEngine


def _iter_tensors(files: Sequence[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of `files`, one decoder layer after another (layer-wise reload processes a layer as soon
    as all its tensors have arrived, so this bounds the extra memory to about one layer)."""
    for path in files:
        with safetensors.safe_open(str(path), framework="pt", device="cpu") as handle:
            for name in sorted(handle.keys(), key=_natural_key):
                yield name, handle.get_tensor(name)


@contextlib.contextmanager
def _mtp_check_disabled() -> Iterator[None]:
    """vLLM's own backends disable the multi-token-prediction completeness check around load_weights."""
    try:
        from vllm.model_executor.model_loader.mtp_validation import (  # noqa: PLC0415
            disable_mtp_completeness_check,
        )
    except ImportError:
        yield
        return
    with disable_mtp_completeness_check():
        yield


def _repack_cpu_fused_moe(model: torch.nn.Module) -> int:
    """Re-run the CPU fused-experts weight processing on every MoE layer that uses it; returns the count.

    vLLM's unquantized MoE method runs the experts' `process_weights_after_loading` only on the first load
    (`moe_kernel` is set afterwards), so after a layer-wise reload the CPU kernel's buffers hold the
    checkpoint layout instead of its packed one and the engine computes garbage. GPU experts keep no such
    packed copy, so this finds nothing to do there.
    """
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import (  # noqa: PLC0415
            CPUUnquantizedExperts,
        )
    except ImportError:
        return 0
    count = 0
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        kernel = getattr(method, "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is None:
            continue
        if isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(module)
            count += 1
        elif type(experts).__module__.endswith("cpu_moe"):
            log.warning(
                "legorl_filesystem: %s uses %s; a reload may leave its packed weights stale (only the "
                "unquantized CPU experts are re-packed)",
                name,
                type(experts).__name__,
            )
    return count


def _served_checkpoint_dir(vllm_config: Any) -> Path | None:
    """The local directory of the checkpoint vLLM serves (a path, or a hub id already in the HF cache)."""
    model_config = vllm_config.model_config
    candidate = Path(str(model_config.model))
    if candidate.is_dir():
        return candidate
    try:
        from huggingface_hub import snapshot_download  # noqa: PLC0415

        cached = snapshot_download(
            str(model_config.model),
            revision=getattr(model_config, "revision", None),
            cache_dir=getattr(vllm_config.load_config, "download_dir", None),
            local_files_only=True,
            allow_patterns=["*.safetensors", "*.json"],
        )
    except Exception:  # noqa: BLE001 -- any miss means "no local copy": validation falls back to post-load checks
        return None
    return Path(cached)


# vLLM imports the worker extension before it builds the model; registering here is what makes the backend
# name resolvable there. Outside vLLM (the trainer image) nothing is imported or registered.
if "vllm" in sys.modules:
    register_backend()


# ---------------------------------------------------------------------------------------------------------
# Trainer side: HTTP client for a fleet of replicas
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplicaSync:
    """One replica's part of a sync."""

    url: str
    seconds: float
    """Pause to resume, inclusive."""
    attempts: int
    """`/update_weights` calls made (1 unless a transient failure was retried)."""


@dataclass(frozen=True)
class SyncReport:
    """A completed sync: every replica serves `version`."""

    version: str
    replicas: tuple[ReplicaSync, ...]
    seconds: float
    """Wall time of the whole sync (replicas run concurrently)."""

    @property
    def replica_seconds(self) -> dict[str, float]:
        return {replica.url: replica.seconds for replica in self.replicas}


class _Rejected(WeightSyncError):
    """The engine refused the payload itself: retrying the same payload cannot succeed."""


@dataclass
class _Replica:
    url: str
    attempts: int = 0


class FleetWeightSync:
    """Loads published weights into every replica of a vLLM fleet over its dev-mode HTTP routes.

    Per replica: `POST /pause?mode=<pause_mode>&clear_cache=false` → `/start_weight_update` →
    `/update_weights` (a transient failure is retried, bounded, while still paused; a payload the engine
    rejects is not, and the backend leaves the previous weights in place either way) →
    `/finish_weight_update {"weight_version": v}` → `/reset_prefix_cache?reset_running_requests=true` (still
    paused, so no request runs on KV that the old weights computed: cached prefixes are dropped and kept
    requests recompute) → `/resume` (always attempted once the pause was sent, also after a failure) →
    `GET /weight_info` must report `v`. Replicas are synced concurrently; a failure on any raises
    `WeightSyncError` naming each replica's outcome.
    """

    def __init__(
        self,
        base_urls: Sequence[str],
        *,
        pause_mode: PauseMode = "keep",
        timeout: float = 600.0,
        update_attempts: int = 3,
        retry_delay: float = 1.0,
        verify_sha256: bool = True,
        resolve: Callable[[str, int], list[str]] | None = None,
    ) -> None:
        """`base_urls`: one `http://host:port` per replica, or `dns+http://name:port` for every address a
        name resolves to (the operator's headless Service of a fleet's serving pods: one address per
        replica, looked up again at every sync). `timeout`: per HTTP call, seconds.

        `verify_sha256`: the engines hash the files they load against the manifest (one extra read).
        `resolve(host, port)`: the addresses of a `dns+` name (default: the system resolver).
        """
        import httpx  # noqa: PLC0415 -- only the trainer side needs it, not vLLM's workers

        if isinstance(base_urls, str) or not base_urls:
            raise WeightSyncError("base_urls must be a non-empty list of engine URLs (one per replica)")
        urls = [str(url).rstrip("/") for url in base_urls]
        bad = [
            url for url in urls if not url.startswith(("http://", "https://", "dns+http://", "dns+https://"))
        ]
        if bad:
            raise WeightSyncError(f"engine URLs must start with http://, https:// or dns+http://, got {bad}")
        if len(set(urls)) != len(urls):
            raise WeightSyncError(f"engine URLs repeat: {urls}")
        self._given = urls
        self._resolve = resolve or _resolve_addresses
        self.base_urls = urls if not any(u.startswith("dns+") for u in urls) else []
        """The replicas' URLs as of the last `refresh()`."""
        if pause_mode not in ("keep", "wait", "abort"):
            raise WeightSyncError(f"pause_mode must be keep, wait or abort, got {pause_mode!r}")
        if update_attempts < 1:
            raise WeightSyncError(f"update_attempts must be at least 1, got {update_attempts}")
        self.pause_mode: PauseMode = pause_mode
        self.timeout = timeout
        self.update_attempts = update_attempts
        self.retry_delay = retry_delay
        self.verify_sha256 = verify_sha256
        # One connection per call: vLLM's server answers a failed control call with a 500 and then drops the
        # connection, which would fail the next call (the resume) on a reused keep-alive connection.
        self._http = httpx.Client(timeout=timeout, headers={"Connection": "close"})

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> FleetWeightSync:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- public ------------------------------------------------------------------------------------------

    def refresh(self) -> list[str]:
        """Look the replicas up again (`dns+` names: every address now; plain URLs as given)."""
        urls: list[str] = []
        for url in self._given:
            if not url.startswith("dns+"):
                urls.append(url)
                continue
            parsed = httpx_url(url.removeprefix("dns+"))
            addresses = self._resolve(parsed.host, parsed.port)
            if not addresses:
                raise WeightSyncError(f"{url}: no address behind {parsed.host} (no replica is ready)")
            for address in sorted(set(addresses)):
                host = f"[{address}]" if ":" in address else address
                urls.append(f"{parsed.scheme}://{host}:{parsed.port}")
        self.base_urls = urls
        return urls

    def sync(self, published: PublishedWeights) -> SyncReport:
        """Load `published` into every replica; returns per-replica timings once all serve its version."""
        self.refresh()
        # Cheap pre-flight (no hashing: the engines hash what they read): a stale or half-written
        # directory is refused before any engine pauses.
        on_disk = read_published(published.path, verify_sha256=False)
        if (on_disk.version, on_disk.sha256, on_disk.num_tensors) != (
            published.version,
            published.sha256,
            published.num_tensors,
        ):
            raise WeightSyncError(
                f"{published.path} holds version {on_disk.version} (sha256 {on_disk.sha256[:12]}…, "
                f"{on_disk.num_tensors} tensors), not the {published.version} being synced (sha256 "
                f"{published.sha256[:12]}…, {published.num_tensors} tensors)"
            )
        started = time.perf_counter()
        info = published.update_info(with_sha256=self.verify_sha256)
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(self.base_urls)) as pool:
            futures = {
                url: pool.submit(self._sync_replica, url, info, published.version) for url in self.base_urls
            }
            results: dict[str, ReplicaSync | BaseException] = {}
            for url, future in futures.items():
                try:
                    results[url] = future.result()
                except Exception as exc:  # noqa: BLE001 -- collected and reported per replica below
                    results[url] = exc
        failed = {url: r for url, r in results.items() if isinstance(r, BaseException)}
        if failed:
            ok = f"ok, serves {published.version}"
            lines = [
                f"{url}: {f'FAILED: {r}' if isinstance(r, BaseException) else ok}"
                for url, r in results.items()
            ]
            raise WeightSyncError(
                f"weight sync of {published.version} failed on {len(failed)} of {len(results)} "
                "replica(s):\n  " + "\n  ".join(lines)
            )
        replicas = tuple(r for r in results.values() if isinstance(r, ReplicaSync))
        return SyncReport(version=published.version, replicas=replicas, seconds=time.perf_counter() - started)

    def served_versions(self) -> list[str]:
        """`GET /weight_info` of every replica (looked up again), in `base_urls` order."""
        return [self._weight_version(url) for url in self.refresh()]

    # -- one replica -------------------------------------------------------------------------------------

    def _sync_replica(self, url: str, info: dict[str, str], version: str) -> ReplicaSync:
        started = time.perf_counter()
        replica = _Replica(url)
        try:
            # clear_cache=false: the reset that matters comes once the new weights are in (below); vLLM's
            # pause-time clearing is deprecated and would run before them.
            self._post(url, "/pause", params={"mode": self.pause_mode, "clear_cache": "false"})
            self._update(replica, info)
            self._post(url, "/finish_weight_update", json={"weight_version": version})
            self._reset_prefix_cache(url)
        except BaseException as exc:
            # Whatever failed (the pause included: it may have landed before the connection dropped), the
            # replica must not stay paused.
            resume_error = self._try_resume(url)
            if not isinstance(exc, WeightSyncError):
                raise
            outcome = (
                f"and resuming failed too ({resume_error}): the replica may still be paused"
                if resume_error is not None
                else "(the replica was resumed)"
            )
            raise WeightSyncError(f"{exc} {outcome}") from exc
        resume_error = self._try_resume(url)
        if resume_error is not None:
            raise WeightSyncError(f"{url} loaded {version} but did not resume: {resume_error}")
        served = self._weight_version(url)
        if served != version:
            raise WeightSyncError(f"{url} reports weight version {served!r} after syncing {version!r}")
        return ReplicaSync(url=url, seconds=time.perf_counter() - started, attempts=replica.attempts)

    def _update(self, replica: _Replica, info: dict[str, str]) -> None:
        while True:
            replica.attempts += 1
            try:
                self._start(replica.url)
                self._post(replica.url, "/update_weights", json={"update_info": info})
                return
            except _Rejected:
                raise
            except WeightSyncError as exc:
                if replica.attempts >= self.update_attempts:
                    raise WeightSyncError(f"{exc} (after {replica.attempts} attempt(s))") from exc
                log.warning("update_weights on %s failed (%s); retrying while paused", replica.url, exc)
                time.sleep(self.retry_delay * replica.attempts)

    def _start(self, url: str) -> None:
        try:
            self._post(url, "/start_weight_update")
        except WeightSyncError as exc:
            if "already active" not in str(exc):
                raise
            # A previous client died between start and finish; close that session (our backend applies
            # nothing in finish) and start ours.
            log.warning("%s had a weight update session open; finishing it before starting", url)
            self._post(url, "/finish_weight_update", json={})
            self._post(url, "/start_weight_update")

    def _reset_prefix_cache(self, url: str) -> None:
        body = self._post(url, "/reset_prefix_cache", params={"reset_running_requests": "true"})
        if isinstance(body, dict) and body.get("success") is False:
            raise WeightSyncError(f"{url} could not reset its prefix cache; cached KV may predate the update")

    def _try_resume(self, url: str) -> WeightSyncError | None:
        """`POST /resume`, retried a few times; returns the last error instead of raising."""
        error: WeightSyncError | None = None
        for attempt in range(3):
            try:
                self._post(url, "/resume")
            except WeightSyncError as exc:
                error = exc
                time.sleep(self.retry_delay * (attempt + 1))
            else:
                return None
        return error

    def _weight_version(self, url: str) -> str:
        body = self._request("GET", url, "/weight_info")
        if not isinstance(body, dict) or not isinstance(body.get("weight_version"), str):
            raise WeightSyncError(f"{url}/weight_info answered {body!r}, not {{'weight_version': ...}}")
        return str(body["weight_version"])

    # -- HTTP --------------------------------------------------------------------------------------------

    def _post(self, url: str, path: str, *, json: Any = None, params: Mapping[str, str] | None = None) -> Any:
        return self._request("POST", url, path, json=json, params=params)

    def _request(
        self,
        method: str,
        url: str,
        path: str,
        *,
        json: Any = None,
        params: Mapping[str, str] | None = None,
    ) -> Any:
        import httpx  # noqa: PLC0415

        try:
            response = self._http.request(method, url + path, json=json, params=params)
        except httpx.HTTPError as exc:
            raise WeightSyncError(f"{method} {url}{path}: {type(exc).__name__}: {exc}") from exc
        if response.status_code >= 400:
            text = _error_text(response)
            error = _Rejected if REJECTED in text else WeightSyncError
            hint = ""
            if response.status_code == 404:
                hint = " (is the engine started with VLLM_SERVER_DEV_MODE=1 and a --weight-transfer-config?)"
            raise error(f"{method} {url}{path} answered {response.status_code}: {text}{hint}")
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError:
            return response.text


@dataclass(frozen=True)
class _Url:
    scheme: str
    host: str
    port: int


def httpx_url(url: str) -> _Url:
    """scheme, host and port (the scheme's default when absent) of an http(s) URL."""
    from urllib.parse import urlsplit  # noqa: PLC0415

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise WeightSyncError(f"{url!r} is not an http(s) URL with a host")
    return _Url(parts.scheme, parts.hostname, parts.port or (443 if parts.scheme == "https" else 80))


def _resolve_addresses(host: str, port: int) -> list[str]:
    import socket  # noqa: PLC0415

    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise WeightSyncError(f"cannot resolve the fleet's replicas {host}: {exc}") from exc
    return [str(info[4][0]) for info in found]


def _error_text(response: httpx.Response) -> str:
    """vLLM's error message (`{"error": {"message": ...}}` or FastAPI's `{"detail": ...}`), else the body."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:2000]
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            message = str(error["message"])
            # A worker's exception arrives wrapped in two layers of vLLM's own text; keep the worker's.
            worker = _WORKER_ERROR.search(message)
            return (worker.group(1) if worker else message)[:2000]
        if "detail" in body:
            return str(body["detail"])[:2000]
    return response.text.strip()[:2000]
