"""The sandbox's trusted harness: these modules are joined into one script (``kvc_harness.py``)
that runs inside the sandbox with the standard library only (see ``runner``'s docstring). They
import only each other, by relative imports the join drops."""
