"""From results to a decision: typed schemas of summary.json and the manifest, the run spec and
the stop rule's thresholds, the results as a table, the summary (SLOs, sessions, server
figures), grading, the systems comparison and the systems rule's cells, saturation, capacity
(per layer type too), reasoning length, statistics, the sequential canary's evidence, roles of
the targets and the verdict. It reads no run directory: its callers hand it results, grades and
the manifest; the verdict alone reads kvcal's files (``--advice``'s JSON and a calibrated
target's ``kvcal_report.json``)."""
