"""kvcal: offline FP8 K/V scale calibration from the same traces kvcanary replays.

    cli                                  sample, calibrate, verify, inspect
    _calibrate _verify                   one calibration; the serving-path check
    _checkpoint _scales                  overlay checkpoint and manifest; scales and advice
    _observe _sample                     K/V at the cache write; stratified samples

May import replay's trace, bucketing and target code; replay never imports kvcal.
"""

from replay import __version__

__all__ = ["__version__"]
