"""kvcal emulate without a server: the E4M3 round trip vLLM applies at the cache write, the
emulating cache, and what emulation says of the test model and its outlier twin."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from click.testing import CliRunner  # noqa: E402

from kvcal._fp8 import (  # noqa: E402
    E4M3_MAX,
    e4m3_bytes,
    e4m3_roundtrip,
    e4m3_values,
    hf_head_scale,
    vllm_head_scale,
)
from kvcal.emulate.cache import EmulatingCache, teacher_forced, uniform  # noqa: E402
from kvcal.emulate.overlay import read_overlay  # noqa: E402
from kvcal.emulate.report import EmulateArgs, emulate  # noqa: E402
from kvcal.emulate.requests import draw_from_run  # noqa: E402
from kvcal.emulate.sensitivity import loss_is_real  # noqa: E402
from replay.core.buckets import Buckets  # noqa: E402
from replay.core.errors import InputError  # noqa: E402
from tests.conftest import ROOT, cpu_can_serve_fp8_kv  # noqa: E402

TRACE = ROOT / "traces" / "testmodel_heldout.jsonl"
BUCKETS = "128,512"
BOTH = ("cpu", "cuda")


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Any:
    """The test model's ops are too small to gain from threads, and on shared cores OpenMP
    threads that wait on each other make them several times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _f32(*values: float) -> Any:
    return torch.tensor(values, dtype=torch.float32)


def _all_finite_e4m3() -> Any:
    codes = torch.arange(256, dtype=torch.uint8)
    values = codes.view(torch.float8_e4m3fn).float()
    return values[torch.isfinite(values)]


# -- the round trip -------------------------------------------------------------------------


@pytest.mark.parametrize("rounding", BOTH)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_representable_values_round_trip_exactly(rounding: str, dtype: Any) -> None:
    x = _all_finite_e4m3()
    assert x.numel() == 254 and float(x.abs().max()) == E4M3_MAX
    x = x.to(dtype)  # every E4M3 value is exact in bf16 / fp16
    out = e4m3_roundtrip(x, 1.0, rounding=rounding)
    assert out.dtype == dtype and torch.equal(out, x)
    # at a power-of-two scale the grid scales with it, exactly
    assert torch.equal(e4m3_roundtrip(x.float() * 0.25, 0.25, rounding=rounding), x.float() * 0.25)


def test_cpu_truncates_and_cuda_rounds_to_nearest_even() -> None:
    # 1.0625 lies halfway between 1.0 and 1.125, 1.1875 between 1.125 and 1.25 (the even one)
    x = _f32(1.0625, 1.1875, -1.1875, 1.24, 300.0, 3 * 2.0**-10, 2.0**-10)
    assert e4m3_roundtrip(x, rounding="cuda").tolist() == [
        1.0,
        1.25,
        -1.25,
        1.25,
        288.0,
        2 * 2.0**-9,
        0.0,
    ]
    # vLLM CPU keeps the top 3 mantissa bits: toward zero
    assert e4m3_roundtrip(x, rounding="cpu").tolist() == [
        1.0,
        1.125,
        -1.125,
        1.125,
        288.0,
        2.0**-9,
        0.0,
    ]
    # the CPU kernel's v * 2**-120 is an fp32 subnormal there: one ulp below a subnormal grid
    # point rounds up to it before the truncation
    below = torch.nextafter(_f32(6 * 2.0**-9), _f32(0.0))
    assert e4m3_roundtrip(below, rounding="cpu").item() == 6 * 2.0**-9
    assert e4m3_roundtrip(below, rounding="cuda").item() == 6 * 2.0**-9


