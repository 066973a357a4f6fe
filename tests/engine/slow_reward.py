"""A reward whose very first call in its run is a straggler (test helper for the streaming schedule): it returns only
after 8 later calls have, so the first group generated is scored last, whatever the machine's speed. A schedule that
trains groups in completion order must skip past it. When no call has come for QUIET_S seconds the run is waiting on
the straggler itself (a resumed or short run issues fewer groups; a validation's first call waits for its own
reward), and it returns then.

A class (`reward.name=tests.engine.slow_reward:FirstCallSlow`): each run's reward is a new instance, so "first"
means the run's first, also on a host kept from an earlier run (gerl/engine/pool.py), where a module-level counter
would still hold the earlier run's calls."""

import threading

from rewards.jpeg import jpeg_kb

QUIET_S = 5.0


class FirstCallSlow:
    def __init__(self):
        self.cond, self.calls = threading.Condition(), 0

    def __call__(self, images, prompts, metadata):
        with self.cond:
            self.calls += 1
            n = self.calls
            self.cond.notify_all()
            while n == 1 and self.calls <= 8:
                if not self.cond.wait(timeout=QUIET_S):  # a quiet spell: nothing else is coming until this one returns
                    break
        return [-jpeg_kb(im) for im in images]
