"""kvcal without a server: scales against an independent computation, the overlay checkpoint,
sampling, statistics, and the replay-side exclusion and overlap refusal."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from click.testing import CliRunner  # noqa: E402

from kvcal._calibrate import Recipe, calibrate  # noqa: E402
from kvcal._checkpoint import (  # noqa: E402
    INDEX,
    MANIFEST,
    SCALES_SHARD,
    SINGLE_FILE_LINK,
    recipe_yaml,
)
from kvcal._observe import KVStats, load_model, observe  # noqa: E402
from kvcal._sample import PromptRenderer, Sample, draw, read_samples, split_key  # noqa: E402
from kvcal._scales import (  # noqa: E402
    E4M3_MAX,
    estimated_mse,
    fraction_above,
    fraction_below,
    mse_search,
    tensor_reports,
    tiny,
)
from kvcal._verify import NOT_APPLIED, ServerCheck, _decide, compare_scores  # noqa: E402
from replay.core.buckets import Buckets  # noqa: E402
from replay.core.errors import ConfigError, InputError  # noqa: E402
from replay.run.exclude import Exclusion, read_ids, refuse_overlap  # noqa: E402
from replay.run.teacher import TFScore  # noqa: E402
from replay.serving.targets import TargetSpec, parse_targets  # noqa: E402
from replay.traces.trace import Request  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
SAMPLE_TRACE = ROOT / "traces" / "sample.jsonl"


def build_test_model(factory: pytest.TempPathFactory) -> Path:
    """A Llama checkpoint of our own (the test model's builder, random weights): kvcal must
    work on any Llama-family folder, and these tests must not move when the default model
    is replaced."""
    from replay.testmodel.factory import build

    return build(factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_test_model(tmp_path_factory)


def _requests() -> list[Request]:
    return [
        Request.model_validate(json.loads(line))
        for line in SAMPLE_TRACE.read_text(encoding="utf-8").splitlines()
        if line.strip()
    ]


def _samples(model_dir: Path, n: int = 6) -> list[Sample]:
    from transformers import AutoTokenizer

    renderer = PromptRenderer(AutoTokenizer.from_pretrained(str(model_dir)))
    split = draw(_requests(), renderer, Buckets.parse("128,512"), per_bucket=n, seed=3)
    return split.calibration


def _rotate_half(x: Any) -> Any:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@torch.inference_mode()
def _independent_amax(model: Any, samples: list[Sample]) -> Any:
    """amax per (K/V, layer, head) from a plain forward without any cache: k_proj/v_proj
    outputs captured by hooks, RoPE applied here by hand with the model's cos/sin."""
    cfg = model.config
    heads, dim = cfg.num_key_value_heads, cfg.head_dim
    out = torch.zeros(2, cfg.num_hidden_layers, heads)
    captured: dict[str, Any] = {}
    hooks = [
        model.model.rotary_emb.register_forward_hook(
            lambda m, i, o: captured.__setitem__("rope", o)
        )
    ]
    for li, layer in enumerate(model.model.layers):
        for name, proj in (("k", layer.self_attn.k_proj), ("v", layer.self_attn.v_proj)):
            hooks.append(
                proj.register_forward_hook(
                    lambda m, i, o, key=f"{name}{li}": captured.__setitem__(key, o)
                )
            )
    try:
        for s in samples:
            model(input_ids=torch.tensor([list(s.input_ids)]), use_cache=False)
            cos, sin = (t.unsqueeze(1) for t in captured["rope"])
            for li in range(cfg.num_hidden_layers):
                k = captured[f"k{li}"].view(1, -1, heads, dim).transpose(1, 2).float()
                v = captured[f"v{li}"].view(1, -1, heads, dim).transpose(1, 2).float()
                k = k * cos.float() + _rotate_half(k) * sin.float()
                out[0, li] = torch.maximum(out[0, li], k.abs().amax(dim=(0, 2, 3)))
                out[1, li] = torch.maximum(out[1, li], v.abs().amax(dim=(0, 2, 3)))
    finally:
        for h in hooks:
            h.remove()
    return out


def test_scales_match_an_independent_amax_over_448(model_dir: Path) -> None:
    """Observation at the cache write, chunked (32-token chunks), over every sample, equals
    post-RoPE amax from a plain forward, for every layer and head."""
    model = load_model(str(model_dir), "float32")
    samples = _samples(model_dir, 2)
    assert len(samples) >= 4 and max(len(s.input_ids) for s in samples) > 64
    stats = observe(model, [s.input_ids for s in samples], chunk_tokens=32)
    reports = tensor_reports(stats)
    expected = _independent_amax(model, samples)
    for r in reports:
        w = 0 if r.which == "k" else 1
        heads = expected[w, r.layer]
        assert r.head_scales == pytest.approx([float(h) / 448 for h in heads], rel=1e-4)
        assert r.scale == pytest.approx(float(heads.max()) / 448, rel=1e-4)
    # RoPE moves K: scales from k_proj outputs would differ (what the cache-write hook avoids)
    assert stats.tokens == sum(len(s.input_ids) for s in samples)


def test_histogram_fractions_match_exact_counts() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 4096, 64, generator=gen) * 300  # some values beyond 448
    x[0, 0, 0, :8] = 0.0
    x = x.to(torch.bfloat16)
    stats = KVStats.empty(1, 2)
    stats.observe(0, 0, x)
    hist, count = stats.hist[0, 0], int(stats.count[0, 0])
    exact = float((x.abs() > E4M3_MAX).float().mean())
    assert exact > 0.05
    # within one histogram bin's share of the mass (1/16 octave)
    assert fraction_above(hist, count, E4M3_MAX) == pytest.approx(exact, abs=0.01)
    assert tiny(hist) == 8
    assert stats.amax[0, 0].tolist() == x.abs().amax(dim=(0, 2, 3)).float().tolist()
    exact_small = float(((x.abs() < 0.01) & (x != 0)).float().mean())
    assert fraction_below(hist, count, 0.01) == pytest.approx(exact_small, abs=0.001)


