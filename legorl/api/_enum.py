"""A string enum whose members carry a one-line meaning; no dependencies.

Defined in `legorl.sandbox.outcomes` (standard library only), where the termination reasons that
the sandbox stages and the API share need it; every documented enum of the API uses the same class.
"""

from __future__ import annotations

from legorl.sandbox.outcomes import DocumentedEnum

__all__ = ["DocumentedEnum"]
