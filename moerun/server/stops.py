"""Stop sequences over streamed text: pass text on as soon as no stop sequence can start in it."""
from __future__ import annotations


class StopMatcher:
    """Feed generated text piece by piece; get back what is safe to send.

    Text that could be the start of a stop sequence is held back until the next pieces
    rule it in or out. Once a stop sequence appears, the text before it is released and
    `stopped` is set; the sequence itself and everything after it are dropped.
    """

    def __init__(self, sequences: tuple[str, ...]):
        self.sequences = sequences
        self.stopped = False
        self._held = ""

    def push(self, text: str) -> str:
        if self.stopped:
            return ""
        held = self._held + text
        cut = min((i for i in (held.find(s) for s in self.sequences) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped, self._held = True, ""
            return held[:cut]
        keep = max((_overlap(held, s) for s in self.sequences), default=0)
        self._held = held[len(held) - keep:]
        return held[:len(held) - keep]

    def flush(self) -> str:
        """What is held back when generation ends without a stop sequence."""
        held, self._held = self._held, ""
        return held


def _overlap(text: str, sequence: str) -> int:
    """Length of the longest end of `text` that is a proper start of `sequence`."""
    for length in range(min(len(text), len(sequence) - 1), 0, -1):
        if text.endswith(sequence[:length]):
            return length
    return 0
