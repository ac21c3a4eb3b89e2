"""`legorl ui`: serve the UI (`legorl ui --store PATH`, `--runs-dir DIR`, `--kube`), or export a run as one
HTML file (`legorl ui export STORE -o run.html`)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from .settings import UiSettings

__all__ = ["main", "settings_from_args"]

TOKEN_ENV = "LEGORL_UI_ACTION_TOKEN"  # noqa: S105 - the name of the variable, not a secret
_SA_TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")
DEFAULT_RUNS_DIR = Path(".legorl") / "runs"


def _in_cluster(env: Mapping[str, str]) -> bool:
    return bool(env.get("KUBERNETES_SERVICE_HOST")) and _SA_TOKEN.is_file()


def serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="legorl ui",
        description=(
            "Serve the legorl web UI: runs, curves, outcomes, trajectories, fleet, sandboxes, diagnostics. "
            "Reads run stores (--store, --runs-dir) and, with --kube, the cluster's RLRuns. Read-only unless "
            f"{TOKEN_ENV} holds a token (pause, resume and validate then need it as a bearer token). "
            "`legorl ui export STORE -o run.html` writes one self-contained page instead."
        ),
    )
    p.add_argument(
        "--store", action="append", default=[], metavar="PATH", help="a run store (repeat for several)"
    )
    p.add_argument(
        "--runs-dir",
        metavar="DIR",
        help=f"a folder of runs, each NAME/store (default {DEFAULT_RUNS_DIR} if present)",
    )
    p.add_argument(
        "--kube", action="store_true", help="read RLRuns, fleets, pools, pods and events from the cluster"
    )
    p.add_argument(
        "--kube-server",
        metavar="URL",
        help="API server URL to use as is, e.g. `kubectl proxy`'s http://127.0.0.1:8001 (implies --kube)",
    )
    p.add_argument(
        "--kubeconfig", metavar="PATH", help="kubeconfig to read (default $KUBECONFIG or ~/.kube/config)"
    )
    p.add_argument("--context", metavar="NAME", help="kubeconfig context (default: the current one)")
    p.add_argument(
        "--namespace",
        "-n",
        action="append",
        default=[],
        metavar="NS",
        help="only these namespaces (default: all)",
    )
    p.add_argument(
        "--pvc-root",
        metavar="DIR",
        help="where this pod mounts run-store PVCs: pvc://CLAIM/PATH is read from DIR/CLAIM/PATH",
    )
    p.add_argument(
        "--host",
        default=None,
        help="address to bind (default 127.0.0.1; 0.0.0.0 inside a pod, where a Service fronts it)",
    )
    p.add_argument("--port", type=int, default=8090, help="port (default 8090; 0 picks a free one)")
    p.add_argument(
        "--tokenizer", metavar="PATH", help="tokenizer.json to decode tokens (default: the run's own)"
    )
    p.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="RUN=URL",
        help="a run's engine URL, for the fleet view without a cluster (repeat for several)",
    )
    p.add_argument(
        "--log-level", default="INFO", type=str.upper, choices=("DEBUG", "INFO", "WARNING", "ERROR")
    )
    return p


def export_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="legorl ui export",
        description="Write a run as one self-contained HTML file (inline scripts, styles and data; opens from file://).",
    )
    p.add_argument("store", metavar="STORE", help="the run store (a folder or an fsspec URL)")
    p.add_argument(
        "-o", "--output", required=True, metavar="FILE", help="the HTML file to write ('-' for stdout)"
    )
    p.add_argument(
        "--max-trajectories",
        type=int,
        default=20,
        metavar="N",
        help="trajectories to embed, token by token (default 20: tampered ones, one per step and "
        "outcome, then the rest)",
    )
    p.add_argument(
        "--tokenizer", metavar="PATH", help="tokenizer.json to decode tokens (default: the run's own)"
    )
    return p


def settings_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> UiSettings:
    """The settings of `legorl ui`'s flags and environment (the action token, in-cluster detection)."""
    env = dict(os.environ if environ is None else environ)
    in_cluster = _in_cluster(env)
    stores = tuple(args.store)
    runs_dir = args.runs_dir
    kube_wanted = bool(args.kube or args.kube_server)
    if not stores and not runs_dir and not kube_wanted:
        if in_cluster:
            kube_wanted = True
        elif DEFAULT_RUNS_DIR.is_dir():
            runs_dir = str(DEFAULT_RUNS_DIR)
        else:
            raise ValueError(
                "nothing to show: give --store PATH, --runs-dir DIR or --kube "
                f"(no {DEFAULT_RUNS_DIR} here, and not inside a cluster)"
            )
    kube = None
    if kube_wanted:
        from .kube import credentials  # noqa: PLC0415 - httpx only when the cluster is read

        kube = credentials(
            server=args.kube_server,
            kubeconfig=args.kubeconfig,
            context=args.context,
            namespaces=tuple(args.namespace),
            environ=env,
        )
    engines = []
    for item in args.engine:
        name, sep, url = item.partition("=")
        if not sep or not name or not url.startswith(("http://", "https://")):
            raise ValueError(f"--engine {item!r}: expected RUN=http://HOST:PORT")
        engines.append((name, url))
    if args.port < 0 or args.port > 65535:
        raise ValueError(f"--port {args.port}: not a port")
    host = args.host or ("0.0.0.0" if in_cluster else "127.0.0.1")  # noqa: S104 - a pod is reached via its Service
    token = env.get(TOKEN_ENV, "").strip() or None
    return UiSettings(
        stores=stores,
        runs_dir=runs_dir,
        kube=kube,
        store_roots=(("pvc://", args.pvc_root),) if args.pvc_root else (),
        action_token=token,
        host=host,
        port=args.port,
        engines=tuple(engines),
        tokenizer=Path(args.tokenizer) if args.tokenizer else None,
    )


