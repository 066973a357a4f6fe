"""A reward whose very first call in its process is a straggler (test helper for the streaming schedule): it
returns only after 8 later calls have, so the first group generated is scored last, whatever the machine's speed.
A schedule that trains groups in completion order must skip past it. When no call has come for QUIET_S seconds
the run is waiting on the straggler itself (a resumed or short run issues fewer groups; a validation's first call
waits for its own reward), and it returns then."""

import threading

from rewards.jpeg import jpeg_kb

QUIET_S = 5.0
_COND = threading.Condition()
_CALLS = [0]


def first_call_slow(images, prompts, metadata):
    with _COND:
        _CALLS[0] += 1
        n = _CALLS[0]
        _COND.notify_all()
        while n == 1 and _CALLS[0] <= 8:
            if not _COND.wait(timeout=QUIET_S):  # a quiet spell: nothing else is coming until this one returns
                break
    return [-jpeg_kb(im) for im in images]
