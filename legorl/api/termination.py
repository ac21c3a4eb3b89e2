"""Why a trial ended: the closed set of termination reasons (DESIGN §5); no dependencies.

Defined once in `legorl.sandbox.outcomes` (standard library only, so the sandbox stages inside task
images use the same enum) and re-exported here for everything that speaks the API.
"""

from __future__ import annotations

from legorl.sandbox.outcomes import INFRA_REASONS, TerminationReason

__all__ = ["INFRA_REASONS", "TerminationReason"]
