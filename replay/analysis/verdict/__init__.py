"""The stop rule: one verdict with its evidence, and an exit code a pipeline can act on.

    KEEP           FP8 at scale 1.0 matches the reference in every bucket (an exact one-sided
                   bound at alpha puts the drop below the tolerance: ``stats.equivalence``) and
                   pays for itself (``payoff``: capacity the workload needs, or goodput or
                   latency beyond the A/A floor, or requests/s where the reference's cache is
                   full).
    CALIBRATE      the scale-1.0 gap is repeatable (significant in a bucket, a consistent
                   downward shift across buckets, or a loss that grows with context length
                   beyond the A/A control's: ``trend``); or a calibrated target fixes it.
    PER-HEAD/SKIP  after calibration a localized problem remains (one bucket): try per-head
                   scales (FlashAttention only) or BF16 for the outlier layers.
    REJECT         the backend fell back (served cache dtype is not FP8, scales not applied,
                   the server refused FP8), calibrated quality still misses, or FP8 does not
                   pay (``payoff``: slower or fewer requests beyond the floor, or no gain shown,
                   with no capacity need).
    INSUFFICIENT   no loss shown, but too few graded pairs to show there is none.
    EMULATED       an FP8 arm is emulated (kvcal's plugin: a BF16 server rounding K/V through
                   E4M3): its quality evidence is reported, but no rollout decision rests on
                   it unless ``Thresholds.accept_emulated`` (``--accept-emulated``); and then
                   on quality alone, since an emulated cache has BF16's capacity and speed.

``rule.decide`` takes plain ``Facts`` (so every rule is table-tested), and leaves whether FP8
pays to ``payoff`` (the systems half, on ``analysis.systems_cells``' cells);
``facts.facts_from_run`` builds them from a run's ``Summary`` record (``schemas``) and
manifest, with the serving path's problems (``serving_path``). Tolerance, alpha and minimum
pairs come from the ``facts.Thresholds`` given, the same ones grading's evidence column uses
(``stats.evidence``). ``wording`` holds the verdicts' titles and exit codes and the sentences
of their evidence.

Every phase of a sweep counts. A bucket is judged in each phase (one ``BucketFacts`` per
phase and bucket), because the phases replay the *same* requests: pooling their pairs would
count a request once per phase, and where the servers answer alike in every phase that
multiplies the apparent evidence by the number of phases without adding any. So:

* a match (KEEP, or a calibration that works) needs the drop bounded below the tolerance in
  every phase: an intersection-union test, of level alpha whatever the dependence between
  phases (Berger 1982), and the one that asks whether batching under load changes answers;
* a loss, or a consistent shift across buckets, in any phase counts, each phase tested at
  alpha / phases (Bonferroni, valid whatever the dependence), so a sweep is not more likely to
  cry loss than a single phase. With one phase all of this is the single-phase rule.
"""