def test_saturation_and_nan_as_vllm_kernels_do() -> None:
    x = _f32(449.0, 464.0, 480.0, 1e4, float("inf"), -float("inf"), float("nan"), -1e30)
    cpu = e4m3_roundtrip(x, rounding="cpu")
    assert cpu.tolist() == [448.0] * 5 + [-448.0, 448.0, -448.0]  # NaN -> +448 (std::min/max)
    cuda = e4m3_roundtrip(x, rounding="cuda")
    assert cuda[:6].tolist() == [448.0] * 5 + [-448.0] and cuda[7].item() == -448.0
    assert torch.isnan(cuda[6])  # __NV_SATFINITE keeps NaN
    # out of range at a scale: saturates at 448 * scale
    assert e4m3_roundtrip(_f32(1e6), 0.5).item() == 224.0
    assert e4m3_bytes(_f32(1e6, -1e6)).tolist() == [0x7E, 0xFE]


@pytest.mark.parametrize("rounding", BOTH)
def test_zeros_and_subnormals(rounding: str) -> None:
    sub = torch.arange(8, dtype=torch.float32) * 2.0**-9  # 0 and E4M3's 7 subnormals
    assert torch.equal(e4m3_roundtrip(sub, rounding=rounding), sub)
    assert torch.equal(e4m3_roundtrip(-sub, rounding=rounding).abs(), sub)
    tiny = _f32(2.0**-11, -(2.0**-11), 1e-30)
    assert e4m3_roundtrip(tiny, rounding=rounding).abs().tolist() == [0.0, 0.0, 0.0]
    # at a scale, the subnormal grid is k * 2**-9 * scale
    s = 0.01
    x = torch.arange(1, 8, dtype=torch.float32) * 2.0**-9 * s
    want = (torch.arange(1, 8, dtype=torch.float32) * 2.0**-9) * torch.tensor(s)
    assert torch.allclose(e4m3_roundtrip(x, s, rounding=rounding), want, rtol=1e-6)
    # vLLM CPU stores +0 for a zero and -0 for a negative value that truncates to zero
    if rounding == "cpu":
        assert e4m3_bytes(_f32(0.0, -0.0, -(2.0**-11))).tolist() == [0x00, 0x00, 0x80]


def test_per_head_scales_broadcast_over_both_layouts() -> None:
    gen = torch.Generator().manual_seed(0)
    heads = torch.tensor([0.5, 3.0])
    hf = (torch.randn(1, 2, 7, 16, generator=gen) * 600).to(torch.bfloat16)
    out = e4m3_roundtrip(hf, hf_head_scale(heads, 2))
    for h in range(2):
        assert torch.equal(out[:, h], e4m3_roundtrip(hf[:, h], float(heads[h])))
    vl = hf[0].transpose(0, 1).contiguous()  # vLLM: [tokens, kv_heads, head_dim]
    out_v = e4m3_roundtrip(vl, vllm_head_scale(heads, 2))
    assert torch.equal(out_v, out[0].transpose(0, 1))
    # what checkpoints hold: [] / [1] per tensor, [kv_heads, 1, 1] per head
    assert hf_head_scale(torch.tensor([0.25])).shape == ()
    assert vllm_head_scale(0.25).shape == ()
    assert hf_head_scale(heads.reshape(2, 1, 1)).shape == (1, 2, 1, 1)
    assert vllm_head_scale(heads.reshape(2, 1, 1), 2).shape == (1, 2, 1)
    with pytest.raises(ValueError, match="3 scales for 2 KV heads"):
        vllm_head_scale(torch.tensor([1.0, 2.0, 3.0]), 2)


def test_dtype_is_kept_and_bad_input_refused() -> None:
    x = torch.randn(4, 2, 8, dtype=torch.bfloat16)
    assert e4m3_roundtrip(x, 0.1).dtype == torch.bfloat16
    assert e4m3_roundtrip(x, torch.tensor(0.1)).dtype == torch.bfloat16
    assert e4m3_roundtrip(x, 0.1, dtype=torch.float32).dtype == torch.float32
    assert e4m3_values(x, 0.1).dtype == torch.float32
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="positive and finite"):
            e4m3_roundtrip(x, bad)
    with pytest.raises(ValueError, match="rounding"):
        e4m3_roundtrip(x, 1.0, rounding="fast")


