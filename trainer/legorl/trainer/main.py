"""`legorl train` / `python -m legorl.trainer`: parse and validate everything, then import torch and train.

The RLRun comes from `--spec FILE` (a manifest, the same one `kubectl apply` takes) or, in a trainer pod,
from `<store>/run.json` written by the run controller. Arguments and the manifest are checked before torch,
megatron or vLLM are imported, so a wrong flag fails in a fraction of a second.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from legorl.api.launch import TrainerLaunch

EXIT_OK, EXIT_INVALID, EXIT_USAGE = 0, 1, 2
TINY_MOE = "builtin://tiny-moe"
TINY_SWE = "builtin://tiny-swe"


def parser() -> argparse.ArgumentParser:
    """`legorl train`'s options; their defaults come from the trainer pod's environment (`TrainerLaunch`:
    ValueError when a variable there is unusable)."""
    launch = TrainerLaunch.from_env(os.environ)
    p = argparse.ArgumentParser(
        prog="legorl train",
        description=(
            "Train the RLRun's policy from the batches its run controller commits to the run store: "
            "one optimizer step per committed batch, then publish the weights as the next policy "
            "version and load them into the fleet."
        ),
    )
    p.add_argument("--spec", type=Path, help="RLRun manifest (default: <store>/run.json)")
    p.add_argument(
        "--run",
        # The trainer pod passes it in the environment: torchrun's own parser refuses any argument of the
        # script that starts with `--run` ("ambiguous option: could match --run-path, --run_path").
        default=launch.run,
        help="RLRun name (checked against the manifest; default: $LEGORL_RUN, which the trainer pod sets)",
    )
    p.add_argument(
        "--store",
        default=launch.store_uri,
        help="run store URI (default: $LEGORL_STORE_URI, else the manifest's spec.store)",
    )
    p.add_argument(
        "--checkpoint-dir",
        type=Path,
        help="local directory of the initial policy (Hugging Face layout); default: spec.policy.checkpoint "
        "(hf:// is downloaded, pvc://claim/path read from /models/claim/path, file:// used as it is, "
        "builtin://tiny-moe and builtin://tiny-swe made on first use)",
    )
    p.add_argument(
        "--fleet-url",
        action="append",
        default=list(launch.fleet_urls),
        help="engine base URL to load new weights into (repeat per replica; default: $LEGORL_FLEET_URL)",
    )
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--steps", type=int, help="stop after this step (default: the run's stop.maxSteps)")
    p.add_argument("--no-wait", action="store_true", help="exit when no further batch is committed")
    p.add_argument(
        "--check",
        action="store_true",
        help="check the run, the trainer's layout and (when the checkpoint's config.json is at hand: "
        "--checkpoint-dir or file://) the model against that layout, print the layout, start nothing",
    )
    p.add_argument("--poll-seconds", type=float, default=2.0, help="how often to look for a new batch")
    p.add_argument("--log-level", default="INFO")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=launch.metrics_port or 0,
        help="serve Prometheus /metrics (legorl_trainer_*) on this port, all interfaces "
        "(default: $LEGORL_METRICS_PORT, else 0: not served)",
    )
    p.add_argument(
        "--spec-timeout",
        type=float,
        default=900.0,
        help="with --run and no --spec: how long to wait for the run controller's run.json (seconds)",
    )
    return p


MODELS_DIR = Path("/models")
"""Where a trainer pod mounts a `pvc://claim/path` checkpoint (the operator mounts `claim` at
`/models/<claim>`, as it does for the fleet)."""
_HF_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]


def resolve_checkpoint(uri: str, cache: Path, *, revision: str | None = None) -> Path:
    """A local directory for the policy checkpoint URI (made, mounted or downloaded as the scheme says).

    `builtin://tiny-moe` is made under `cache` (seconds); `builtin://tiny-swe` (the SFT-warm-started policy,
    minutes to make) is made once per machine under $LEGORL_CACHE_DIR (default ~/.cache/legorl) and shared
    by every run (`legorl.trainer.warmstart.sft.ensure_tiny_swe`).
    """
    scheme, _, rest = uri.partition("://")
    if uri == TINY_SWE:
        from legorl.trainer.warmstart.sft import ensure_tiny_swe  # noqa: PLC0415

        return ensure_tiny_swe()
    if uri == TINY_MOE:
        target = cache / "tiny-moe"
        if not (target / "config.json").is_file():
            from legorl.trainer.models.tiny import make_tiny_model  # noqa: PLC0415

            make_tiny_model(target)
        return target
    if scheme == "file":
        return Path(rest)
    if scheme == "pvc":
        claim, _, path = rest.partition("/")
        return MODELS_DIR / claim / path
    if scheme == "hf":
        from huggingface_hub import snapshot_download  # noqa: PLC0415 -- a dependency of transformers

        # Only the files a checkpoint is made of: config, tokenizer, safetensors (never pickles).
        return Path(
            snapshot_download(rest, revision=revision, cache_dir=str(cache / "hf"), allow_patterns=_HF_FILES)
        )
    raise ValueError(
        f"policy.checkpoint {uri!r}: the trainer reads {scheme}:// checkpoints only through a local copy; "
        "pass --checkpoint-dir, or use hf://, pvc://, file://, builtin://tiny-moe or builtin://tiny-swe"
    )


def meter_provider() -> Any:
    """OpenTelemetry metrics, exported over OTLP when `OTEL_EXPORTER_OTLP_ENDPOINT` (or the metrics one) is
    set and the exporter is installed; otherwise kept in-process (the run store has the same figures)."""
    from opentelemetry.sdk.metrics import MeterProvider  # noqa: PLC0415

    if not (
        os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")
    ):
        return MeterProvider()
    try:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter  # noqa: PLC0415
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader  # noqa: PLC0415
    except ImportError:
        logging.getLogger(__name__).warning(
            "OTEL_EXPORTER_OTLP_ENDPOINT is set but opentelemetry-exporter-otlp-proto-http is not installed; "
            "trainer metrics stay in the run store only"
        )
        return MeterProvider()
    return MeterProvider(metric_readers=[PeriodicExportingMetricReader(OTLPMetricExporter())])


def _load_run(args: argparse.Namespace) -> Any:
    from legorl.api.kinds import RLRun  # noqa: PLC0415
    from legorl.manifests import validate_paths  # noqa: PLC0415

    if args.spec is not None:
        reports, load_errors = validate_paths([args.spec])
        if load_errors:
            raise ValueError("; ".join(load_errors))
        runs = [
            r for r in reports if isinstance(r.document.body, dict) and r.document.body.get("kind") == "RLRun"
        ]
        if len(runs) != 1:
            raise ValueError(f"{args.spec}: expected exactly one RLRun, found {len(runs)}")
        bad = [p.format(runs[0].document.label) for p in runs[0].problems if p.severity == "error"]
        if bad:
            raise ValueError("invalid RLRun (see `legorl validate`):\n" + "\n".join(bad))
        return RLRun.model_validate(runs[0].document.body)
    if not args.store:
        raise ValueError("give --spec FILE, or --store URI holding the run controller's run.json")
    from legorl.api.store import RunStore  # noqa: PLC0415

    store = RunStore(args.store)
    body = store.read_run_spec()
    # The operator's trainer Job may start before the run controller wrote run.json: wait for it.
    deadline = time.monotonic() + (args.spec_timeout if args.run else 0.0)
    if body is None and time.monotonic() < deadline:
        logging.getLogger(__name__).info("waiting for %s/run.json (the run controller writes it)", args.store)
    while body is None and time.monotonic() < deadline:
        time.sleep(1.0)
        body = store.read_run_spec()
    if body is None:
        raise ValueError(f"{args.store}: no run.json yet; pass --spec FILE")
    return RLRun.model_validate(body)


def _model_shape(checkpoint: Path) -> Any:
    """The checkpoint's shape for the layout check, when its config.json is here already (else None)."""
    from legorl.trainer.models.architecture import ModelConfigError, MoeArchitecture  # noqa: PLC0415

    if not (checkpoint / "config.json").is_file():
        return None
    try:
        return MoeArchitecture.from_hf(checkpoint).shape()
    except ModelConfigError as exc:
        raise ValueError(str(exc)) from exc


