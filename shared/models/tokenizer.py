"""A byte-level tokenizer built in code: ids 0-255 are bytes, then PAD, BOS, EOS."""

from __future__ import annotations

from collections.abc import Iterable

PAD_ID = 256
BOS_ID = 257
EOS_ID = 258
VOCAB_SIZE = 259


class ByteTokenizer:
    """UTF-8 bytes as tokens. Small, lossless, and needs no files."""

    pad_id = PAD_ID
    bos_id = BOS_ID
    eos_id = EOS_ID
    vocab_size = VOCAB_SIZE

    def encode(self, text: str, *, bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [BOS_ID, *ids] if bos else ids

    def decode(self, ids: Iterable[int]) -> str:
        """Decode up to the first EOS; special ids are dropped, invalid UTF-8 is replaced."""
        out = bytearray()
        for i in ids:
            i = int(i)
            if i == EOS_ID:
                break
            if 0 <= i < 256:
                out.append(i)
        return out.decode("utf-8", errors="replace")
