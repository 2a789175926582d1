"""When does a request stop? Applied to each step's sampled tokens, one by one."""

from __future__ import annotations

from tokenloom.request import Request, RequestStatus

_STOPPED = RequestStatus.FINISHED_STOPPED
_LENGTH = RequestStatus.FINISHED_LENGTH_CAPPED


def append_until_stop(request: Request, sampled: list[int], max_model_len: int) -> list[int]:
    """Append ``sampled`` to ``request`` up to and including the first stopping token.

    Checked after each token: EOS (unless ``ignore_eos``) and ``stop_token_ids``
    (which become ``stop_reason``), both ignored until ``min_tokens`` outputs
    exist; then ``max_tokens`` and ``max_model_len`` (length-capped). A stop
    token wins over a length cap hit by the same token, since the model did
    stop. Sets ``request.status`` when the request finished; returns the tokens
    kept (later ones, e.g. accepted drafts past the stop, are dropped).
    """
    params = request.sampling_params
    num_out = request.num_output_tokens
    num_tokens = request.num_tokens
    min_tokens = params.min_tokens
    eos = None if params.ignore_eos else request.eos_token_id
    stop_ids = request.stop_token_ids
    max_tokens = request.max_tokens
    status = None
    kept = len(sampled)
    for i, token in enumerate(sampled):
        num_out += 1
        num_tokens += 1
        if num_out >= min_tokens:
            if token == eos:
                status = _STOPPED
            elif stop_ids and token in stop_ids:
                status = _STOPPED
                request.stop_reason = token
        if status is None and (num_out >= max_tokens or num_tokens >= max_model_len):
            status = _LENGTH
        if status is not None:
            kept = i + 1
            break
    if kept < len(sampled):
        sampled = sampled[:kept]
    request.append_output_token_ids(sampled)
    if status is not None:
        request.status = status
    return sampled


def stops_after(request: Request, token: int, max_model_len: int) -> bool:
    """``append_until_stop`` for one token already appended: the decode fast path."""
    params = request.sampling_params
    num_out = request.num_output_tokens
    if num_out >= params.min_tokens:
        if token == request.eos_token_id and not params.ignore_eos:
            request.status = _STOPPED
            return True
        if token in request.stop_token_ids:
            request.status = _STOPPED
            request.stop_reason = token
            return True
    if num_out >= request.max_tokens or request.num_tokens >= max_model_len:
        request.status = _LENGTH
        return True
    return False
