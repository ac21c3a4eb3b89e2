"""The run controller: the RL loop's orchestration (DESIGN §3), the same code for both backends.

It samples tasks, launches `groupSize` trials per task through a `TrialBackend`, collects their records,
commits batches to the run store, waits for the trainer's new policy version and repeats until a stop
condition holds. Light: no torch, no Kubernetes client; the operator and `legorl run` both drive it.
"""
