"""kvcal: offline FP8 K/V scale calibration from the same traces kvcanary replays.

    cli                                  the kvcal command: one module per subcommand
    _calibrate _verify                   one calibration; the serving-path check
    _emulate                             offline E4M3 emulation: the cache and passes under it
    _emulate_requests _emulate_overlay   what it scores: requests, a calibrated overlay's scales
    _emulate_score _emulate_report       scores per setting; intervals, sensitivity, report
    _checkpoint _scales                  overlay checkpoint and manifest; scales and advice
    _observe _sample                     K/V at the cache write; stratified samples
    _fp8                                 vLLM's E4M3 cache write (imports torch only)
    _backend                             per-head scales on vLLM's attention backend here
    vllm_plugin                          emulated FP8 inside a BF16 vLLM server

May import replay's trace, bucketing and target code; replay never imports kvcal.
"""

from replay import __version__

__all__ = ["__version__"]
