"""The training progress line: steps done, smoothed loss and tokens per second (tqdm)."""

from __future__ import annotations

import sys

from tqdm import tqdm


class Progress:
    """`train_tiny: 120/2000 steps [..] loss=1.234, tok/s=12,345` (tqdm) on stderr when it is a terminal."""

    def __init__(self, total: int, start: int, stream=None):
        stream = stream if stream is not None else sys.stderr
        self.bar = tqdm(total=total, initial=start, desc="train_tiny", unit="step", file=stream,
                        disable=not stream.isatty(), mininterval=0.5)

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        self.bar.set_postfix_str(f"loss {loss:.3f}  {tokens_per_s:,.0f} tok/s", refresh=False)
        self.bar.update(step - self.bar.n)

    def close(self) -> None:
        self.bar.close()

