"""kvcal: offline FP8 K/V scale calibration from the same traces kvcanary replays.

    cli                                  the kvcal command: one module per subcommand
    _calibrate _verify                   one calibration; the serving-path check
    _emulate                             offline emulation: the cache and passes under it
    _emulate_requests _emulate_overlay   what it scores: requests, a calibrated overlay's scales
    _emulate_score _emulate_report       scores per setting; intervals, sensitivity, report
    _checkpoint _scales                  overlay checkpoint and manifest; scales and advice
    _observe _sample                     K/V at the cache write; stratified samples
    _preflight                           a checkpoint folder checked before it is trusted
    _emulate_advice                      capacity per setting, tolerance, rounding shares
    _capacity                            cache bytes per layer type (sliding windows) at a length
    _kv_formats                          every emulated KV format's round trip (torch only):
      _fp8 _kv_dynamic _nvfp4            E4M3/E5M2; per-token-head INT8/FP8/INT4; NVFP4
    _backend                             per-head scales on vLLM's attention backend here
    vllm_plugin                          an emulated KV format inside a BF16 vLLM server

May import replay's trace, bucketing and target code; replay never imports kvcal.
"""

from replay import __version__

__all__ = ["__version__"]
