"""Traces: the v1 format (one request per line, validated at load with file, line and field),
multi-turn sessions, synthetic prompts, and the importers of other formats. Above
``replay.checkers``, whose specs a trace's ``check`` fields are validated against."""
