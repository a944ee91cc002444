"""Scoring advise's settings fast: shared layers replayed, progress counted in work left.

Every setting advise scores after the first few differs from a kept one only from some layer
on: each layer kept in BF16 alone differs from the base setting from that layer, each
confirmed set from the one before it from the layer it adds. :class:`TapedScorer` keeps the
base setting's layer outputs for every request (:mod:`kvcal._layer_tape`) and the latest
confirmed set's, and scores a setting by resuming each request's pass from the tape that
shares the most layers with it. Scores are bit for bit those of whole passes (a test checks);
``whole=True`` scores whole passes, as kvcal did before, for the benchmark that compares.

Work is counted as the tokens a pass computes times the share of layers it computes; the
progress line says which setting, which request, and the time left for the work known so far
(the confirmed sets are added as the search grows them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ._layer_tape import TAPE_BUDGET, Tape, decoder_layers, recording, resuming, tape_stride
from ._observe import kv_shape
from .emulate.cache import Setting, new_cache, teacher_forced
from .emulate.requests import Item
from .emulate.score import Reference, Score, tf_summary


class Meter(Protocol):
    """Where advise reports its work: ``plan`` adds work expected, ``step`` reports work
    done with what it was."""

    def plan(self, work: float) -> None: ...

    def step(self, what: str, work: float) -> None: ...


class NoMeter:
    def plan(self, work: float) -> None:
        pass

    def step(self, what: str, work: float) -> None:
        pass


def tokens(it: Item) -> int:
    return len(it.prompt) + len(it.answer)


@dataclass
class TapedScorer:
    """Scores settings over every item against the BF16 reference, resuming from kept tapes
    (``keep`` names the slot a setting's tapes are kept in, replacing the slot's last)."""

    model: Any
    items: Sequence[Item]
    ref: Reference
    chunk: int
    meter: Meter = field(default_factory=NoMeter)
    whole: bool = False
    budget: int = TAPE_BUDGET
    tapes: dict[str, dict[str, Tape]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        layers, kv_heads, head_dim = kv_shape(self.model.config)
        self.layers = None if self.whole else decoder_layers(self.model)
        self.count = layers
        self.kv = (kv_heads, head_dim)
        text = self.model.config
        text = text.get_text_config() if hasattr(text, "get_text_config") else text
        elem = next(self.model.parameters()).element_size()
        total = sum(tokens(it) for it in self.items)
        self.stride = tape_stride(layers, total, int(text.hidden_size), elem, self.budget)
        self.kept = [i for i in range(layers) if i % self.stride == self.stride - 1]

    def start(self, setting: Setting, it: Item) -> tuple[int, Tape | None]:
        """The layer ``setting``'s pass over ``it`` starts at, and the tape it resumes from."""
        best: tuple[int, Tape | None] = (0, None)
        for slot in self.tapes.values():
            tape = slot.get(it.id)
            if tape is not None and (at := tape.resume_layer(setting)) > best[0]:
                best = (at, tape)
        return best

    def work(self, setting: Setting) -> float:
        """The work a setting's passes will take (tokens x share of layers computed)."""
        return sum(tokens(it) * (1 - self.start(setting, it)[0] / self.count) for it in self.items)

    def score(self, setting: Setting, what: str, keep: str | None = None) -> dict[str, Score]:
        out: dict[str, Score] = {}
        for n, it in enumerate(self.items, 1):
            at, parent = self.start(setting, it) if self.layers else (0, None)
            nll, top = self._pass(setting, it, at, parent, keep)
            agree = [a == b for a, b in zip(top, self.ref.argmax[it.id], strict=True)]
            out[it.id] = {"n": len(nll), "nll": nll, "top1": agree, "error": None}
            self.meter.step(
                f"{what}: request {n}/{len(self.items)}", tokens(it) * (1 - at / self.count)
            )
        return out

    def _pass(
        self, setting: Setting, it: Item, at: int, parent: Tape | None, keep: str | None
    ) -> tuple[list[float], list[int]]:
        cache = new_cache(self.model, setting)
        if self.layers is None:
            return teacher_forced(self.model, it.prompt, it.answer, cache, self.chunk)
        shared = {} if parent is None else {k: v for k, v in parent.outputs.items() if k < at}
        tape = Tape(setting, shared)
        keep_layers = [i for i in self.kept if i >= at] if keep else []
        with (
            resuming(self.layers, parent or tape, at, self.kv),
            recording(self.layers, keep_layers, tape),
        ):
            scored = teacher_forced(self.model, it.prompt, it.answer, cache, self.chunk)
        if keep:
            self.tapes.setdefault(keep, {})[it.id] = tape
        return scored

    def overall(
        self, setting: Setting, what: str | None = None, keep: str | None = None
    ) -> tuple[dict[str, Score], dict[str, Any]]:
        scores = self.score(setting, what or f"scoring {setting.name}", keep)
        return scores, tf_summary(scores, self.ref, [it.id for it in self.items])

    def drop(self, slot: str) -> None:
        self.tapes.pop(slot, None)
