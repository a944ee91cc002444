"""The run directory's format, which both drivers write and everything else reads: its files
and how they are written and read (``files``), the manifest (``manifest``), the load processes'
shard files (``shard_files``), the sequential canary's state (``sequential_file``), what a
resume finds done (``resume``), the lock one process holds on a run (``run_lock``), and the run
read back as data (``rundata``, ``export_files``)."""
