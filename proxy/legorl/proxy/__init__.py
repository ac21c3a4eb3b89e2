"""The LLM proxy sidecar: token-faithful capture between a harness and the fleet (see issue: Proxy).

Installed with the `proxy` extra (httpx, opentelemetry-sdk): no vLLM, no torch.
"""
