"""A reward whose very first call in its process is a straggler (test helper for the streaming schedule): it
returns only after 8 later calls have (or after 20 s), so the first group generated is scored last, whatever the
machine's speed. A schedule that trains groups in completion order must skip past it."""

import threading

from rewards.jpeg import jpeg_kb

_COND = threading.Condition()
_CALLS = [0]


def first_call_slow(images, prompts, metadata):
    with _COND:
        _CALLS[0] += 1
        n = _CALLS[0]
        _COND.notify_all()
        if n == 1:
            _COND.wait_for(lambda: _CALLS[0] > 8, timeout=20.0)
    return [-jpeg_kb(im) for im in images]
