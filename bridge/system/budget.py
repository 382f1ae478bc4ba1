"""A budget of calls: a token bucket that the Slurm client spends one token per command from.

Slurm's own RPC rate limiting (``SlurmctldParameters=rl_enable``, Slurm 23.02+) is a token
bucket per user: ``rl_bucket_size`` tokens (30), refilled by ``rl_refill_rate`` (2) every
``rl_refill_period`` seconds (1). A service account that stays within such a bucket is never
told to back off. The bucket itself is pyrate-limiter's ``TokenBucket`` (GCRA, one number of
state); this module adds what the poller needs of it: a look at what is left (so a step can
leave tokens to more urgent ones and do less this cycle), and a blocking take that counts its
waits.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from pyrate_limiter import AbstractClock, Rate, RateItem, StateBucket, TokenBucket

from bridge.system import metrics

#: pyrate-limiter counts in integer milliseconds: a rate is `_SCALE` tokens per this many ms.
_SCALE = 1000


class _Clock(AbstractClock):
    """pyrate-limiter's clock (milliseconds) over ours (seconds), so tests can move time."""

    def __init__(self, seconds: Callable[[], float]) -> None:
        self.seconds = seconds

    def now(self) -> int:
        return int(self.seconds() * 1000)


class CallBudget:
    """At most `burst` calls at once, then `rate` calls per second; `rate` 0: no limit."""

    def __init__(
        self,
        rate: float,
        burst: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.clock = clock
        self.sleep = sleep
        self.rate = 0.0
        self.burst = 0
        self._bucket: StateBucket | None = None
        #: The configured rate and burst, which limit_to never raises.
        self.setting = (rate, burst)
        #: Tokens taken so far.
        self.spent = 0
        self.set(rate, burst)

    @classmethod
    def unlimited(cls) -> CallBudget:
        return cls(0.0, 0)

    def set(self, rate: float, burst: int) -> None:
        """A new rate and burst; the bucket starts full again (only when they change)."""
        rate, burst = (0.0, 0) if rate <= 0 else (rate, max(1, int(burst)))
        if (rate, burst) == (self.rate, self.burst):
            return
        self.rate, self.burst = rate, burst
        if not rate:
            self._bucket = None
            return
        # _SCALE tokens per (_SCALE / rate) s: a whole number of ms however fine the rate.
        interval_ms = max(1, round(_SCALE * 1000 / rate))
        self._bucket = StateBucket(
            [Rate(_SCALE, interval_ms, burst=burst)],
            algorithm=TokenBucket(),
            clock=_Clock(self.clock),
        )

    def limit_to(self, rate: float | None, burst: int | None) -> None:
        """The setting, lowered to this limit (a cluster's); None: the setting alone."""
        self.set(*lower_of(*self.setting, rate, burst))

    def available(self) -> int:
        """Whole tokens left now (a large number when unlimited)."""
        if self._bucket is None:
            return 1 << 30
        spent = self._bucket.count()
        assert isinstance(spent, int)
        return max(0, self.burst - spent)

    def allows(self, keep: int = 0, command: str = "", cost: int = 1) -> bool:
        """Whether a call of `cost` tokens may go now and still leave `keep` tokens for more
        urgent ones; a refusal is counted as a wait of `command` (the work is left for a later
        cycle)."""
        if self.available() >= cost + keep:
            return True
        self.note_wait(command or "?")
        return False

    def note_wait(self, command: str) -> None:
        """Work that needed `command` was left for later for the budget."""
        metrics.observe_budget_wait(command)

    def take(self, command: str, cost: int = 1) -> float:
        """`cost` tokens (at most the burst), waiting for them when there are too few; returns
        the seconds waited."""
        self.spent += cost
        if self._bucket is None:
            return 0.0
        waited = 0.0
        while True:
            item = RateItem(command, int(self.clock() * 1000), weight=min(cost, self.burst))
            if self._bucket.put(item):
                return waited
            wait_ms = self._bucket.waiting(item)
            assert isinstance(wait_ms, int)
            if not waited:
                metrics.observe_budget_wait(command)
            delay = max(wait_ms, 1) / 1000
            self.sleep(delay)
            waited += delay

    def describe(self) -> str:
        if not self.rate:
            return "no limit"
        return f"{self.rate:g} calls/s, bursts of {self.burst}"


def lower_of(
    rate: float, burst: int, cluster_rate: float | None, cluster_burst: int | None
) -> tuple[float, int]:
    """The setting, lowered to the cluster's limit where it has one (`rate` 0: the
    setting has no limit, so the cluster's applies)."""
    if cluster_rate is not None and cluster_rate > 0:
        rate = cluster_rate if rate <= 0 else min(rate, cluster_rate)
    if cluster_burst is not None and cluster_burst > 0:
        burst = cluster_burst if burst <= 0 else min(burst, cluster_burst)
    return rate, max(1, burst) if rate > 0 else burst
