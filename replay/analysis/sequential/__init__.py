"""The sequential canary's statistics (``replay canary --sequential``): the state it keeps of
every bucket's pairs and decisions (``state``), the always-valid betting capital it decides on
(``capital``), what each open bucket still needs and how a round is split (``plan``), and the
summary's ``Sequential`` block with its comparison to the fixed design (``summary``).

Its other parts sit in the layer each belongs to: the record the summary holds
(``analysis/schemas/sequential.py``), the run order that sends the rounds and its state file
(``run/sequential_run.py``, ``rundir/sequential_file.py``) and the report's views
(``present/views/sequential.py``)."""