def _vllm_cpu_cache_bytes(ops: Any, x: Any, scale: float) -> Any:
    """V codes vLLM's CPU kernel writes for ``x`` [tokens, heads, dim] (VEC layout)."""
    tokens, heads, dim = x.shape
    block = 32
    blocks = -(-tokens // block)
    kc = torch.zeros(blocks, heads, block, dim, dtype=torch.uint8)
    vc = torch.zeros_like(kc)
    ops.cpu_attn_reshape_and_cache(
        x, x.clone(), kc, vc, torch.arange(tokens), "vec", scale, scale, "fp8"
    )
    slot = torch.arange(tokens)
    return vc[slot // block, :, slot % block, :]  # V: row-major within the block


@pytest.mark.skipif(not cpu_can_serve_fp8_kv(), reason="vLLM CPU FP8 kernels need AVX-512/AMX")
def test_bytes_match_vllm_cpu_cache_write_kernel() -> None:
    """Bit for bit what vLLM's own CPU cache-write op stores (no server: the op in-process)."""
    ops = pytest.importorskip("vllm._custom_ops")
    gen = torch.Generator().manual_seed(1)
    for dtype in (torch.bfloat16, torch.float32):
        for scale in (1.0, 0.3, 0.0123, 117.0):
            x = torch.randn(64, 2, 64, generator=gen) * torch.logspace(-6, 4, 64)[:, None, None]
            x = (x * scale).to(dtype)
            x.view(-1)[:4] = torch.tensor([float("inf"), float("nan"), -0.0, 5e-5]).to(dtype)
            assert torch.equal(_vllm_cpu_cache_bytes(ops, x, scale), e4m3_bytes(x, scale)), (
                dtype,
                scale,
            )


# -- the emulating cache --------------------------------------------------------------------


def test_emulating_cache_stores_round_tripped_keys_and_values(model_dir: Path) -> None:
    from transformers import DynamicCache

    from kvcal._observe import load_model

    model = load_model(str(model_dir), "auto", "cpu")
    ids = torch.tensor([list(range(40, 90))])
    plain, emu = (
        DynamicCache(config=model.config),
        EmulatingCache(uniform("x", 4, 0.05), model.config),
    )
    skipped = EmulatingCache(uniform("x", 4, 0.05).skipping([0]), model.config)
    with torch.inference_mode():
        for cache in (plain, emu, skipped):
            model(input_ids=ids, past_key_values=cache, use_cache=True)
    # layer 0's K/V do not depend on any cache: the emulated ones are their round trip
    assert torch.equal(emu.layers[0].keys, e4m3_roundtrip(plain.layers[0].keys, 0.05))
    assert torch.equal(emu.layers[0].values, e4m3_roundtrip(plain.layers[0].values, 0.05))
    assert torch.equal(skipped.layers[0].keys, plain.layers[0].keys)
    assert not torch.equal(skipped.layers[1].keys, plain.layers[1].keys)
    # teacher forcing under no emulation scores the same tokens as a plain forward
    nll, top = teacher_forced(
        model, list(range(40, 80)), list(range(80, 90)), DynamicCache(config=model.config), chunk=16
    )
    with torch.inference_mode():
        logits = model(input_ids=ids[:, :-1]).logits[0, 39:].float()
    want = -torch.log_softmax(logits, -1).gather(1, ids[0, 40:, None])[:, 0]
    assert torch.allclose(torch.tensor(nll), want, rtol=0.01, atol=0.05)  # bf16, chunked
    assert len(top) == 10


# -- what emulation says --------------------------------------------------------------------


def _calibrate(model_dir: Path, out: Path) -> Path:
    """kvcal's own calibration, on a few trace samples."""
    from transformers import AutoTokenizer

    from kvcal._calibrate import Recipe, calibrate
    from kvcal._sample import PromptRenderer, draw
    from replay.traces.importers import stream

    split = draw(
        stream(TRACE),
        PromptRenderer(AutoTokenizer.from_pretrained(str(model_dir))),
        Buckets.parse(BUCKETS),
        per_bucket=2,
        seed=5,
    )
    calibrate(model_dir, split.calibration, out, Recipe(), seed=5, sampling={})
    return out


@pytest.fixture(scope="module")
def twin_report(twin_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``kvcal emulate`` on the outlier twin: scale 1.0, its calibrated scales, sensitivity."""
    from kvcal.cli import main

    tmp = tmp_path_factory.mktemp("emulate")
    overlay = _calibrate(twin_dir, tmp / "calibrated")
    out = tmp / "twin.json"
    res = CliRunner().invoke(
        main,
        [
            "emulate",
            str(twin_dir),
            "--trace",
            str(TRACE),
            "--buckets",
            BUCKETS,
            "--per-bucket",
            "4",
            "--greedy-sample",
            "1",
            "--max-new-tokens",
            "16",
            "--overlay",
            str(overlay),
            "--sensitivity",
            "--json",
            str(out),
        ],
    )
    assert res.exit_code == 0, res.output
    report: dict[str, Any] = json.loads(out.read_text())
    report["_output"] = " ".join(res.output.split())
    report["_overlay"] = str(overlay)
    return report


def _row(report: dict[str, Any], setting: str, bucket: str = "all") -> dict[str, Any]:
    return next(r for r in report["results"] if r["setting"] == setting and r["bucket"] == bucket)


def test_twin_loses_at_scale_one_and_calibrated_scales_fix_it(twin_report: dict[str, Any]) -> None:
    buckets = [
        r for r in twin_report["results"] if r["setting"] == "fp8@1.0" and r["bucket"] != "all"
    ]
    assert any(r["nll_delta_lo"] > 0 for r in buckets)  # a loss beyond resampling noise
    one, cal = _row(twin_report, "fp8@1.0"), _row(twin_report, "fp8@cal")
    assert one["nll_delta_mean"] > 0.1 and one["top1_agreement"] < 0.97
    assert abs(cal["nll_delta_mean"]) < 0.05 * one["nll_delta_mean"]
    assert cal["nll_delta_hi"] < one["nll_delta_lo"] and cal["top1_agreement"] >= 0.97
    assert cal["greedy"]["requests"] == 3 and cal["greedy"]["exact"] >= one["greedy"]["exact"]
    # the overlay's own calibration requests are never scored
    manifest = json.loads((Path(twin_report["_overlay"]) / "kvcal_manifest.json").read_text())
    assert not set(manifest["sample_ids"]) & {r["id"] for r in twin_report["per_request"]}
    assert twin_report["emulated"] is True and "EMULATED" in twin_report["_output"]


def test_sensitivity_picks_skip_layers_that_recover_the_loss(twin_report: dict[str, Any]) -> None:
    sens = twin_report["sensitivity"]
    assert sens["loss_is_real"] and len(sens["layers"]) == twin_report["layers"]
    chosen = sens["skip_layers"]
    assert chosen and sens["reached"] and sens["confirmed_share"] >= 0.8
    assert sens["confirmations"][-1]["skip_layers"] == chosen  # scored, not only estimated
    # vLLM 0.32 takes the indices as separate words (a comma list is one pattern)
    assert sens["flag"] == "--kv-cache-dtype-skip-layers " + " ".join(map(str, chosen))
    assert sens["flag"] in twin_report["_output"]
    for row in sens["layers"]:
        assert row["recovered"] == pytest.approx(sens["loss"] - row["kept_bf16"]["nll_delta_mean"])


def test_an_overlay_given_as_the_model_is_emulated_at_its_scales(
    twin_report: dict[str, Any], tmp_path: Path
) -> None:
    from kvcal.cli import main

    out = tmp_path / "overlay.json"
    res = CliRunner().invoke(
        main,
        [
            "emulate",
            twin_report["_overlay"],
            "--trace",
            str(TRACE),
            "--buckets",
            BUCKETS,
            "--per-bucket",
            "1",
            "--greedy-sample",
            "0",
            "--json",
            str(out),
        ],
    )
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    assert [s["name"] for s in report["settings"]] == ["fp8@1.0", "fp8@cal"]
    assert any("carries k/v scales" in n for n in report["notes"])
    assert _row(report, "fp8@cal")["greedy"] is None  # --greedy-sample 0
    (tmp_path / "empty").mkdir()
    res = CliRunner().invoke(main, ["emulate", str(tmp_path / "empty"), "--trace", str(TRACE)])
    assert res.exit_code == 2 and "no config.json" in " ".join(res.output.split())


def test_original_model_shows_no_meaningful_loss_at_scale_one(model_dir: Path) -> None:
    report = emulate(
        EmulateArgs(
            model_dir,
            TRACE,
            buckets=BUCKETS,
            per_bucket=4,
            greedy_sample=1,
            max_new_tokens=16,
            skip_layers=(0,),
        )
    )
    one = _row(report, "fp8@1.0")
    assert abs(one["nll_delta_mean"]) < 0.01 and one["top1_agreement"] >= 0.97
    assert not loss_is_real(one, 0.01)[0]
    assert {r["setting"] for r in report["results"]} == {"fp8@1.0", "fp8@1.0 skip 0"}
    assert report["settings"][1]["skip_layers"] == [0]
    assert report["sampling"]["buckets"]["<128"]["drawn"] == 4


# -- inputs ---------------------------------------------------------------------------------


def test_overlay_scales_per_tensor_per_head_and_missing(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file(
        {
            "model.layers.0.self_attn.k_scale": torch.tensor([0.5, 2.0]).reshape(2, 1, 1),
            "model.layers.0.self_attn.v_scale": torch.tensor(0.25),
            "model.layers.1.self_attn.k_scale": torch.tensor([0.125]),
        },
        str(tmp_path / "kv_scales.safetensors"),
    )
    scales = read_overlay(tmp_path, layers=2, kv_heads=2)
    assert scales.per_head and scales.k[0].shape == (1, 2, 1, 1)
    assert float(scales.v[0]) == 0.25 and float(scales.k[1]) == 0.125
    assert float(scales.v[1]) == 1.0 and any("layer 1 has no v_scale" in n for n in scales.notes)
    with pytest.raises(InputError, match="the model has 1 layers"):
        read_overlay(tmp_path, layers=1, kv_heads=2)
    with pytest.raises(InputError, match="one per KV head"):
        read_overlay(tmp_path, layers=2, kv_heads=4)
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match=r"no \*\.k_scale"):
        read_overlay(tmp_path / "empty", layers=2, kv_heads=2)


def test_answers_come_from_the_reference_of_a_run(tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_text(
        json.dumps({"reference": "bf16", "schedules": ["main", "load"]})
    )
    rows = [
        {
            "target": "bf16",
            "phase": "main",
            "status": "ok",
            "request_id": "a",
            "prompt_ids": [1, 2, 3],
            "output_ids": [4, 5],
        },
        {
            "target": "fp8",
            "phase": "main",
            "status": "ok",
            "request_id": "a",
            "prompt_ids": [1, 2, 3],
            "output_ids": [9],
        },
        {
            "target": "bf16",
            "phase": "load",
            "status": "ok",
            "request_id": "b",
            "prompt_ids": [1],
            "output_ids": [2],
        },
        {
            "target": "bf16",
            "phase": "main",
            "status": "error",
            "request_id": "c",
            "prompt_ids": [1],
            "output_ids": [],
        },
        {
            "target": "bf16",
            "phase": "main",
            "status": "ok",
            "request_id": "d",
            "prompt_ids": list(range(200)),
            "output_ids": [7],
        },
    ]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    drawn = draw_from_run(tmp_path, Buckets.parse(BUCKETS), 8, 0, frozenset(), 10_000)
    assert [(it.id, it.bucket, it.answer) for it in drawn.items] == [
        ("a", "<128", (4, 5)),
        ("d", "128-512", (7,)),
    ]
    short = draw_from_run(tmp_path, Buckets.parse(BUCKETS), 8, 0, frozenset(), 100)
    assert [it.id for it in short.items] == ["a"] and short.info["too_long"] == 1
    cheap = draw_from_run(tmp_path, Buckets.parse(BUCKETS), 8, 0, frozenset(), 10_000, 50)
    assert [it.id for it in cheap.items] == ["a"] and cheap.info["over_max_prompt"] == 1
    with pytest.raises(InputError, match="no answers of the reference target 'bf16'"):
        draw_from_run(tmp_path, Buckets.parse(BUCKETS), 8, 0, frozenset({"a"}), 100)
    with pytest.raises(InputError, match=r"manifest\.json"):
        draw_from_run(tmp_path / "nothing", Buckets.parse(BUCKETS), 8, 0, frozenset(), 100)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "exactly one of --trace TRACE and --answers RUN_DIR"),
        (["--trace", str(TRACE), "--answers", "."], "exactly one of"),
        (["--trace", str(TRACE), "--skip-layers", "a,b"], "expected layer indices"),
        (["--trace", str(TRACE), "--skip-layers", "7"], "out of range"),
        (["--trace", str(TRACE), "--per-bucket", "0"], "--per-bucket must be at least 1"),
        (["--trace", str(TRACE), "--recover", "1.5"], "--recover"),
        (["--trace", str(TRACE), "--buckets", "9,3"], "increasing"),
        (["--trace", "missing.jsonl"], "no such file"),
        (["--trace", str(TRACE), "--overlay", "missing-overlay"], "no such folder"),
        (["--trace", str(TRACE), "--formats", "fp8,int2"], "int2; the emulated formats are"),
        (["--trace", str(TRACE), "--formats", ","], "none given"),
    ],
)
def test_emulate_cli_refuses_bad_input(model_dir: Path, args: list[str], message: str) -> None:
    from kvcal.cli import main

    res = CliRunner().invoke(main, ["emulate", str(model_dir), *args])
    assert res.exit_code == 2, res.output
    assert message in " ".join(res.output.split())


def test_the_advisor_on_the_twin_format_by_format(twin_dir: Path, tmp_path: Path) -> None:
    """The twin's keys clip at FP8 scale 1.0; a format that computes its own scale per token
    and head does not clip them. One table per bucket, both roundings, the tolerance."""
    from kvcal.cli import main

    out = tmp_path / "advice.json"
    args = ["emulate", str(twin_dir), "--trace", str(TRACE), "--buckets", BUCKETS]
    args += ["--per-bucket", "2", "--greedy-sample", "1", "--max-new-tokens", "12"]
    args += ["--formats", "fp8,int8_per_token_head", "--rounding", "both"]
    args += ["--tolerance", "0.05", "--json", str(out), "--markdown", str(tmp_path / "a.md")]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    names = [s["name"] for s in report["settings"]]
    assert names == [
        "fp8@1.0 cpu",
        "fp8@1.0 cuda",
        "int8_per_token_head cpu",
        "int8_per_token_head cuda",
    ]
    # 4 layers x 2 KV heads x head size 64: 2 KiB a token in BF16, half in FP8, and 8 bytes of
    # scales per head and layer more for the per-token-head format
    facts = {s["name"]: s for s in report["settings"]}
    assert facts["fp8@1.0 cpu"]["bytes_per_token"] == 1024
    assert facts["int8_per_token_head cuda"]["bytes_per_token"] == 1088
    assert facts["fp8@1.0 cpu"]["capacity_ratio"] == 2.0
    fits = report["advice"]["within_tolerance"]
    assert not fits["fp8@1.0 cpu"] and not fits["fp8@1.0 cuda"]
    assert fits["int8_per_token_head cuda"]
    assert _row(report, "int8_per_token_head cuda")["nll_delta_hi"] < 0.05
    (cost,) = [c for c in report["advice"]["rounding"] if c["cpu"] == "fp8@1.0 cpu"]
    assert cost["loss_cpu"] > 0.1 and cost["share"] is not None
    text = " ".join(res.output.split())
    for bucket in ("<128", "128-512", ">=512", "all"):
        assert f"bucket {bucket}:" in text
    assert "the most capacity (1.88x): int8_per_token_head" in text
    md = (tmp_path / "a.md").read_text().splitlines()
    assert md[0].startswith("| setting | rounding | ΔNLL/token <128 | ΔNLL/token 128-512 |")
    assert md[2].startswith("| `fp8@1.0` | cpu |") and md[2].endswith("| 1 | 2.00x | no |")
    assert md[5].endswith("| 1.06 | 1.88x | yes |") and md[-2].startswith("- fp8@1.0 cpu:")


def _advice_report(losses: dict[str, tuple[float, float, float]]) -> dict[str, Any]:
    """Settings fmt@1.0 cpu / cuda with an 'all' row each of (mean, lo, hi)."""
    settings, results = [], []
    for name, (mean, lo, hi) in losses.items():
        fmt, rounding = name.split("@1.0 ")
        settings.append(
            {"name": name, "format": fmt, "rounding": rounding, "scales": "1.0", "skip_layers": []}
        )
        row = {"nll_delta_mean": mean, "nll_delta_lo": lo, "nll_delta_hi": hi}
        results.append({"setting": name, "bucket": "all", **row})
    return {"settings": settings, "results": results, "min_loss": 0.01, "tolerance": None}


def test_the_advisor_says_how_much_of_a_loss_is_the_rounding() -> None:
    from kvcal.emulate.advice import advise

    report = _advice_report(
        {
            "fp8@1.0 cpu": (0.10, 0.05, 0.15),
            "fp8@1.0 cuda": (0.04, 0.01, 0.07),
            "nvfp4@1.0 cpu": (0.07, 0.02, 0.1),
            "nvfp4@1.0 cuda": (0.14, 0.03, 0.3),
            "fp8_e5m2@1.0 cpu": (0.004, 0.001, 0.008),
            "fp8_e5m2@1.0 cuda": (0.0, -0.001, 0.001),
            # rounded to nearest gains a little: all of the truncated loss, never "105%"
            "int8@1.0 cpu": (0.02, 0.011, 0.04),
            "int8@1.0 cuda": (-0.001, -0.007, 0.005),
        }
    )
    lines = advise(report)["lines"]
    assert lines[3].endswith(
        "the rounding is all of the truncated loss: rounded to nearest, none is left"
    )
    assert "fp8@1.0 cpu" in lines[0] and "the rounding is 60% of the truncated loss" in lines[0]
    assert "truncation costs nothing over rounding to nearest" in lines[1]
    assert lines[2].endswith(
        "no real loss to split between the format and its rounding (truncated: below --min-loss "
        "0.01; rounded to nearest: no loss)"
    )


def test_the_advisor_says_when_the_rounding_decides_the_tolerance() -> None:
    from kvcal.emulate.advice import advise

    report = _advice_report(
        {"int4@1.0 cpu": (0.004, 0.001, 0.03), "int4@1.0 cuda": (0.0006, 0.0001, 0.001)}
    )
    report["tolerance"] = 0.02
    for s in report["settings"]:
        s["capacity_ratio"] = 3.56
    advice = advise(report)
    assert advice["within_tolerance"] == {"int4@1.0 cpu": False, "int4@1.0 cuda": True}
    assert advice["lines"][1].endswith(
        "(truncated: below --min-loss 0.01; rounded to nearest: below --min-loss 0.01); "
        "within the tolerance in every bucket only when rounded to nearest: the rounding decides"
    )


@pytest.mark.parametrize("flag", ["--max-dnll", "--tolerance"])
def test_the_largest_dnll_per_token_keeps_its_former_name(flag: str) -> None:
    """``--max-dnll`` (ΔNLL per token) is also ``--tolerance``, the name it had; the report
    keeps writing it as ``tolerance``."""
    from kvcal.cli.emulate import emulate_cmd

    ctx = emulate_cmd.make_context("emulate", ["MODEL", flag, "0.02"])
    assert ctx.params["max_dnll"] == 0.02
