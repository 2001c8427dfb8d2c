"""Token ids to text deltas for one request, ending before the first stop string.

Stop strings apply to the decoded text, not to tokens: a stop string may span tokens or start inside one. So
the stream holds back the longest tail of the text that could still begin a stop string, and when one
appears it returns the text before it and stops; the stop string itself is never sent.
"""

from __future__ import annotations

from dsparkjax.tokenizer import Tokenizer


class TextStream:
    """Text deltas of one generated sequence (control tokens such as EOS give no text)."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = ()):
        self._decoder = tokenizer.incremental_decoder(skip_special=True)
        self._stop = stop
        self._held = ""
        self.stopped = False  # a stop string was found: nothing more comes

    def push(self, token_id: int) -> str:
        """Add one token; returns the text that is now certain to be sent."""
        if self.stopped:
            return ""
        return self._cut(self._held + self._decoder.push(token_id), final=False)

    def flush(self) -> str:
        """End the sequence (length or EOS): the held-back text, which can no longer start a stop string."""
        if self.stopped:
            return ""
        return self._cut(self._held + self._decoder.flush(), final=True)

    def _cut(self, text: str, final: bool) -> str:
        found = [i for i in (text.find(s) for s in self._stop) if i >= 0]
        if found:
            self.stopped, self._held = True, ""
            return text[: min(found)]
        keep = 0 if final else max((_overlap(text, s) for s in self._stop), default=0)
        self._held = text[len(text) - keep:]
        return text[: len(text) - keep]


def _overlap(text: str, stop: str) -> int:
    """The length of the longest tail of `text` that is a proper prefix of `stop`."""
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
