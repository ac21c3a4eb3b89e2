"""`legorl proxy`: command-line flags generated from `ProxySettings`, and the server loop."""

from __future__ import annotations

import argparse
import logging
import types
import typing
from typing import Any

from pydantic import ValidationError

from legorl.proxy.settings import ProxySettings

__all__ = ["add_arguments", "serve", "settings_from_args"]

log = logging.getLogger(__name__)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _scalar(annotation: Any) -> Any:
    """The plain type under Optional / Annotated / Literal, for argparse."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _scalar(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _scalar(inner[0])
    return annotation


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per setting (`--read-timeout-seconds`, ...), plus `--listen HOST:PORT`."""
    parser.add_argument("--listen", metavar="HOST:PORT", help="address to listen on (sets --host and --port)")
    for name, field in ProxySettings.model_fields.items():
        annotation = _scalar(field.annotation)
        help_text = (field.description or "").split("\n")[0]
        required = field.is_required()
        default = None if required else field.default
        if not required:
            help_text += f" (default: {default})"
        if annotation is bool:
            parser.add_argument(
                _flag(name), dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
            continue
        kwargs: dict[str, Any] = {"dest": name, "default": None, "help": help_text, "required": required}
        if typing.get_origin(annotation) is typing.Literal:
            kwargs["choices"] = typing.get_args(annotation)
        parser.add_argument(_flag(name), **kwargs)


def settings_from_args(args: argparse.Namespace) -> ProxySettings:
    """The settings, validated by the model (raises ValidationError with every problem)."""
    values = {
        name: getattr(args, name)
        for name in ProxySettings.model_fields
        if getattr(args, name, None) is not None
    }
    if args.listen:
        host, _, port = args.listen.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--listen must be HOST:PORT, got {args.listen!r}")
        values["host"], values["port"] = host.strip("[]"), int(port)
    return ProxySettings.model_validate(values)


def _tracer_provider(settings: ProxySettings) -> Any:
    """An SDK provider exporting to `otlp_endpoint`, or as the standard `OTEL_*` variables say; None
    (the API's no-op) without either, since spans nobody exports would still cost CPU on every call."""
    from legorl.telemetry.traces import tracer_provider_from_env  # noqa: PLC0415

    return tracer_provider_from_env(
        "legorl-proxy", attributes={"legorl.run": settings.run}, endpoint=settings.otlp_endpoint
    )


def serve(settings: ProxySettings) -> None:
    """Run the proxy until SIGTERM/SIGINT; the journal is closed cleanly on the way out."""
    import uvicorn  # noqa: PLC0415

    from legorl.proxy.app import ProxyApp  # noqa: PLC0415
    from legorl.proxy.drain import DrainingServer  # noqa: PLC0415

    provider = _tracer_provider(settings)
    app = ProxyApp(settings, tracer_provider=provider)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        # uvicorn makes the socket 0666: the sandboxed harness runs as another uid.
        uds=settings.unix_socket,
        lifespan="on",
        log_level="warning",
        access_log=False,
        # The harness holds connections open between turns; keep them.
        timeout_keep_alive=600,
        h11_max_incomplete_event_size=settings.max_body_bytes,
        # Nothing in front of the proxy rewrites client addresses, and no client reads these headers:
        # each costs work on every call.
        proxy_headers=False,
        server_header=False,
        date_header=False,
    )
    server = DrainingServer(config, app, settings.drain_seconds)
    log.info(
        "proxy for trial %s listening on %s → %s",
        settings.trial,
        settings.unix_socket or f"{settings.host}:{settings.port}",
        settings.upstream,
    )
    # run() sets up uvicorn's event loop: uvloop and httptools when installed (uvicorn[standard]).
    try:
        server.run()
    finally:
        if provider is not None:
            provider.shutdown()  # the spans of the last calls, still queued for export


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (the CLI's `legorl proxy` uses the same pieces)."""
    parser = argparse.ArgumentParser(prog="legorl proxy")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        settings = settings_from_args(args)
    except (ValidationError, ValueError) as exc:
        parser.error(str(exc))
    serve(settings)
    return 0
