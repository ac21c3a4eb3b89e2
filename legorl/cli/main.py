"""`legorl` console entry point: a thin dispatcher; each command imports what it needs when run."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

EXIT_OK = 0
EXIT_INVALID = 1
EXIT_USAGE = 2


def _cmd_validate(args: argparse.Namespace) -> int:
    from legorl.manifests import validate_paths  # noqa: PLC0415 - keep `legorl --help` instant

    reports, load_errors = validate_paths(args.files)
    errors = len(load_errors)
    warnings = 0
    records = []
    for line in load_errors:
        print(line, file=sys.stderr)
    for report in reports:
        label = report.document.label
        for problem in report.problems:
            if problem.severity == "error":
                errors += 1
            else:
                warnings += 1
            if args.output == "text":
                print(problem.format(label))
            records.append(
                {
                    "file": report.document.source,
                    "line": report.document.line,
                    "severity": problem.severity,
                    "path": problem.path,
                    "message": problem.message,
                    "check": problem.check,
                }
            )
        if args.output == "text" and report.ok and not args.quiet:
            print(f"{label}: valid")
    if args.strict:
        errors += warnings
    if args.output == "json":
        print(json.dumps({"documents": len(reports), "problems": records}, indent=2))
    elif not args.quiet:
        print(f"{len(reports)} document(s): {errors} error(s), {warnings} warning(s)")
    if load_errors:
        return EXIT_USAGE
    return EXIT_INVALID if errors else EXIT_OK


def _cmd_render(args: argparse.Namespace) -> int:
    from legorl.manifests import validate_paths  # noqa: PLC0415
    from legorl.manifests.generated import to_yaml  # noqa: PLC0415
    from legorl.manifests.structural import apply_defaults  # noqa: PLC0415
    from legorl.manifests.validate import crd_schema  # noqa: PLC0415

    reports, load_errors = validate_paths(args.files)
    for line in load_errors:
        print(line, file=sys.stderr)
    failed = [r for r in reports if not r.ok]
    for report in failed:
        for problem in report.problems:
            if problem.severity == "error":
                print(problem.format(report.document.label), file=sys.stderr)
    if load_errors:
        return EXIT_USAGE
    if failed:
        print("nothing rendered: fix the errors above (see `legorl validate`)", file=sys.stderr)
        return EXIT_INVALID
    from legorl.operator.render.common import RenderContext  # noqa: PLC0415
    from legorl.operator.render.fleet import RenderError  # noqa: PLC0415
    from legorl.operator.render.tree import render_all  # noqa: PLC0415

    resources = [r.resource for r in reports if r.resource is not None]
    ctx = RenderContext(lws_available=args.leader_worker_set)
    out = []
    failures = 0
    for report in reports:
        assert report.resource is not None and report.body is not None
        res = report.resource
        out.append(
            f"# {res.kind} {res.metadata.name}: as the API server stores it (defaults applied)\n"
            + to_yaml(apply_defaults(crd_schema(res.kind), report.body))
        )
        try:
            children = render_all([res], ctx, args.namespace, others=resources)
        except RenderError as exc:
            print(f"{report.document.label}: error: {exc}", file=sys.stderr)
            failures += 1
            continue
        out += [
            f"# {child['kind']} {child['metadata']['name']}: created by the operator for "
            f"{res.kind} {res.metadata.name}\n" + to_yaml(child)
            for child in children
        ]
    print("---\n".join(out), end="")
    if failures:
        print(f"{failures} resource(s) cannot run on a cluster as written", file=sys.stderr)
        return EXIT_INVALID
    return EXIT_OK


def _cmd_operator(args: argparse.Namespace) -> int:
    try:
        from legorl.operator.main import run_operator  # noqa: PLC0415
    except ImportError as exc:
        print(f"the operator needs its extra: pip install 'legorl[operator]' ({exc})", file=sys.stderr)
        return EXIT_USAGE
    from legorl.operator.logs import configure  # noqa: PLC0415
    from legorl.operator.settings import OperatorSettings, SettingsError, from_environment  # noqa: PLC0415

    configure(args.log_level, args.log_format)
    try:
        settings = from_environment(
            OperatorSettings(
                namespaces=tuple(args.namespace),
                health_port=args.health_port,
                metrics_port=args.metrics_port,
                log_level=args.log_level,
                peering=args.peering,
                resync_seconds=args.resync_seconds,
                engine_version_seconds=args.engine_version_seconds,
            )
        )
    except SettingsError as exc:
        print(f"legorl operator: {exc}", file=sys.stderr)
        return EXIT_USAGE
    run_operator(settings)
    return EXIT_OK


PROXY_DESCRIPTION = (
    "Serve the harness's model calls from the rollout engine, journaling every turn's token "
    "ids, log-probs and routing durably before answering. Example: legorl proxy "
    "--upstream http://127.0.0.1:8000 --journal ./journal --trial t0"
)


def proxy_parser() -> argparse.ArgumentParser:
    """`legorl proxy`'s own parser: one flag per proxy setting (it imports pydantic, so it is
    built only when the command runs, keeping `legorl --help` instant)."""
    from legorl.proxy.main import add_arguments  # noqa: PLC0415

    parser = argparse.ArgumentParser(prog="legorl proxy", description=PROXY_DESCRIPTION)
    add_arguments(parser)
    parser.add_argument(
        "--log-level",
        default="INFO",
        type=str.upper,
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="log level (any case)",
    )
    return parser


def _run_proxy(argv: Sequence[str]) -> int:
    return _cmd_proxy(proxy_parser().parse_args(list(argv)))


def _cmd_proxy(args: argparse.Namespace) -> int:
    from pydantic import ValidationError  # noqa: PLC0415

    from legorl.proxy.main import serve, settings_from_args  # noqa: PLC0415

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = settings_from_args(args)
    except (ValidationError, ValueError) as exc:
        print(f"legorl proxy: invalid settings:\n{exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        serve(settings)
    except ImportError as exc:
        print(f"the proxy needs its extra: pip install 'legorl[proxy]' ({exc})", file=sys.stderr)
        return EXIT_USAGE
    return EXIT_OK


def _run_train(argv: Sequence[str]) -> int:
    # The trainer parses and validates its arguments before importing torch (legorl.trainer.main).
    from legorl.trainer.main import main as train_main  # noqa: PLC0415

    return train_main(argv)


def _run_embedded(argv: Sequence[str]) -> int:
    from legorl.embedded.runner import main as run_main  # noqa: PLC0415 - imports the engine stack

    return run_main(list(argv))


def _run_ui(argv: Sequence[str]) -> int:
    from legorl.ui.cli import main as ui_main  # noqa: PLC0415 - the `ui` extra

    return ui_main(list(argv))


def _run_sft(argv: Sequence[str]) -> int:
    from legorl.trainer.warmstart.sft import main as sft_main  # noqa: PLC0415 - imports torch

    return sft_main(list(argv))


def _cmd_crds(args: argparse.Namespace) -> int:
    from legorl.manifests.generated import stale_files, write_generated  # noqa: PLC0415

    root = Path(args.root)
    if not (root / "charts" / "legorl").is_dir():
        print(
            f"{root.resolve()}: not a legorl checkout (no charts/legorl); run from the repository "
            "root or pass --root",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if args.check:
        stale = stale_files(root)
        if stale:
            for rel in stale:
                print(f"stale generated file: {rel}", file=sys.stderr)
            print("run `legorl crds` and commit the result", file=sys.stderr)
            return EXIT_INVALID
        print("generated files are up to date")
        return EXIT_OK
    changed = write_generated(root)
    for rel in changed:
        print(f"wrote {rel}")
    if not changed:
        print("generated files are up to date")
    return EXIT_OK


def _cmd_version(_: argparse.Namespace) -> int:
    from legorl.api import API_GROUP, API_VERSION, __version__  # noqa: PLC0415
    from legorl.api.trajectory import SCHEMA_VERSION  # noqa: PLC0415

    print(f"legorl {__version__} (API {API_GROUP}/{API_VERSION}, trajectory schema v{SCHEMA_VERSION})")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="legorl",
        description="Online RL for coding agents in their native harnesses, as a Kubernetes operator.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "validate",
        help="check manifests: schema, CEL rules and preflight, without a cluster",
        description=(
            "Check RLRun, SandboxPool and RolloutFleet manifests the way the API server would "
            "(schema and CEL rules) plus preflight checks it cannot make. References between "
            "documents are resolved within the files given. Exit 0 when valid, 1 on errors, "
            "2 when a file cannot be read."
        ),
    )
    p.add_argument("files", nargs="+", metavar="FILE", help="manifest files ('-' for stdin)")
    p.add_argument("--strict", action="store_true", help="treat warnings as errors")
    p.add_argument("-q", "--quiet", action="store_true", help="print problems only")
    p.add_argument("-o", "--output", choices=("text", "json"), default="text", help="output format")
    p.set_defaults(func=_cmd_validate)

    p = sub.add_parser(
        "render",
        help="print each resource with its defaults and every object the operator would create for it",
        description=(
            "Validate manifests, then print each resource as the API server stores it (defaults "
            "applied) followed by the Kubernetes objects the operator creates for it, children of an "
            "RLRun's own fleet and pool included. Owner UIDs are placeholders: the operator creates "
            "these objects, do not apply them yourself. Exit 1 when a resource cannot run on a cluster "
            "(e.g. a builtin:// model, which only `legorl run` has)."
        ),
    )
    p.add_argument("files", nargs="+", metavar="FILE", help="manifest files ('-' for stdin)")
    p.add_argument("-n", "--namespace", default="default", help="namespace of resources that set none")
    p.add_argument(
        "--leader-worker-set",
        action="store_true",
        help="render multi-node fleets as LeaderWorkerSets (as when that API is installed)",
    )
    p.set_defaults(func=_cmd_render)

    p = sub.add_parser(
        "operator",
        help="run the Kubernetes operator (in-cluster or with your kubeconfig)",
        description=(
            "Reconcile RolloutFleets, SandboxPools and RLRuns into workloads. Uses the pod's "
            "ServiceAccount in a cluster, else the current kubeconfig context."
        ),
    )
    p.add_argument(
        "--namespace",
        action="append",
        default=[],
        metavar="NS",
        help="watch this namespace (repeat for several); default: the whole cluster",
    )
    p.add_argument("--health-port", type=int, default=8080, help="port of /healthz (default 8080)")
    p.add_argument(
        "--metrics-port", type=int, default=0, help="port of /metrics for Prometheus (default 0: not served)"
    )
    p.add_argument(
        "--log-level",
        default="INFO",
        type=str.upper,
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="log level (any case)",
    )
    p.add_argument(
        "--log-format", default="text", choices=("text", "json"), help="log lines for people or pipelines"
    )
    p.add_argument(
        "--peering",
        default=None,
        metavar="NAME",
        help="kopf peering name, for several replicas with one active (needs kopf's peering CRDs)",
    )
    p.add_argument(
        "--resync-seconds",
        type=float,
        default=300.0,
        help="re-apply every child at least this often, repairing drift (default 300)",
    )
    p.add_argument(
        "--engine-version-seconds",
        type=float,
        default=15.0,
        help="ask each serving engine replica which policy version it serves (GET /weight_info) this "
        "often, for RolloutFleet status.servedPolicyVersion; 0: never (default 15)",
    )
    p.set_defaults(func=_cmd_operator)

    p = sub.add_parser(
        "proxy",
        help="run one trial's LLM proxy (OpenAI Chat, OpenAI Responses, Anthropic Messages → vLLM)",
        description=PROXY_DESCRIPTION + " (see `legorl proxy --help` for every flag)",
        add_help=False,
    )
    # `main` hands `legorl proxy ...` to proxy_parser() before this parser sees its flags.
    p.set_defaults(func=lambda _args: _run_proxy(["--help"]))

    p = sub.add_parser(
        "crds",
        help="regenerate CRDs, chart CRDs and the API reference from the models",
        description="Write crds/, charts/legorl/crds/ and docs/api-reference.md from the models.",
    )
    p.add_argument("--check", action="store_true", help="fail if a generated file is stale; write nothing")
    p.add_argument("--root", default=".", help="repository root (default: current directory)")
    p.set_defaults(func=_cmd_crds)

    from legorl.cli.tasks import add_parsers  # noqa: PLC0415 - stdlib-only, cheap

    add_parsers(sub)

    p = sub.add_parser(
        "train",
        help="train an RLRun's policy from the batches in its run store (`legorl train --help`)",
        add_help=False,
    )
    p.set_defaults(func=lambda _args: _run_train(["--help"]))
    p = sub.add_parser(
        "run",
        help="run an RLRun end to end on this machine: vLLM, sandboxed trials, trainer (`legorl run --help`)",
        add_help=False,
    )
    p.set_defaults(func=lambda _args: _run_embedded(["--help"]))
    p = sub.add_parser(
        "ui",
        help="serve the web UI over run stores and the cluster, or export a run as one HTML file "
        "(`legorl ui --help`)",
        add_help=False,
    )
    p.set_defaults(func=lambda _args: _run_ui(["--help"]))
    p = sub.add_parser(
        "sft",
        help="warm-start a tiny policy on synthetic harness demonstrations (`legorl sft --help`)",
        add_help=False,
    )
    p.set_defaults(func=lambda _args: _run_sft(["--help"]))

    p = sub.add_parser("version", help="print versions")
    p.set_defaults(func=_cmd_version)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["proxy"]:
        return _run_proxy(argv[1:])
    if argv[:1] == ["train"]:
        return _run_train(argv[1:])
    if argv[:1] == ["run"]:
        return _run_embedded(argv[1:])
    if argv[:1] == ["sft"]:
        return _run_sft(argv[1:])
    if argv[:1] == ["ui"]:
        return _run_ui(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
