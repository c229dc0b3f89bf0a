"""The inputs a scanned forward runs on: token ids, their padding, and position ids as ``generate()`` makes them.

Made here, in the tool's process, from a seed (the worker only runs the model on them), so the judge
knows exactly which positions are padding. Axes: B examples, T positions (Td for a decoder's).

* Padding: example ``b`` has ``pads[b]`` padded positions (:func:`pad_counts`): none for the first
  example and about half the sequence for the last, so one batch holds an unpadded row and a heavily
  padded one; with one example, a quarter. ``left`` puts them first (as decoders generate), ``right`` last.
* Position ids (decoders): ``attention_mask.cumsum(-1) - 1``, padded positions set to 1, as
  ``GenerationMixin`` makes them; ``arange(T)`` without padding.
* Encoders take ids and the mask; an encoder-decoder (T5) also gets ``decoder_input_ids`` of ``Td``
  tokens, the first the decoder's start token, unpadded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from attn_ledger.errors import InputError

if TYPE_CHECKING:
    from torch import Tensor

PADDINGS = ("none", "left", "right")
ARCHITECTURES = ("decoder", "encoder", "encoder-decoder")
MAX_BATCH = 4096
MAX_SEQ_LEN = 1 << 17


@dataclass(frozen=True)
class InputPlan:
    """How the inputs are made: sizes, padding side, seed, and the decoder's length (encoder-decoders)."""

    batch: int = 2
    seq_len: int = 24
    padding: str = "none"
    seed: int = 0
    decoder_len: int | None = None

    def __post_init__(self) -> None:
        if self.padding not in PADDINGS:
            raise InputError(f"--padding: got {self.padding!r}, expected one of {', '.join(PADDINGS)}")
        for name, value, lo, hi in (("--batch", self.batch, 1, MAX_BATCH), ("--seq-len", self.seq_len, 2, MAX_SEQ_LEN)):
            if not lo <= value <= hi:
                raise InputError(f"{name}: got {value}, expected a whole number from {lo} to {hi}")
        if self.decoder_len is not None and not 1 <= self.decoder_len <= MAX_SEQ_LEN:
            raise InputError(f"--decoder-len: got {self.decoder_len}, expected a whole number from 1 to {MAX_SEQ_LEN}")

    def to_json(self) -> dict[str, Any]:
        return {"batch": self.batch, "seq_len": self.seq_len, "padding": self.padding, "seed": self.seed,
                "decoder_len": self.decoder_len}


def pad_counts(batch: int, seq_len: int, padding: str) -> list[int]:
    """Padded positions per example (see the module docstring); every example keeps at least one token."""
    if padding == "none":
        return [0] * batch
    if batch == 1:
        return [seq_len // 4]
    return [min(seq_len - 1, round(b * seq_len / (2 * (batch - 1)))) for b in range(batch)]


def valid_positions(pads: list[int], seq_len: int, padding: str) -> "Tensor":
    """``[B, T]`` bool: True where a position holds a real token."""
    import torch

    pos = torch.arange(seq_len)  # [T]
    counts = torch.tensor(pads)[:, None]  # [B, 1]
    return pos[None, :] >= counts if padding == "left" else pos[None, :] < seq_len - counts


def generate_positions(attention_mask: "Tensor") -> "Tensor":
    """``[B, T]`` position ids as ``generate()`` makes them from a padding mask."""
    pos = attention_mask.long().cumsum(-1) - 1  # [B, T]
    return pos.masked_fill(attention_mask == 0, 1)


def make_inputs(plan: InputPlan, facts: Mapping[str, Any]) -> dict[str, "Tensor"]:
    """The forward's keyword arguments, from ``facts`` the worker said of the model: ``architecture``
    (:data:`ARCHITECTURES`), ``vocab_size``, ``pad_token_id``, ``decoder_start_token_id`` and
    ``takes_position_ids``.

    Raises:
        InputError: ``--decoder-len`` for a model that has no decoder input.
    """
    import torch

    from attn_ledger.seeding import generator

    arch = facts["architecture"]
    config = facts.get("config") or {}
    for key in ("max_position_embeddings", "n_positions"):
        most = config.get(key)
        longest = max(plan.seq_len, plan.decoder_len or 0)
        if isinstance(most, int) and 0 < most < longest:
            raise InputError(f"--seq-len: got {longest}, expected at most {most}, the config's {key} "
                             f"(--set {key}=N lengthens it)")
    if plan.decoder_len is not None and arch != "encoder-decoder":
        raise InputError(f"--decoder-len: got {plan.decoder_len}, expected it only for an encoder-decoder model "
                         f"(this one is {'a ' + arch if arch != 'encoder' else 'an encoder'})")
    vocab = int(facts.get("vocab_size") or 2)
    pad = int(facts.get("pad_token_id") or 0)
    g = generator(plan.seed)
    b, t = plan.batch, plan.seq_len
    ids = torch.randint(1 if vocab > 1 else 0, max(vocab, 2), (b, t), generator=g)  # [B, T]
    valid = valid_positions(pad_counts(b, t, plan.padding), t, plan.padding)  # [B, T]
    ids = ids.masked_fill(~valid, pad)
    mask = valid.long()
    out: dict[str, Tensor] = {"input_ids": ids, "attention_mask": mask}
    if arch != "encoder-decoder" and facts.get("takes_position_ids", True):
        # as generate() makes them: a left-padded example's first real token at 0, as a right-padded one's (an
        # encoder's absolute position embeddings would otherwise tell the two sides apart)
        out["position_ids"] = generate_positions(mask)
    if arch == "encoder-decoder":
        td = plan.decoder_len or t
        dec = torch.randint(1 if vocab > 1 else 0, max(vocab, 2), (b, td), generator=g)  # [B, Td]
        dec[:, 0] = int(facts.get("decoder_start_token_id") or pad)
        out["decoder_input_ids"] = dec
    return out


DECODE_STEPS = 8
"""Tokens ``--vary cache`` decodes one at a time after its prefill (fewer where the sequence is shorter)."""


def prefill_length(seq_len: int, pads: list[int]) -> int:
    """Where ``--vary cache``'s prefill ends: the last :data:`DECODE_STEPS` tokens (fewer where an example has
    few real tokens) are decoded one at a time, so every example's prefill holds at least one real token; 0 where
    an example has fewer than two real tokens (nothing to both prefill and decode)."""
    real = seq_len - max(pads, default=0)
    steps = min(DECODE_STEPS, real - 1)
    return seq_len - steps if steps >= 1 else 0
