"""One replay: the run directory and its format, the runner and its phase loop, resume, the
error budget, trace exclusion, teacher-forced scoring, and the run read back as data."""
