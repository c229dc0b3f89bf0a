"""Seeds: 0..2**63-1 in every command, and torch generators that keep every bit of them.

torch's CPU generator (MT19937) keeps only the low 32 bits of the number given to
``manual_seed``, so seeds s and s + 2**32 would give the same inputs. Here a value that
fits in 32 bits seeds the generator exactly as ``manual_seed`` does (the inputs of every
earlier release stay the same); a larger value fills the generator's whole state from all
of its bits with MT19937's reference ``init_by_array`` (the seeding of Python's own
``random``, which keeps every bit), so two different seeds never share a state through
truncation. Values derived from a seed (``seed + 1``, a case's hash mixed in) go through
the same function, whatever their size.
"""

from __future__ import annotations

import hashlib
import random
import struct
from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SEED_MAX = 2**63 - 1
_WORDS = 624  # MT19937's state
_STATE_AT = 24  # byte offset of the state words in the CPU generator's state tensor (checked below)


def generator(value: int) -> "torch.Generator":
    """A CPU ``torch.Generator`` determined by every bit of ``value`` (a non-negative integer)."""
    import torch

    g = torch.Generator()
    if value < 0:
        raise ValueError(f"generator seed must be non-negative, got {value}")
    if value < 1 << 32:
        return g.manual_seed(value)
    template = _template()
    if template is None:  # an unknown state layout: fall back to 32 bits chosen by hashing all of them
        return g.manual_seed(_hash32(value))
    g.set_state(_state(value, template))
    return g


def manual_seed(value: int) -> None:
    """``torch.manual_seed`` for the global generators, keeping every bit of ``value`` on the CPU."""
    import torch

    torch.manual_seed(value % (1 << 64))
    if value >= 1 << 32:
        torch.default_generator.set_state(generator(value).get_state())


def _hash32(value: int) -> int:
    return int.from_bytes(hashlib.blake2b(str(value).encode(), digest_size=4).digest(), "little")


@lru_cache(maxsize=1)
def _template() -> bytes | None:
    """A freshly seeded CPU generator's state, if its layout is the one written to (else None)."""
    import torch

    raw = bytes(torch.Generator().manual_seed(1).get_state().tolist())
    if len(raw) < _STATE_AT + 8 * _WORDS:
        return None
    first, second = struct.unpack_from("<QQ", raw, _STATE_AT)
    left, seeded = struct.unpack_from("<ii", raw, 8)
    # MT19937's init_genrand(1): word 0 is 1 and word 1 is 1812433253 * (1 ^ (1 >> 30)) + 1
    if (first, second, left, seeded) != (1, 1812433254, 1, 1):
        return None
    return raw


def _state(value: int, template: bytes) -> "torch.Tensor":
    """The state tensor of a generator whose MT19937 words come from ``init_by_array`` over ``value``."""
    import torch

    words = random.Random(value).getstate()[1][:_WORDS]
    raw = bytearray(template)
    struct.pack_into("<Q", raw, 0, value % (1 << 64))  # the initial seed torch reports
    struct.pack_into("<iiQ", raw, 8, 1, 1, 0)  # left = 1, seeded, next = 0: the words are regenerated on first use
    struct.pack_into(f"<{_WORDS}Q", raw, _STATE_AT, *words)
    return torch.tensor(list(raw), dtype=torch.uint8)
