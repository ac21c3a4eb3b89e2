"""`legorl proxy`'s command line for one trial, from its RLRun: the one place the proxy's flags are built."""

from __future__ import annotations

from dataclasses import dataclass

from legorl.api.kinds import RLRun
from legorl.api.launch import STORE_URI
from legorl.api.run import NATIVE_API_FORMAT, Harness

__all__ = ["ProxyCommand", "ProxyRun", "ProxyTrial", "proxy_command"]


@dataclass(frozen=True)
class ProxyRun:
    """The run's side of a trial's proxy: what it records and enforces over what the harness asks."""

    name: str
    """The RLRun's name (recorded on every turn)."""
    harness: Harness
    """Its turn budget (`maxTurns`) and the API format it speaks."""
    max_tokens: int = 4096
    """`spec.algorithm.sampling.maxTokensPerTurn`."""
    temperature: str | None = None
    """`spec.algorithm.sampling.temperature`; None leaves the harness's."""
    top_p: str | None = None
    """`spec.algorithm.sampling.topP`; None leaves the harness's."""

    @classmethod
    def of(cls, run: RLRun) -> ProxyRun:
        sampling = run.spec.algorithm.sampling
        return cls(
            name=run.metadata.name,
            harness=run.spec.harness,
            max_tokens=sampling.max_tokens_per_turn,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
        )


@dataclass(frozen=True)
class ProxyTrial:
    """The trial's side: where its proxy listens, forwards to and journals."""

    trial: str
    """The trial's id."""
    upstream: str
    """The rollout engine's base URL (the fleet's Service, or the local vLLM)."""
    journal: str
    """The journal's directory."""
    listen: str | None = None
    """`HOST:PORT` to listen on (a trial pod); or"""
    unix_socket: str | None = None
    """the Unix socket to listen on (a local sandbox, whose only way out it is)."""
    served_model_name: str = "policy"
    """The model name the engine answers to."""
    capture_routed_experts: bool = False
    """The engine returns routed experts (MoE routing replay) and every turn must carry them."""
    workspace: str | None = None
    """The agent's workspace, read-only, for `GET /changes` (with `baseline`)."""
    baseline: str | None = None
    """Setup's record of the staged workspace."""
    store_uri: str | None = None
    """The run store (`LEGORL_STORE_URI` in the proxy's environment)."""
    drain_seconds: int = 0
    """After SIGTERM, serve the journal until the controller has read it, at most this long (a pod)."""
    claim_fifo: str | None = None
    """A warm trial pod: the FIFO its agent waits at until the operator claims the pod (`POST /claim`)."""


@dataclass(frozen=True)
class ProxyCommand:
    """The proxy's arguments (after the `legorl` program: `["proxy", ...]`) and its environment."""

    args: list[str]
    env: dict[str, str]


def proxy_command(run: RLRun | ProxyRun, trial: ProxyTrial) -> ProxyCommand:
    """`legorl proxy ...` for `trial` of `run`: listen address, engine, run and trial names, journal, the
    run's sampling and budgets, and where the agent's changes are read from."""
    if (trial.listen is None) == (trial.unix_socket is None):
        raise ValueError("a trial's proxy listens on exactly one of an address or a Unix socket")
    spec = ProxyRun.of(run) if isinstance(run, RLRun) else run
    api_format = spec.harness.api_format or NATIVE_API_FORMAT.get(spec.harness.kind, "OpenAIChatCompletions")
    args = [
        "proxy",
        f"--listen={trial.listen}" if trial.listen is not None else f"--unix-socket={trial.unix_socket}",
        f"--upstream={trial.upstream}",
        f"--served-model-name={trial.served_model_name}",
        f"--api-format={api_format}",
        f"--trial={trial.trial}",
        f"--run={spec.name}",
        f"--journal={trial.journal}",
        # The run's sampling and budgets, enforced where the harness cannot skip them.
        f"--max-tokens={spec.max_tokens}",
        f"--max-turns={spec.harness.max_turns}",
        # The agent's changes leave through the proxy's API (`GET /changes`), never by exec into the
        # agent's container.
        *([f"--workspace={trial.workspace}"] if trial.workspace is not None else []),
        *([f"--baseline={trial.baseline}"] if trial.baseline is not None else []),
        *([f"--temperature={spec.temperature}"] if spec.temperature is not None else []),
        *([f"--top-p={spec.top_p}"] if spec.top_p is not None else []),
        *(["--capture-routed-experts"] if trial.capture_routed_experts else []),
        *([f"--drain-seconds={trial.drain_seconds}"] if trial.drain_seconds else []),
        *([f"--claim-fifo={trial.claim_fifo}"] if trial.claim_fifo else []),
    ]
    env = {STORE_URI: trial.store_uri} if trial.store_uri else {}
    return ProxyCommand(args=args, env=env)