def test_mse_search_estimates_real_fp8_error_and_never_replaces_amax() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 1, 8192, 64, generator=gen)
    x[0, 0, 0, 0] = 60.0  # one outlier sets amax far above the bulk
    stats = KVStats.empty(1, 1)
    stats.observe(0, 0, x)
    amax = float(x.abs().max())
    best, best_mse, amax_mse = mse_search(stats.hist[0, 0], amax)

    def exact_mse(scale: float) -> float:
        q = (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
        return float(((q - x) ** 2).mean())

    assert amax_mse == pytest.approx(exact_mse(amax / 448), rel=0.25)
    assert best_mse == pytest.approx(exact_mse(best), rel=0.25)
    # a scale 16x too small clips the bulk's tail: the estimate sees the cost
    small = estimated_mse(stats.hist[0, 0], amax, torch.tensor([amax / 16 / 448]))
    assert float(small[0]) == pytest.approx(exact_mse(amax / 16 / 448), rel=0.25)
    # E4M3's relative precision is the same across normal values, so clipping the outlier
    # does not pay here: the search must not pick a scale that is really worse
    assert best_mse <= amax_mse and exact_mse(best) <= 1.05 * exact_mse(amax / 448)
    report = tensor_reports(_one_layer(stats), search=True)[0]
    assert report.scale == pytest.approx(amax / 448, rel=1e-6)  # amax stays the scale
    assert report.mse_scale == pytest.approx(best) and report.mse_gain is not None


def _one_layer(stats: KVStats) -> KVStats:
    both = KVStats.empty(1, 1)
    both.amax[0], both.hist[0], both.count[0] = stats.amax[0], stats.hist[0], stats.count[0]
    both.amax[1], both.hist[1], both.count[1] = stats.amax[0], stats.hist[0], stats.count[0]
    return both


def test_sampling_is_stratified_deterministic_and_disjoint(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    buckets = Buckets.parse("128,512")
    reqs = _requests()
    a = draw(reqs, PromptRenderer(tok), buckets, per_bucket=3, seed=7)
    b = draw(list(reversed(reqs)), PromptRenderer(tok), buckets, per_bucket=3, seed=7)
    c = draw(reqs, PromptRenderer(tok), buckets, per_bucket=3, seed=8)
    ids_a = {s.id for s in a.calibration}
    assert ids_a == {s.id for s in b.calibration}  # order of the trace does not matter
    assert ids_a != {s.id for s in c.calibration}  # the seed does
    assert ids_a.isdisjoint(a.evaluation_ids)
    assert ids_a | set(a.evaluation_ids) == {r.id for r in reqs}
    for label, row in a.buckets.items():
        chosen = [s for s in a.calibration if s.bucket == label]
        assert len(chosen) == row["calibration"] <= min(3, row["available"] // 2)
        assert all(buckets.label(len(s.input_ids)) == label for s in chosen)
        # the smallest hash keys of the bucket were chosen
        keys = sorted(
            split_key(r.id, 7)
            for r in reqs
            if buckets.label(len(PromptRenderer(tok).render(r)[0])) == label
        )
        assert sorted(split_key(s.id, 7) for s in chosen) == keys[: len(chosen)]


def test_prompts_render_tools_and_synthetic_lengths(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    renderer = PromptRenderer(AutoTokenizer.from_pretrained(str(model_dir)))
    reqs = _requests()
    tool = next(r for r in reqs if r.tools)
    ids, text = renderer.render(tool)
    assert text is not None and "get_weather" in text and "<tools>" in text
    assert ids == renderer.tok.encode(text, add_special_tokens=False)
    synth = Request(
        id="s",
        api="completions",
        synth={"input_tokens": 300, "hash_ids": [1, 2], "block_tokens": 128},
    )
    assert len(renderer.render(synth)[0]) == 300


def test_samples_file_errors_name_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "samples.jsonl"
    bad.write_text('{"id": "a", "input_ids": [1, 2]}\n{"id": "b", "input_ids": []}\n')
    with pytest.raises(InputError, match=r"samples.jsonl:2: field 'input_ids'"):
        read_samples(bad)


@pytest.fixture(scope="module")
def overlay(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("kvcal") / "calibrated"
    calibrate(
        model_dir,
        _samples(model_dir, 1),
        out,
        Recipe(chunk_tokens=256),
        seed=3,
        sampling={"per_bucket": 1},
        legacy=True,
    )
    return out


def test_overlay_checkpoint_layout(overlay: Path, model_dir: Path) -> None:
    from safetensors import safe_open

    config = json.loads((overlay / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "compressed-tensors",
        "format": "dense",
        "quantization_status": "compressed",
        "config_groups": {},
        "ignore": [],
        "kv_cache_scheme": {
            "num_bits": 8,
            "type": "float",
            "strategy": "tensor",
            "dynamic": False,
            "symmetric": True,
        },
    }
    # no model.safetensors: transformers would load it and skip the index's scales shard
    assert not (overlay / "model.safetensors").exists()
    weights = overlay / SINGLE_FILE_LINK
    assert weights.is_symlink() and weights.resolve() == (model_dir / "model.safetensors").resolve()
    assert (overlay / "tokenizer.json").is_symlink()
    index = json.loads((overlay / INDEX).read_text())["weight_map"]
    report = json.loads((overlay / "kvcal_report.json").read_text())
    layers = config["num_hidden_layers"]
    with safe_open(str(overlay / SCALES_SHARD), "pt") as f:
        keys = set(f.keys())
        assert len(keys) == 2 * layers
        for t in report["tensors"]:
            name = f"model.layers.{t['layer']}.self_attn.{t['which']}_scale"
            value = f.get_tensor(name)
            assert value.shape == () and value.dtype == torch.bfloat16
            assert float(value) == pytest.approx(t["scale"], rel=1 / 128)  # bf16 rounding
            assert index[name] == SCALES_SHARD
    with safe_open(str(weights), "pt") as f:
        assert all(index[k] == SINGLE_FILE_LINK for k in f.keys())  # noqa: SIM118
    manifest = json.loads((overlay / MANIFEST).read_text())
    assert manifest["model"] == str(model_dir.resolve())
    assert set(manifest["digests"]) == {"config", "weights", "tokenizer", "chat_template"}
    assert manifest["sample_ids"] == (overlay / "calibration_ids.txt").read_text().split()
    legacy = json.loads((overlay / "kv_cache_scales.json").read_text())
    assert set(legacy["kv_cache"]["scaling_factor"]["0"]) == {str(i) for i in range(layers)}
    assert "observer: static_minmax" in (overlay / "recipe.yaml").read_text()


def test_per_head_overlay_and_recipe(model_dir: Path, tmp_path: Path) -> None:
    from safetensors import safe_open

    out = tmp_path / "per-head"
    calibrate(
        model_dir, _samples(model_dir, 1), out, Recipe(strategy="attn_head"), seed=0, sampling={}
    )
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["kv_cache_scheme"]["strategy"] == "attn_head"
    with safe_open(str(out / SCALES_SHARD), "pt") as f:
        k = f.get_tensor("model.layers.0.self_attn.k_scale")
    assert tuple(k.shape) == (config["num_key_value_heads"], 1, 1)
    assert "strategy: attn_head" in recipe_yaml("attn_head")
    with pytest.raises(InputError, match="already carries k/v scales"):
        calibrate(out, _samples(model_dir, 1), tmp_path / "again", Recipe(), 0, {})


def test_kvcal_cli_inspect_reads_the_overlay(overlay: Path) -> None:
    from kvcal.cli import main

    res = CliRunner().invoke(main, ["inspect", str(overlay), "--json"])
    assert res.exit_code == 0, res.output
    info = json.loads(res.output)
    assert info["quant_method"] == "compressed-tensors" and info["scale_tensors"] > 0


# -- replay side ---------------------------------------------------------------------------


def test_overlap_between_calibration_and_evaluation_is_refused(overlay: Path) -> None:
    reqs = _requests()
    spec = TargetSpec(name="fp8-cal", model=str(overlay), kv_cache_dtype="fp8")
    with pytest.raises(InputError) as err:
        refuse_overlap(iter(reqs), [spec], SAMPLE_TRACE)
    ids = read_ids(overlay / "calibration_ids.txt")
    msg = str(err.value)
    assert f"{len(ids)} request(s)" in msg and MANIFEST in msg and "--exclude-ids" in msg
    keep = Exclusion(ids, overlay / "calibration_ids.txt")
    refuse_overlap((r for r in reqs if keep(r)), [spec], SAMPLE_TRACE)  # excluded: no error
    assert keep.dropped == len(ids)


def test_replay_cli_refuses_overlap_before_starting_servers(overlay: Path) -> None:
    from replay.cli import main

    res = CliRunner().invoke(
        main,
        [
            "--trace",
            str(SAMPLE_TRACE),
            "--targets",
            f"fp8-cal={overlay}",
            "--out",
            str(overlay / "runs"),
        ],
    )
    assert res.exit_code == 2
    text = " ".join(res.output.split())  # rich wraps lines
    assert "were used to calibrate" in text and "--exclude-ids" in text
    assert not (overlay / "runs").exists()


def test_exclude_ids_file_errors(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="cannot read"):
        read_ids(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("# nothing\n\n")
    with pytest.raises(InputError, match="lists no request ids"):
        read_ids(tmp_path / "empty.txt")


def test_target_spec_names_a_model_dir(overlay: Path, tmp_path: Path) -> None:
    spec = parse_targets(f"bf16,fp8-cal={overlay}", Path("/m"))[1]
    assert spec.name == "fp8-cal" and spec.model == str(overlay.resolve())
    assert spec.kv_cache_dtype == "fp8" and spec.expect_cache_dtype == "fp8"
    with pytest.raises(ConfigError, match=r"start a local model target.s name with bf16 or a KV"):
        parse_targets(f"cal={overlay}", None)
    with pytest.raises(ConfigError, match="no model folder"):
        parse_targets(f"fp8-cal={tmp_path}", None)


# -- verify's decision ---------------------------------------------------------------------


def test_verify_decision_needs_scores_that_differ_from_scale_one() -> None:
    cal = ServerCheck("calibrated", "m", cache_dtype="fp8", quantization="compressed-tensors")
    same = [TFScore(3, (1.0, 2.0, 3.0), (True,) * 3)]
    moved = [TFScore(3, (1.0, 2.5, 3.0), (True,) * 3)]
    status, reasons = _decide(cal, compare_scores(same, same), [])
    assert status == NOT_APPLIED and "identical" in reasons[0]
    status, _ = _decide(cal, compare_scores(moved, same), [])
    assert status == "applied"
    warned = ServerCheck("calibrated", "m", cache_dtype="fp8", scale_one_warning=True)
    assert _decide(warned, compare_scores(moved, same), [])[0] == NOT_APPLIED
    bf16 = ServerCheck("calibrated", "m", cache_dtype="auto")
    assert _decide(bf16, compare_scores(moved, same), [])[0] == NOT_APPLIED
    assert _decide(cal, {}, ["per-head (attn_head) scales: no"])[0] == "unsupported"


def test_overlay_loads_in_transformers_with_its_scales(overlay: Path) -> None:
    """transformers prefers a folder's model.safetensors to its index: the overlay must not
    have one, or the scales shard is skipped and k_scale/v_scale are left uninitialised."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(overlay), dtype=torch.bfloat16)
    with safe_open(str(overlay / SCALES_SHARD), "pt") as f:
        names = list(f.keys())
        assert names
        for name in names:
            module, attr = name.rsplit(".", 1)
            loaded = getattr(model.get_submodule(module), attr)
            assert torch.equal(loaded.detach().reshape(()), f.get_tensor(name).reshape(())), name
