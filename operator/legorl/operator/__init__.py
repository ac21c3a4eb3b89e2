"""The kopf operator that reconciles RolloutFleet, SandboxPool and RLRun (see issue: Operator).

Installed with the `operator` extra (kopf, kubernetes, httpx): no torch, no vLLM.
"""
