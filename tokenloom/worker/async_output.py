"""Async scheduling's runner side: a step's sampled tokens stay on the device.

``ModelRunner.execute_model_async`` returns a ``PendingOutput`` as soon as the
step is launched: its sampled tokens are copied to pinned host memory behind
the step, and ``get()`` waits for that copy only, then builds the
``ModelRunnerOutput`` and appends the tokens to the persistent batch. Until
then the next step, already scheduled with placeholders for those tokens,
reads them from the device tensor (``InFlightTokens.patch_inputs``), so the
host never waits for the GPU between two steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tokenloom.outputs import ModelRunnerOutput
from tokenloom.worker.step_inputs import to_device_packed


@dataclass
class InFlightTokens:
    """The tokens a launched step sampled, on the device, by request."""

    tokens: torch.Tensor  # [S] int64
    row_of: dict[str, int]  # request id -> its row in ``tokens``

    def patch_inputs(
        self,
        input_ids: torch.Tensor,
        req_ids: list[str],
        last_token_index: np.ndarray,
        placeholder: np.ndarray,
    ) -> None:
        """Write into ``input_ids`` the sampled token of each request whose last
        input (at ``last_token_index[i]`` of the flat batch) is a placeholder."""
        batch_rows = np.flatnonzero(placeholder)
        if len(batch_rows) == 0:
            return
        rows = np.fromiter(
            (self.row_of[req_ids[i]] for i in batch_rows.tolist()), np.int64, len(batch_rows)
        )
        where, source = to_device_packed(
            [last_token_index[batch_rows], rows], np.int64, input_ids.device
        )
        input_ids.index_copy_(0, where, self.tokens.index_select(0, source))


class PendingOutput:
    """A launched step's output; ``get()`` returns it once its tokens are on the host.
    Getting it twice returns the same object."""

    def __init__(
        self, output: ModelRunnerOutput, finish: Callable[[ModelRunnerOutput], None] | None
    ) -> None:
        self._output = output
        self._finish = finish

    @property
    def done(self) -> bool:
        return self._finish is None

    def get(self) -> ModelRunnerOutput:
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish(self._output)
        return self._output


def copy_to_host(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Start copying ``tokens`` to the host; the event (None on the CPU) marks its end."""
    if tokens.device.type != "cuda":
        return tokens, None
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    host.copy_(tokens, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event
