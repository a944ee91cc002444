"""Passes resumed at a layer score bit for bit as whole passes: on a Llama and on a hybrid
Gemma 3 (sliding-window layers), chunked, with every tape stride; and ``kvcal advise`` gives
the same report, figure for figure, whether it resumes or runs whole passes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from click.testing import CliRunner  # noqa: E402

from kvcal._advise_scoring import NoMeter, TapedScorer  # noqa: E402
from kvcal._layer_tape import Tape, first_difference, tape_stride  # noqa: E402
from kvcal.emulate.cache import uniform  # noqa: E402
from kvcal.emulate.requests import Item  # noqa: E402
from kvcal.emulate.score import bf16_answers, reference_scores  # noqa: E402
from tests.conftest import ROOT  # noqa: E402
from tests.unit.kvcal.test_kvcal_hybrid import _one_thread, tiny_gemma  # noqa: E402, F401

TRACE = ROOT / "traces" / "testmodel_heldout.jsonl"


def tiny_llama(layers: int = 6) -> Any:
    torch.manual_seed(3)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
    model = transformers.LlamaForCausalLM(config).eval().to(torch.bfloat16)
    with torch.no_grad():  # large values in some layers, so that FP8's loss is layer-specific
        for i in (1, 4):
            model.model.layers[i].self_attn.k_proj.weight.mul_(40)
    return model


def _items(n: int = 3) -> list[Item]:
    g = torch.Generator().manual_seed(7)
    items = []
    for i in range(n):
        prompt = torch.randint(3, 256, (40 + 30 * i,), generator=g).tolist()
        answer = torch.randint(3, 256, (12,), generator=g).tolist()
        items.append(Item(f"r{i}", "all", tuple(prompt), 12, tuple(answer)))
    return items


def _scores(model: Any, stride: int | None, settings: list[Any], base: Any) -> list[Any]:
    items = _items()
    ref = reference_scores(model, items, 32, lambda _n: None)
    n, tokens = model.config.num_hidden_layers, sum(len(i.prompt) + len(i.answer) for i in items)
    budget = n * 2 * tokens * model.config.hidden_size * 2 // (stride or 1)
    scorer = TapedScorer(model, items, ref, 32, whole=stride is None, budget=budget)
    assert stride is None or scorer.stride == stride
    out = [scorer.score(base, "base", keep="base")]
    for s in settings:
        out.append(scorer.score(s, s.name, keep="chain"))
    return out


@pytest.mark.parametrize("make", [tiny_llama, lambda: tiny_gemma(torch.bfloat16)])
@pytest.mark.parametrize("stride", [1, 2, 3])  # every layer's output kept, or every 2nd, 3rd
def test_resumed_passes_score_as_whole_passes_bit_for_bit(make: Any, stride: int) -> None:
    model = make()
    n = model.config.num_hidden_layers
    base = uniform("fp8@1.0", n, 1.0, "cpu")
    settings = [base.skipping([layer]) for layer in range(n)]
    settings += [base.skipping([1]), base.skipping([1, n - 1]), base.skipping([0, 1, n - 1])]
    settings.append(base.skipping([], "same as base"))
    whole = _scores(model, None, settings, base)
    resumed = _scores(model, stride, settings, base)
    assert resumed == whole
    # and the settings really differ: a resumed pass that computed nothing would agree too
    nll = [round(sum(sum(s["nll"]) for s in scores.values()), 6) for scores in whole]
    assert len(set(nll)) > n // 2


@pytest.mark.parametrize("make", [tiny_llama, lambda: tiny_gemma(torch.bfloat16)])
def test_greedy_answers_are_scored_from_their_own_prefill_bit_for_bit(make: Any) -> None:
    """The BF16 greedy answers' reference scores come from the greedy pass's own prefill
    (bf16_answers); they are those of a fresh teacher-forced pass, chunked, on a Llama and
    on a hybrid Gemma 3 whose prompts outgrow its sliding window."""
    model = make()
    items = [Item(it.id, it.bucket, it.prompt, 12) for it in _items()]
    known = bf16_answers(model, items, 32, lambda _n: None)
    assert set(known.nll) == {it.id for it in items} and all(it.answer for it in items)
    fresh = reference_scores(model, items, 32, lambda _n: None)
    assert known.nll == fresh.nll and known.argmax == fresh.argmax
    # an item whose answer a run gave keeps it, and is scored by reference_scores
    given = Item("given", "all", items[0].prompt, 12, (5, 6, 7))
    assert bf16_answers(model, [given], 32, lambda _n: None).nll == {}
    assert given.answer == (5, 6, 7) and given.bf16_greedy == items[0].answer


def test_a_pass_resumes_past_the_layers_its_setting_shares() -> None:
    model = tiny_llama()
    items = _items(1)
    ref = reference_scores(model, items, 32, lambda _n: None)
    base = uniform("fp8@1.0", 6, 1.0, "cpu")
    scorer = TapedScorer(model, items, ref, 32)
    scorer.score(base, "base", keep="base")
    assert scorer.start(base.skipping([4]), items[0])[0] == 4
    assert scorer.start(base.skipping([0]), items[0])[0] == 0
    assert scorer.start(uniform("cuda", 6, 1.0, "cuda"), items[0])[0] == 0  # another rounding
    assert scorer.start(uniform("2.0", 6, 2.0, "cpu").skipping([5]), items[0])[0] == 0
    full = scorer.work(base.skipping([0]))
    assert scorer.work(base.skipping([3])) == pytest.approx(full / 2)


def test_first_difference_and_the_stride_the_budget_asks_for() -> None:
    base = uniform("a", 4, 1.0, "cpu")
    assert first_difference(base, base.skipping([2])) == 2
    assert first_difference(base, base) == 4
    assert first_difference(base, uniform("b", 4, 1.0, "cuda")) == 0
    assert Tape(base, {0: [], 2: []}).resume_layer(base.skipping([3])) == 3
    assert Tape(base, {0: [], 2: []}).resume_layer(base.skipping([2])) == 1
    assert Tape(base, {1: []}).resume_layer(base.skipping([0])) == 0
    assert tape_stride(30, 1000, 576, 2, 1 << 30) == 1
    assert tape_stride(30, 54_000, 576, 2, 1 << 30) == 4  # 3.7 GB for every layer


def test_advise_reports_the_same_figures_resumed_or_whole(twin_dir: Path, tmp_path: Path) -> None:
    from kvcal.cli import main

    args = ["advise", str(twin_dir), "--trace", str(TRACE), "--buckets", "128,512"]
    args += ["--per-bucket", "2", "--max-new-tokens", "8"]
    docs = []
    for extra in ([], ["--whole-passes"]):
        out = tmp_path / f"advice{len(extra)}.json"
        res = CliRunner().invoke(main, [*args, *extra, "--json", str(out)])
        assert res.exit_code == 0, res.output
        docs.append(json.loads(out.read_text()))
    resumed, whole = docs
    assert resumed["passes"].startswith("resumed") and whole["passes"] == "whole"
    for key in ("settings", "ranking", "skip", "next_step"):
        assert resumed[key] == whole[key], key
    assert resumed["next_step"]["action"] == "skip_layers"
    stages = resumed["stage_seconds"]  # where the time went, stage by stage, in order
    assert list(stages) == [
        "loading",
        "BF16 greedy answers",
        "BF16 reference scores",
        "settings",
        "ranking layers",
        "confirming sets",
    ]
    assert sum(stages.values()) <= resumed["seconds"] + 0.5


class _Summaries:
    """A scorer whose summaries are given: the loss left with each set of layers in BF16."""

    def __init__(self, left: dict[tuple[int, ...], float]) -> None:
        self.left, self.whole, self.meter = left, False, NoMeter()
        self.items: list[Item] = []
        self.asked: list[tuple[int, ...]] = []

    def overall(self, setting: Any, what: str = "", keep: str | None = None) -> Any:
        self.asked.append(setting.skip)
        return {}, {"nll_delta_mean": self.left[setting.skip]}

    def drop(self, slot: str) -> None:
        pass


def test_the_search_stops_before_a_set_that_keeps_too_little_capacity() -> None:
    from kvcal._advise import AdviseArgs, confirm_skip
    from kvcal._capacity import Capacity
    from replay.serving.kv_layout import KvLayout

    cap = Capacity(KvLayout((None,) * 4, 3, 64), 8192)  # 2 of 4 layers: 1.33x, the floor
    base = uniform("fp8@1.0", 4, 1.0, "cpu")
    ranked = [{"layer": i} for i in (2, 0, 3, 1)]
    scorer = _Summaries({(2,): 0.9, (0, 2): 0.6, (0, 2, 3): 0.1})
    args = AdviseArgs(model_dir=Path("m"), max_skip_share=0.5)
    skip = confirm_skip(scorer, base, ranked, 1.0, args, cap)  # type: ignore[arg-type]
    assert scorer.asked == [(2,), (0, 2)]  # the 3-layer set would keep 1.14x: not scored
    assert skip is not None and skip["skip_layers"] == [0, 2] and not skip["reached"]
    assert skip["stopped_below_floor"]["skip_layers"] == [0, 2, 3]
    # a floor the first set misses: nothing to confirm
    args = AdviseArgs(model_dir=Path("m"), max_skip_share=0.2)
    assert confirm_skip(_Summaries({}), base, ranked, 1.0, args, cap) is None  # type: ignore[arg-type]
