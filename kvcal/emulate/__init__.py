"""Offline emulation of quantized KV caches: what ``kvcal emulate`` (and ``kvcal advise``)
measure, each format's round trip at the cache write in transformers, scored against BF16.

    cache         the emulating cache (a ``Setting``) and the passes under it
    requests      the requests scored: drawn per bucket from a trace or a replay run
    overlay       a calibrated overlay's k/v scales, as a setting
    score         every request scored under a setting; summaries with intervals
    sensitivity   per-layer sensitivity, and the layers to keep in BF16
    advice        capacity per setting, ΔNLL-per-token bound, rounding shares
    report        the run: settings in, the report out (``emulate``)
"""

from .cache import Setting
from .report import EmulateArgs, emulate

__all__ = ["EmulateArgs", "Setting", "emulate"]
