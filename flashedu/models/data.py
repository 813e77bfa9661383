"""The training text and its tokenizer: bytes in, bytes out (vocabulary 256).

A byte-level tokenizer needs no vocabulary file and no download, and any text round-trips.
The corpus ships in the package (``flashedu/data/kjv.txt``; provenance and licence in the
README beside it).
"""

from __future__ import annotations

from importlib import resources

import torch

VOCAB_SIZE = 256
CORPUS = "kjv.txt"


def encode(text: str) -> torch.Tensor:
    """text -> int64 tensor of its UTF-8 bytes."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.int64)


def decode(ids) -> str:
    """token ids -> text (bytes that do not form valid UTF-8 become U+FFFD)."""
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def load_corpus(name: str = CORPUS) -> torch.Tensor:
    """The shipped corpus as a 1-D uint8 tensor of bytes."""
    raw = resources.files("flashedu").joinpath("data", name).read_bytes()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def split(data: torch.Tensor, val_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, val): the last ``val_fraction`` of the text is held out, unseen in training."""
    n_val = int(len(data) * val_fraction)
    return data[: len(data) - n_val], data[len(data) - n_val:]


def get_batch(data: torch.Tensor, batch_size: int, seq_len: int,
              generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows: inputs x = data[i:i+T] and next-token targets y = data[i+1:i+T+1].

    The generator is the trainer's own, so a resumed run draws exactly the batches the
    uninterrupted run would have drawn.
    """
    if len(data) <= seq_len:
        raise ValueError(f"the text has {len(data)} tokens, too few for seq_len={seq_len}")
    starts = torch.randint(len(data) - seq_len, (batch_size,), generator=generator)
    window = starts[:, None] + torch.arange(seq_len + 1)
    chunk = data[window].long()
    return chunk[:, :-1], chunk[:, 1:]
