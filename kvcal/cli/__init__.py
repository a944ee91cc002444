"""``kvcal``: calibrate FP8 K/V scales from the traffic you serve.

    kvcal sample MODEL --trace T -o DIR       stratified calibration ids, evaluation ids, samples
    kvcal calibrate MODEL --samples F -o OUT  observe K/V, scales, overlay checkpoint, manifest
    kvcal verify OUT                          did an FP8 server apply the scales? (or refuse?)
    kvcal inspect MODEL                       what KV scheme and k/v scales a checkpoint carries
    kvcal emulate MODEL --trace T             FP8 quality offline: E4M3 at the cache write
    kvcal advise MODEL --trace T --overlay O  still losing: BF16 layers, per-head, rounding?

Exit codes: 0 done (verify: scales applied); 1 verify: not applied; 2 bad input (a broken
checkpoint, ``inspect --strict``'s unusable scales, or a missing optional dependency); 3 verify:
the FP8 server refused (unsupported on this backend).

One module per command; ``common`` runs them (errors, exit codes), ``tables`` draws their
reports. Nothing here imports torch, transformers, safetensors or vLLM at import time: each
command imports what it needs once it has checked it is installed (:mod:`replay.core.extras`).
"""

from __future__ import annotations

import click

from .advise import advise_cmd
from .calibrate import calibrate_cmd
from .emulate import emulate_cmd
from .inspect import inspect_cmd
from .sample import sample_cmd
from .verify import verify_cmd

__all__ = ["main"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Calibrate FP8 K/V scales from the traffic you serve (see docs/kvcal.md)."""


for command in (inspect_cmd, sample_cmd, calibrate_cmd, verify_cmd, emulate_cmd, advise_cmd):
    main.add_command(command)
