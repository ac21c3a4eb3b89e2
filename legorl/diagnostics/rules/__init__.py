"""The registry of diagnostic rules, in the order the UI lists them."""

from __future__ import annotations

from typing import Final

from legorl.diagnostics.finding import Rule
from legorl.diagnostics.rules.rollout import (
    engine_unavailable_during_sync,
    staleness_over_limit,
    zero_tool_calls,
)
from legorl.diagnostics.rules.sandbox import (
    defense_failed_spike,
    image_pull_failures,
    infra_failures,
    sandbox_start_creep,
    tamper_findings,
    zero_rewards_verify_errors,
)
from legorl.diagnostics.rules.training import (
    entropy_collapse,
    equal_reward_groups,
    fidelity_below_threshold,
    is_ess_collapse,
    updates_skipped,
)

__all__ = ["RULES"]

RULES: Final[tuple[Rule, ...]] = (
    zero_tool_calls,
    fidelity_below_threshold,
    zero_rewards_verify_errors,
    defense_failed_spike,
    image_pull_failures,
    sandbox_start_creep,
    is_ess_collapse,
    equal_reward_groups,
    staleness_over_limit,
    engine_unavailable_during_sync,
    updates_skipped,
    entropy_collapse,
    tamper_findings,
    infra_failures,
)
"""Every rule `diagnose` runs; ids are unique and stable."""
