"""Trace tooling beside the replay: anonymize, scan, and the PII detectors they use."""
