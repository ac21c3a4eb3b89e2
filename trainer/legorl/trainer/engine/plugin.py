"""The vLLM worker plugin: the `legorl_filesystem` weight-transfer backend and its worker extension.

Runs inside vLLM's worker processes: the operator renders
`--worker-extension-cls legorl.trainer.engine.plugin.FilesystemWeightTransfer`. Importing this module
registers the backend, which reads a directory written by `publish.publish_weights` and loads it in place
with vLLM's layer-wise reload. It checks the payload against the served checkpoint *before* touching the
model (a failed load after vLLM's reload started leaves layers on the meta device and the next forward
kills the engine), re-packs the CPU fused-MoE weights that vLLM's reload leaves in checkpoint layout (else
the CPU engine serves garbage with every call returning 200), and rolls back to the last good weights if
loading fails half way.

No megatron, httpx or fsspec: nothing heavy at import beyond torch and safetensors; vLLM is imported inside
functions.
"""

from __future__ import annotations

import contextlib
import logging
import re
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import safetensors
import torch

from legorl.api.weights import PUBLISHED_MARKER
from legorl.trainer.sync.publish import (
    REJECTED,
    TensorSpec,
    WeightSyncError,
    checkpoint_files,
    compare_specs,
    natural_key,
    read_published,
    read_tensor_spec,
    sha256_files,
)

log = logging.getLogger(__name__)

BACKEND_NAME = "legorl_filesystem"
"""The vLLM weight-transfer backend this module registers (`--weight-transfer-config '{"backend": ...}'`)."""
_HEX64 = re.compile(r"[0-9a-f]{64}")


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
    """vLLM worker extension (`--worker-extension-cls legorl.trainer.engine.plugin.FilesystemWeightTransfer`).

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
                manifest_path = directory / PUBLISHED_MARKER
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
                not_loaded = sorted(expected_params - loaded, key=natural_key)
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
            for name in sorted(handle.keys(), key=natural_key):
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
