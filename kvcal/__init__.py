"""kvcal: offline FP8 K/V scale calibration from the same traces kvcanary replays.

May import replay's trace and bucketing code; replay never imports kvcal.
"""
