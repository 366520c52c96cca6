"""NeMo AutoModel 0.7.0's remote target protocol, request by request, checked as a client we do not trust.

In: the body of a POST (a NeMo wire blob, :mod:`ds_capture.serve.wire`) and what the service knows (vocabulary
size, the longest sequence its recipe allows, the most rows one request may carry). Out: the parsed request, or a
:class:`BadRequest` carrying the HTTP status and one sentence naming the problem and the fix. The endpoints
(``protocol.py`` there: ``EP_*``), ``generate``'s answer keys in order (``SUPERVISION_KEYS``) and ``model_info``'s
fields are NeMo's, unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ds_capture.serve.supervision import VocabMapping
from ds_capture.serve.wire import WireError, decode

ENDPOINTS = ("generate", "set_vocab_mapping", "model_info", "input_embeddings", "init_nccl", "heartbeat",
             "disconnect")
SUPERVISION_KEYS = ["aux_hidden_states", "target_probs", "position_mask", "input_ids", "loss_mask"]
GENERATE_KEYS = ("input_ids", "attention_mask", "loss_mask")


class BadRequest(Exception):
    """A request the service refuses: ``status`` (4xx, or 503 while not ready / full), a message that names the
    problem, the reason it is counted under (``ds_capture_serve_refusals_total``) and any extra headers."""

    def __init__(self, status: int, message: str, *, reason: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.reason = reason or ("too_large" if status == 413 else "bad_request")
        self.headers = headers


@dataclass(frozen=True)
class GenerateRequest:
    """One ``generate``: NeMo's dataloader batch, int64 ``[B, S]`` each."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_length(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())


def _tensors(raw: bytes, endpoint: str, keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
    try:
        tensors = decode(raw)
    except WireError as error:
        raise BadRequest(400, f"{endpoint}: the body is not a NeMo wire blob: {error}") from error
    missing = [key for key in keys if tensors.get(key) is None]
    if missing:
        raise BadRequest(400, f"{endpoint}: missing tensor(s) {missing}; the body must carry {list(keys)} "
                              f"(got {sorted(tensors)})")
    return tensors


def parse_generate(raw: bytes, *, vocab_size: int, max_seq_length: int, max_rows: int) -> GenerateRequest:
    """``input_ids``, ``attention_mask``, ``loss_mask``: int64 ``[B, S]`` of one shape, ids in ``[0, V)``, masks
    0/1, ``S <= max_seq_length`` (the recipe's ``seq_length``), ``1 <= B <= max_rows``."""
    tensors = _tensors(raw, "generate", GENERATE_KEYS)
    for key in GENERATE_KEYS:
        tensor = tensors[key]
        if tensor.dtype != torch.int64:
            raise BadRequest(422, f"generate: {key} is {str(tensor.dtype).replace('torch.', '')}, expected int64 "
                                  "(NeMo's dataloader sends torch.long)")
        if tensor.ndim != 2:
            raise BadRequest(422, f"generate: {key} has shape {list(tensor.shape)}, expected [batch, seq_length]")
    shape = tensors["input_ids"].shape
    for key in GENERATE_KEYS[1:]:
        if tensors[key].shape != shape:
            raise BadRequest(422, f"generate: {key} has shape {list(tensors[key].shape)}, input_ids "
                                  f"{list(shape)}: they must be equal")
    rows, length = int(shape[0]), int(shape[1])
    if not 1 <= rows <= max_rows:
        raise BadRequest(422 if rows < 1 else 413, f"generate: {rows} rows; this service takes 1 to {max_rows} "
                                                   "per request (--max-batch-rows)")
    if not 1 <= length <= max_seq_length:
        raise BadRequest(422 if length < 1 else 413,
                         f"generate: sequence length {length}; this service's recipe allows 1 to {max_seq_length} "
                         "(recipe_args.seq_length): lower the trainer's seq_length or restart the service with a "
                         "larger one")
    ids = tensors["input_ids"]
    if bool(((ids < 0) | (ids >= vocab_size)).any()):
        raise BadRequest(422, f"generate: input_ids outside [0, {vocab_size}) (min {int(ids.min())}, max "
                              f"{int(ids.max())}): the trainer's tokenizer does not match this target")
    for key in GENERATE_KEYS[1:]:
        if bool(((tensors[key] != 0) & (tensors[key] != 1)).any()):
            raise BadRequest(422, f"generate: {key} holds values other than 0 and 1")
    return GenerateRequest(*(tensors[key] for key in GENERATE_KEYS))


def parse_vocab_mapping(raw: bytes, *, vocab_size: int) -> VocabMapping:
    """``selected_token_ids`` (integer ``[Vd]``, distinct ids in ``[0, V)``) and ``selected_token_mask``
    (``[V]``, set exactly at those ids), as ``RemoteEagle3TargetModel.set_vocab_mapping`` sends them."""
    tensors = _tensors(raw, "set_vocab_mapping", ("selected_token_ids", "selected_token_mask"))
    ids, mask = tensors["selected_token_ids"], tensors["selected_token_mask"]
    if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.ndim != 1 or ids.numel() == 0:
        raise BadRequest(422, f"set_vocab_mapping: selected_token_ids is {ids.dtype} {list(ids.shape)}, expected "
                              "a non-empty 1-D integer tensor")
    if mask.ndim != 1 or mask.numel() != vocab_size or mask.dtype.is_floating_point:
        raise BadRequest(422, f"set_vocab_mapping: selected_token_mask is {mask.dtype} {list(mask.shape)}, "
                              f"expected bool [{vocab_size}] (the target's vocabulary)")
    ids, mask = ids.to(torch.int64), mask.bool()
    if bool(((ids < 0) | (ids >= vocab_size)).any()) or int(ids.unique().numel()) != ids.numel():
        raise BadRequest(422, f"set_vocab_mapping: selected_token_ids must be distinct ids in [0, {vocab_size})")
    if int(mask.sum()) != ids.numel() or not bool(mask[ids].all()):
        raise BadRequest(422, "set_vocab_mapping: selected_token_mask must be set exactly at selected_token_ids")
    return VocabMapping(selected_token_ids=ids, selected_token_mask=mask)
