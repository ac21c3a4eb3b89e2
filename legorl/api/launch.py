"""The trainer pod's launch contract: the environment the operator's trainer Job sets and `legorl train`
reads, with one encoder (`TrainerLaunch.env`) and one decoder (`TrainerLaunch.from_env`).

The run's name travels in the environment, not as `--run`: torchrun's own parser refuses any argument of
the script that starts with `--run` ("ambiguous option: could match --run-path, --run_path"), which is how
the first trainer pod on a real node died. (The proxy's equivalent is `legorl.trialproxy.command`.)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

__all__ = [
    "FLEET_URL",
    "METRICS_PORT",
    "NAMESPACE",
    "RUN",
    "STORE_URI",
    "WEIGHT_SYNC_ADDRESS",
    "WEIGHT_SYNC_PORT",
    "TrainerLaunch",
]

RUN: Final = "LEGORL_RUN"
NAMESPACE: Final = "LEGORL_NAMESPACE"
STORE_URI: Final = "LEGORL_STORE_URI"
FLEET_URL: Final = "LEGORL_FLEET_URL"
WEIGHT_SYNC_ADDRESS: Final = "LEGORL_WEIGHT_SYNC_ADDRESS"
WEIGHT_SYNC_PORT: Final = "LEGORL_WEIGHT_SYNC_PORT"
METRICS_PORT: Final = "LEGORL_METRICS_PORT"


@dataclass(frozen=True)
class TrainerLaunch:
    """What a trainer process is told by its environment (each field unset outside a trainer pod)."""

    run: str | None = None
    """The RLRun's name (`legorl train --run`'s default)."""
    namespace: str | None = None
    store_uri: str | None = None
    """The run store, as the pod mounts it (`--store`'s default)."""
    fleet_urls: tuple[str, ...] = ()
    """Engines to load new weights into (`--fleet-url`'s default): one URL, or a `dns+` name that the
    trainer resolves to every serving replica at each sync."""
    weight_sync_address: str | None = None
    """Set when the run's fleet syncs over NCCL: where the writer (global rank 0) opens the rendezvous."""
    weight_sync_port: int | None = None
    metrics_port: int | None = None
    """Serve Prometheus `/metrics` on this port (`--metrics-port`'s default)."""

    def env(self) -> list[dict[str, str]]:
        """The container's `env` entries for the fields that are set, in a fixed order."""
        values = {
            RUN: self.run,
            NAMESPACE: self.namespace,
            STORE_URI: self.store_uri,
            FLEET_URL: ",".join(self.fleet_urls) or None,
            WEIGHT_SYNC_ADDRESS: self.weight_sync_address,
            WEIGHT_SYNC_PORT: None if self.weight_sync_port is None else str(self.weight_sync_port),
            METRICS_PORT: None if self.metrics_port is None else str(self.metrics_port),
        }
        return [{"name": name, "value": value} for name, value in values.items() if value]

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> TrainerLaunch:
        """The contract from an environment; ValueError names a variable that is set but unusable."""

        def text(name: str) -> str | None:
            return environ.get(name) or None

        def port(name: str) -> int | None:
            value = text(name)
            if value is None:
                return None
            if not value.isdigit() or not 0 <= int(value) <= 65535:
                raise ValueError(f"${name}={value!r} is not a port number")
            return int(value)

        return cls(
            run=text(RUN),
            namespace=text(NAMESPACE),
            store_uri=text(STORE_URI),
            fleet_urls=tuple(u for u in (text(FLEET_URL) or "").split(",") if u),
            weight_sync_address=text(WEIGHT_SYNC_ADDRESS),
            weight_sync_port=port(WEIGHT_SYNC_PORT),
            metrics_port=port(METRICS_PORT),
        )
