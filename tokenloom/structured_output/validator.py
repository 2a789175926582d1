"""Checking constraints without importing the grammar backend into the caller.

xgrammar imports torch, and the serving front end must not (its process stays
small and never pays torch's import and memory). ``ConstraintValidator``
with ``in_subprocess=True`` runs ``backend_xgrammar.validate`` in a helper
process (``tokenloom.helper_process``), started on the first structured
request; the offline ``LLM``, whose process holds the model anyway, validates
in place.
"""

from __future__ import annotations

from tokenloom.helper_process import HelperProcess
from tokenloom.structured_output.params import StructuredOutputsParams


def _validate(params: StructuredOutputsParams) -> None:
    from tokenloom.structured_output.backend_xgrammar import validate

    validate(params)


class ConstraintValidator:
    """Raises ``ValueError`` naming the field for a constraint the backend cannot enforce."""

    def __init__(self, in_subprocess: bool) -> None:
        self.in_subprocess = in_subprocess
        self._helper = HelperProcess("tokenloom-validator")

    def __call__(self, params: StructuredOutputsParams) -> None:
        if not self.in_subprocess:
            _validate(params)
            return
        # The ValueError raised there is re-raised here, message intact.
        self._helper.call(_validate, params)

    def shutdown(self) -> None:
        self._helper.shutdown()