def _export(argv: Sequence[str]) -> int:
    args = export_parser().parse_args(list(argv))
    from .export import export_html  # noqa: PLC0415

    if args.max_trajectories < 0:
        sys.stderr.write("legorl ui export: --max-trajectories must be ≥ 0\n")
        return 2
    store = args.store
    if "://" not in store and not Path(store).is_dir():
        sys.stderr.write(
            f"legorl ui export: {store} is not a folder (a run store, e.g. .legorl/runs/X/store)\n"
        )
        return 2
    settings = UiSettings(tokenizer=Path(args.tokenizer) if args.tokenizer else None)
    html = export_html(store, max_trajectories=args.max_trajectories, settings=settings)
    if args.output == "-":
        sys.stdout.write(html)
    else:
        Path(args.output).write_text(html, encoding="utf-8")
        sys.stdout.write(f"wrote {args.output} ({len(html.encode()) / 1e6:.1f} MB); open it in a browser\n")
    return 0


def main(argv: Sequence[str]) -> int:
    argv = list(argv)
    if argv[:1] == ["export"]:
        return _export(argv[1:])
    args = serve_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        sys.stderr.write(f"legorl ui: {exc}\n")
        return 2
    try:
        import uvicorn  # noqa: PLC0415 - the `ui` extra

        from .server import UiApp  # noqa: PLC0415
    except ImportError as exc:
        sys.stderr.write(f"the UI needs its extra: pip install 'legorl[ui]' ({exc})\n")
        return 2
    app = UiApp(settings)
    shown = f"[{settings.host}]" if ":" in settings.host else settings.host
    where = []
    if settings.stores:
        where.append(f"{len(settings.stores)} store(s)")
    if settings.runs_dir:
        where.append(f"runs in {settings.runs_dir}")
    if settings.kube:
        where.append(f"cluster {settings.kube.server}")
    mode = "actions enabled (token required)" if settings.actions_enabled else "read-only"
    sys.stdout.write(f"legorl ui: http://{shown}:{settings.port}/ ({', '.join(where)}; {mode})\n")
    sys.stdout.flush()
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=args.log_level.lower(), lifespan="on")
    return 0
