"""kvcal: offline K/V work on the same traces kvcanary replays: FP8 scale calibration, every
KV format emulated and scored against BF16, and advice when FP8 still loses.

    cli                                  the kvcal command: one module per subcommand
    _calibrate _verify                   one calibration; the serving-path check
    _checkpoint _scales                  overlay checkpoint and manifest; scales and advice
    _observe _sample                     K/V at the cache write; stratified samples
    _preflight                           a checkpoint folder checked before it is trusted
    emulate                              offline emulation (``kvcal emulate``): the cache and
                                         passes under it, requests, an overlay's scales,
                                         scores, sensitivity, advice and the report
    _advise                              ``kvcal advise``: what to try when FP8 still loses
      _advise_scoring _layer_tape        its settings scored fast: layer outputs kept, resumed
    _capacity                            cache bytes per layer type (sliding windows) at a length
    _kv_formats                          every emulated KV format's round trip (torch only):
      _fp8 _kv_dynamic _nvfp4            E4M3/E5M2; per-token-head INT8/FP8/INT4; NVFP4
    _backend                             per-head scales on vLLM's attention backend here
    vllm_plugin                          an emulated KV format inside a BF16 vLLM server

May import replay (its traces, buckets, run directories, targets and servers, intervals,
terminal tables); replay never imports kvcal.
"""

from replay.core.version import __version__

__all__ = ["__version__"]
