"""The one analysis of a run directory (``analyse``): its results, read as its manifest's run
spec says, become grades.jsonl and summary.json; the same for a run whose analysis never ran
(``reanalyse``). The runner, the Locust adapter and ``replay report --reanalyse`` call it."""
