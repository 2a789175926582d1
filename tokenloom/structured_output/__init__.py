"""Structured outputs: constrain generation to a JSON schema, regex, choice or grammar.

``StructuredOutputsParams`` (set as ``SamplingParams.structured_outputs``)
says what to match; the front end checks it with ``validate`` (backend
errors become ``ValueError`` naming the field); the engine core's
``StructuredOutputManager`` compiles it off the loop, keeps one matcher per
request, and builds each step's token bitmask.
"""

from tokenloom.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
