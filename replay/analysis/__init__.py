"""From results to a decision: typed schemas of summary.json, the summary, grading, systems
metrics, statistics, roles of the targets and the verdict. No I/O of its own beyond what its
callers hand it."""
