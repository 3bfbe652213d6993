"""The request-field policy: unknown fields ignored (reported, bounded), fields that would change
the answer refused by name."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("service.api")

_NOT_HERE = "is not supported by this prefill service"
REFUSED = {  # field -> why it is refused (each constrains or changes the first token)
    "structured_outputs": f"(structured output) {_NOT_HERE}",
    "guided_json": f"(guided decoding) {_NOT_HERE}",
    "guided_regex": f"(guided decoding) {_NOT_HERE}",
    "guided_choice": f"(guided decoding) {_NOT_HERE}",
    "guided_grammar": f"(guided decoding) {_NOT_HERE}",
    "bad_words": f"{_NOT_HERE}; allowed_token_ids or logit_bias can exclude tokens",
    "logits_processors": f"(custom logits processors) {_NOT_HERE}",
    "prompt_embeds": f"{_NOT_HERE}: send text or token ids",
    "use_beam_search": f"(beam search) {_NOT_HERE}",
    "response_format": f"other than {{\"type\": \"text\"}} {_NOT_HERE}",
    "chat_template": "(a template in the request) is not accepted: the model's own chat "
                     "template renders messages",
}

MAX_NAMES = 1024  # unknown names remembered, so that each is reported once
NAMES_READ = 64  # of one request's unknown fields: enough for a few examples, O(1) per request
REPORT_EVERY_S = 60.0
EXAMPLES = 5


class UnknownFields:
    """Unknown field names, reported at most a line per REPORT_EVERY_S; memory and work bounded."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock, self._lock = clock, threading.Lock()
        self.seen: set[str] = set()
        self._examples: list[str] = []
        self._requests = self._most = 0  # since the last line
        self._model = ""
        self._quiet_until = float("-inf")
        self._timer: threading.Timer | None = None

    def note(self, model: str, extra: dict[str, Any]) -> None:
        names = [name[:100] for name in itertools.islice(extra, NAMES_READ)]
        with self._lock:
            new = [name for name in names if name not in self.seen]
            if not new:
                return
            self.seen.update(new[:MAX_NAMES - len(self.seen)])
            if not self._requests:
                self._model = model
            self._requests += 1
            self._most = max(self._most, len(extra))
            self._examples += new[:EXAMPLES - len(self._examples)]
            if self._timer is not None:
                return  # the pending report takes these along
            wait = self._quiet_until - self._clock()
            if wait > 0:  # a timer, so that names seen in a quiet time are reported after it
                self._timer = threading.Timer(wait, self.report)
                self._timer.daemon = True
                self._timer.start()
                return
        self.report()

    def report(self) -> None:
        with self._lock:
            self._timer = None
            if not self._requests:
                return
            log.warning("ignoring unknown request fields, e.g. %s (first in a %s; %d request(s) "
                        "with new names, up to %d unknown fields in one; one such line every "
                        "%g s at most)", ", ".join(map(repr, self._examples)), self._model,
                        self._requests, self._most, REPORT_EVERY_S)
            self._examples, self._requests, self._most = [], 0, 0
            self._quiet_until = self._clock() + REPORT_EVERY_S


_unknown = UnknownFields()


def ignore_unknown(model: str, extra: dict[str, Any] | None) -> None:
    """Fields vLLM and SGLang would accept without using them: accepted, reported (bounded)."""
    if extra:
        _unknown.note(model, extra)