def _check(args: argparse.Namespace, run: Any, store: str) -> int:
    """`--check`: the layout against the ranks it asks for and, when its config is here, the model."""
    from legorl.trainer.settings import TrainerSettings  # noqa: PLC0415

    uri = run.spec.policy.checkpoint.uri
    local = args.checkpoint_dir or (Path(uri.removeprefix("file://")) if uri.startswith("file://") else None)
    settings = TrainerSettings.from_run(
        run, store_uri=store, checkpoint_dir=local or Path(), device=args.device
    )
    shape = _model_shape(Path(local)) if local is not None else None
    settings.check_supported(model=shape)
    layout = settings.layout
    print(
        f"{run.metadata.name}: trainer layout {layout.describe()} on {layout.world_size} ranks "
        f"({layout.nodes} node(s) × {layout.ranks_per_node}): tensor {layout.tensor} (sequence parallel "
        f"{'on' if layout.sequence_parallel else 'off'}), pipeline {layout.pipeline}, "
        f"expert {layout.expert}, data {layout.data}, expert data {layout.expert_data}"
    )
    if shape is None:
        print(f"  model not checked: {uri} is not local (pass --checkpoint-dir with its config.json)")
    else:
        print(f"  model {local}: fits the layout")
    return EXIT_OK


def _launch_ranks(argv: Sequence[str], ranks: int, store: str, checkpoint: Path) -> int:
    """Run this command again under torchrun with `ranks` processes on this machine (one node)."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ranks}",
        "-m",
        "legorl.trainer",
        *argv,
        f"--store={store}",
        f"--checkpoint-dir={checkpoint}",
    ]
    print(f"legorl train: starting {ranks} trainer ranks (torchrun --standalone --nproc-per-node={ranks})")
    import subprocess  # noqa: PLC0415

    return subprocess.call(command)  # noqa: S603 -- our own interpreter and module


def _prepare(args: argparse.Namespace, args_list: list[str], rank: int) -> tuple[Any, Any] | int:
    """The RLRun and its trainer settings, checked before torch is imported; or the exit code of the ranks
    this command started (a multi-rank layout launched without torchrun)."""
    launched = "WORLD_SIZE" in os.environ
    run = _load_run(args)
    if args.run and args.run != run.metadata.name:
        raise ValueError(f"--run {args.run} does not match the manifest's RLRun {run.metadata.name}")
    store = args.store or (run.spec.store.uri if run.spec.store else f".legorl/runs/{run.metadata.name}")
    if store.startswith("file://"):
        store = store.removeprefix("file://")
    cache = Path(store) / "cache" if "://" not in store else Path(os.environ.get("HOME", ".")) / ".cache"
    from legorl.trainer.settings import TrainerSettings  # noqa: PLC0415

    layout = run.spec.trainer.parallelism.layout()
    if not launched and not args.check and layout.world_size > 1 and layout.nodes > 1:
        raise ValueError(
            f"spec.trainer.parallelism asks for {layout.nodes} nodes × {layout.ranks_per_node} ranks: "
            f"start legorl train on every node under torchrun (--nnodes={layout.nodes} "
            f"--nproc-per-node={layout.ranks_per_node} --node-rank=... --master-addr=...), as the "
            "operator's trainer Job does"
        )
    if launched and rank != 0 and args.checkpoint_dir is None and "://" in run.spec.policy.checkpoint.uri:
        # One rank makes or downloads the checkpoint (builtin://, hf://); the others must be told where.
        raise ValueError("give --checkpoint-dir to every rank (legorl train passes it when it starts them)")
    if args.check:
        return _check(args, run, store)
    checkpoint = args.checkpoint_dir or resolve_checkpoint(
        run.spec.policy.checkpoint.uri, cache, revision=run.spec.policy.checkpoint.revision
    )
    settings = TrainerSettings.from_run(
        run, store_uri=store, checkpoint_dir=checkpoint, fleet_urls=tuple(args.fleet_url), device=args.device
    )
    launch = TrainerLaunch.from_env(os.environ)
    if launch.weight_sync_address:
        # The operator sets these when the run's fleet (inline or referenced) syncs over NCCL.
        settings = settings.model_copy(
            update={
                "weight_sync_method": "NCCL",
                "weight_sync_address": launch.weight_sync_address,
                "weight_sync_port": launch.weight_sync_port or settings.weight_sync_port,
            }
        )
    shape = _model_shape(Path(checkpoint))
    if not launched and layout.world_size > 1:
        settings.check_supported(model=shape)
        return _launch_ranks(args_list, layout.world_size, store, Path(checkpoint))
    settings.check_supported(world_size=int(os.environ.get("WORLD_SIZE", "1")), model=shape)
    return run, settings


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parser().parse_args(args_list)
    except ValueError as exc:  # the pod's environment (TrainerLaunch)
        print(f"legorl train: {exc}", file=sys.stderr)
        return EXIT_USAGE
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=args.log_level, format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s"
    )
    try:
        prepared = _prepare(args, args_list, rank)
    except ValueError as exc:
        print(f"legorl train: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if isinstance(prepared, int):
        return prepared
    run, settings = prepared
    try:
        import torch  # noqa: F401, PLC0415
    except ImportError as exc:
        print(f"the trainer needs its extra: pip install 'legorl[trainer]' ({exc})", file=sys.stderr)
        return EXIT_USAGE
    from legorl.api.store import RunStore  # noqa: PLC0415
    from legorl.trainer.service import TrainingService  # noqa: PLC0415
    from legorl.trainer.telemetry import TrainerTelemetry  # noqa: PLC0415

    store_obj = RunStore(settings.store_uri)
    if args.spec is not None and rank == 0:
        # The store names the run it belongs to, so later processes (and the UI) can start from it.
        store_obj.write_run_spec(run.to_wire())
    registry = None
    if args.metrics_port and rank == 0:
        from legorl.telemetry.metrics import new_registry, serve_metrics  # noqa: PLC0415

        registry = new_registry()
        serve_metrics(registry, args.metrics_port, host="0.0.0.0")  # noqa: S104 - a pod's metrics port
    telemetry = TrainerTelemetry(meter_provider(), run=settings.run, registry=registry) if rank == 0 else None
    service = TrainingService(settings, store=store_obj, telemetry=telemetry)

    def _stop(signum: int, _frame: FrameType | None) -> None:
        logging.getLogger(__name__).info("signal %d: stopping after the current step", signum)
        service.stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    if service.resumed_from is not None and rank == 0:
        print(f"resumed at step {service.trainer.step} (checkpoint of step {service.resumed_from})")
    done = service.run(max_steps=args.steps, wait=not args.no_wait, poll_seconds=args.poll_seconds)
    if "WORLD_SIZE" in os.environ:
        # Not on an error: a failing rank must exit (torchrun then stops the others), not wait for them.
        from legorl.trainer.parallel import shutdown  # noqa: PLC0415

        shutdown()
    if rank == 0:
        print(
            f"trained {len(done)} step(s); policy version v{service.trainer.step}; "
            f"store {settings.store_uri}; layout {settings.layout.describe()}"
        )
    return EXIT_OK
