"""Paired statistics for FP8-vs-BF16 comparisons, one context-length bucket at a time.

Both targets answer the *same* requests, so every comparison is paired: request i graded on
BF16 (``a``, the reference) and on FP8 (``b``, the candidate). Pairing removes the
request-to-request variation (easy vs hard prompts) that would otherwise swamp a small FP8
effect, which is why nothing here compares two independent pass rates.

* ``intervals`` - a pass rate's Wilson interval for one target in one bucket, and the FP8 -
  BF16 mean difference with a paired percentile-bootstrap interval.
* ``exact_tests`` - exact McNemar (do the targets disagree in one direction more often than
  chance within one bucket?) and the stratified tests for a *consistent* downward FP8 shift
  across buckets, which can be significant even when no single bucket is (the Kimi-K2.5
  pattern: a small drift in every length bucket, not a few noisy failures).
* ``trend`` - the slope of the paired difference against log2(prompt tokens): how much it
  changes per doubling of context, with an interval from a bootstrap within buckets (a loss
  that grows with length, which a per-bucket test reads only as several small losses).
* ``equivalence`` - the exact one-sided bound that shows a bucket's drop is below the
  tolerance, and the rule's defaults (tolerance, alpha, minimum pairs).
* ``power`` - the exact chance that n pairs show equivalence, and from it how many pairs a
  bucket needs.
* ``evidence`` - what a bucket's pairs settle (a loss, or a drop bounded below the tolerance),
  and while they settle neither, how many pairs it needs, in words.
* ``rule`` - the evidence rule (tolerance, alpha, minimum pairs, the sequential canary's alpha
  split), checked once, that applies ``evidence`` and ``equivalence`` to a bucket's pairs.
* ``binomial`` and ``pairs`` - the exact binomial tails and the checked paired inputs the
  others share.

Everything is pure and deterministic, with no I/O: randomness comes only from a private
``np.random.default_rng(seed)``. Exact binomial tails use integer arithmetic (``math.comb``
style) up to ``binomial.EXACT_MAX`` trials and log-space sums beyond.
"""
