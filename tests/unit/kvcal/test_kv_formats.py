"""Every KV-cache format kvcanary knows: the facts (bytes, scales, what vLLM CPU serves) and
each emulated format's round trip, against written examples and, where the installed vLLM has
it, the engine's own function (its CPU kernel, its CPU reference, its Triton kernels run in
Triton's interpreter)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from replay.serving import kv_formats as kvf
from tests.conftest import ROOT, cpu_can_serve_fp8_kv

# -- the facts ------------------------------------------------------------------------------


def test_bytes_per_token_and_head_as_vllm_lays_out_a_page() -> None:
    # head size 64, K and V: 2 bytes a value; 1; 1 + an fp32 scale per side; half + the
    # scales; NVFP4: 32 bytes of E2M1 pairs + 4 E4M3 block scales per side
    want = {
        "auto": 256,
        "bfloat16": 256,
        "fp8": 128,
        "fp8_e5m2": 128,
        "int8_per_token_head": 136,
        "fp8_per_token_head": 136,
        "int4_per_token_head": 72,
        "nvfp4": 72,
        "nvfp4_4over6": 72,
    }
    for name, size in want.items():
        assert kvf.FORMATS[name].bytes_per_token_head(64) == size, name
    assert kvf.FORMATS["fp8"].capacity_ratio(64) == 2.0
    assert kvf.FORMATS["nvfp4"].capacity_ratio(128) == pytest.approx(512 / 144)


def test_which_formats_read_checkpoint_scales_and_which_cpu_serves() -> None:
    reads = {n for n, f in kvf.FORMATS.items() if f.reads_checkpoint_scales and f.emulable}
    assert reads == {"fp8", "fp8_e4m3", "fp8_e5m2", "nvfp4", "nvfp4_4over6"}
    assert not any(kvf.FORMATS[n].reads_checkpoint_scales for n in kvf.FORMATS if "per_token" in n)
    served = {n for n, f in kvf.FORMATS.items() if f.cpu_serves}
    assert served == {"auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2"}


def test_every_value_vllm_takes_is_a_format() -> None:
    cache = pytest.importorskip("vllm.config.cache")
    from typing import get_args

    assert set(get_args(cache.CacheDType)) == set(kvf.FORMATS)
    cpu = pytest.importorskip("vllm.v1.attention.backends.cpu_attn")
    served = set(cpu.CPUAttentionBackend.supported_kv_cache_dtypes)
    assert served == {n for n, f in kvf.FORMATS.items() if f.cpu_serves and f.quantized} | {"auto"}


def test_names_and_served_dtypes() -> None:
    assert kvf.format_of_name("fp8_e5m2") == "fp8_e5m2"
    assert kvf.format_of_name("fp8_e5m2-cal") == "fp8_e5m2"
    assert kvf.format_of_name("fp8-cal") == "fp8"
    assert kvf.format_of_name("fp8_kvcal") == "fp8"
    assert kvf.format_of_name("nvfp4_4over6") == "nvfp4_4over6"
    assert kvf.format_of_name("bf16-b") == "auto"
    assert kvf.format_of_name("fp8x") is None and kvf.format_of_name("baseline") is None
    assert kvf.emulated("int4_per_token_head") == "int4_per_token_head-emulated"
    assert kvf.emulated_format("nvfp4-emulated") == "nvfp4"
    with pytest.raises(ValueError, match="cannot be emulated"):
        kvf.emulated("turboquant_k8v4")
    assert kvf.same_format("fp8", "fp8_e4m3") and kvf.same_format("fp8_e4m3", "fp8")
    assert not kvf.same_format("fp8", "fp8_e5m2") and not kvf.same_format("fp8_e5m2", "fp8")
    assert kvf.same_format("auto", "bfloat16") and kvf.same_format("nvfp4-emulated", "auto")
    assert not kvf.same_format("int8_per_token_head", "auto")


# -- the round trips ------------------------------------------------------------------------

torch = pytest.importorskip("torch")

from kvcal._fp8 import E5M2_MAX, ROUNDINGS, fp8_bytes, fp8_roundtrip, hf_head_scale, vllm_head_scale  # noqa: E402
from kvcal._fp8_table import fp8_roundtrip_lookup  # noqa: E402
from kvcal._kv_dynamic import (  # noqa: E402
    fp8_head_codes,
    int4_codes,
    int8_codes,
    per_token_head_roundtrip,
    single_rht,
)
from kvcal._kv_formats import EMULATED, kv_roundtrip  # noqa: E402
from kvcal._nvfp4 import nvfp4_codes, nvfp4_roundtrip  # noqa: E402


def _f32(*values: float) -> Any:
    return torch.tensor(values, dtype=torch.float32)


def test_kvcal_emulates_what_the_registry_says() -> None:
    assert set(EMULATED) == set(kvf.EMULABLE)


def test_e5m2_cpu_truncates_and_cuda_rounds_to_nearest_even() -> None:
    # 1.125 is halfway between 1.0 and 1.25, 1.375 between 1.25 and 1.5 (the even one)
    x = _f32(1.125, 1.375, -1.375, 60000.0, float("inf"), 1.5 * 2.0**-16, 2.0**-18, 0.0)
    cuda = fp8_roundtrip(x, rounding="cuda", kind="e5m2")
    assert cuda.tolist() == [1.0, 1.5, -1.5, E5M2_MAX, E5M2_MAX, 2 * 2.0**-16, 0.0, 0.0]
    cpu = fp8_roundtrip(x, rounding="cpu", kind="e5m2")
    assert cpu.tolist() == [1.0, 1.25, -1.25, E5M2_MAX, E5M2_MAX, 2.0**-16, 0.0, 0.0]
    nan = _f32(float("nan"))
    assert fp8_roundtrip(nan, rounding="cpu", kind="e5m2").item() == E5M2_MAX  # std::min/max
    assert torch.isnan(fp8_roundtrip(nan, rounding="cuda", kind="e5m2"))
    # +0 for a zero, -0 for a negative value that truncates to zero (the kernel's sign byte)
    assert fp8_bytes(_f32(-0.0, -(2.0**-18)), kind="e5m2").tolist() == [0x00, 0x80]
    with pytest.raises(ValueError, match="kind"):
        fp8_roundtrip(x, kind="e3m4")


@pytest.mark.skipif(not cpu_can_serve_fp8_kv(), reason="vLLM CPU FP8 kernels need AVX-512/AMX")
def test_e5m2_bytes_match_vllm_cpu_cache_write_kernel() -> None:
    ops = pytest.importorskip("vllm._custom_ops")
    gen = torch.Generator().manual_seed(2)
    for dtype in (torch.bfloat16, torch.float32):
        for scale in (1.0, 0.3, 117.0):
            x = torch.randn(64, 2, 64, generator=gen) * torch.logspace(-9, 6, 64)[:, None, None]
            x = (x * scale).to(dtype)
            x.view(-1)[:4] = torch.tensor([float("inf"), float("nan"), -0.0, 5e-5]).to(dtype)
            kc = torch.zeros(2, 2, 32, 64, dtype=torch.uint8)
            vc = torch.zeros_like(kc)
            slot = torch.arange(64)
            ops.cpu_attn_reshape_and_cache(
                x, x.clone(), kc, vc, slot, "vec", scale, scale, "fp8_e5m2"
            )
            got = vc[slot // 32, :, slot % 32, :]
            assert torch.equal(got, fp8_bytes(x, scale, "cpu", "e5m2")), (dtype, scale)


def test_int8_per_token_head_rounds_half_away_from_zero() -> None:
    # one row: max 127 gives scale 1.0; 63.5 and -0.5 are ties
    row = _f32(127.0, 63.5, -0.5, 0.49, -127.0, 2.5, 0.0, -3.5)
    q, scale = int8_codes(row[None])
    assert scale.item() == 1.0
    assert q[0].tolist() == [127, 64, -1, 0, -127, 3, 0, -4]
    q, _ = int8_codes(row[None], "cpu")  # truncation, as a what-if
    assert q[0].tolist() == [127, 63, 0, 0, -127, 2, 0, -3]
    # the scale is max|x| / 127, floored at 1e-6; a zero row stays zero
    q, scale = int8_codes(torch.zeros(1, 8))
    assert scale.item() == pytest.approx(1e-6) and not q.any()
    back = per_token_head_roundtrip(_f32(254.0, 1.0)[None], "int8")
    assert back.tolist() == [[254.0, 2.0]]  # scale 2: 1.0 / 2 = 0.5 rounds away to 1


def test_fp8_per_token_head_maps_each_rows_max_to_448() -> None:
    row = _f32(-2.0, 1.0, 0.003)
    q, scale = fp8_head_codes(row[None])
    assert scale.item() == pytest.approx(2 / 448)
    assert q[0, :2].tolist() == [-448.0, 224.0]
    # 0.003 / (2/448) = 0.672: E4M3 to nearest 0.6875, truncated 0.625
    assert q[0, 2].item() == 0.6875
    assert fp8_head_codes(row[None], "cpu")[0][0, 2].item() == 0.625


def test_rotation_is_vllms_hadamard_and_inverts() -> None:
    h4 = torch.tensor([[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]]).float()
    e = torch.eye(4)
    signs = single_rht(e)[:, 0] * h4[:, 0]  # H D e_0 = d_0 * H[:, 0]
    assert set(signs.abs().tolist()) == {1.0}
    x = torch.randn(5, 3, 96)  # 96 = 3 blocks of 32: block-diagonal
    back = single_rht(single_rht(x), inverse=True) / 32
    assert torch.allclose(back, x, atol=1e-5)


def test_rotation_matches_vllms_single_rht() -> None:
    ref = pytest.importorskip("vllm.v1.attention.ops.int4_per_token_head")
    for d in (64, 80, 128):
        x = torch.randn(7, 3, d)
        assert torch.equal(ref.single_rht(x), single_rht(x))
        assert torch.equal(ref.single_rht(x, inverse=True), single_rht(x, inverse=True))


def test_int4_codes_are_asymmetric_with_the_zero_point_in_the_scale_bits() -> None:
    # a rotated row from -1.5 to 6: scale 0.5, zero point 3
    row = _f32(-1.5, 6.0, 0.0, 0.25, -0.25, 2.0, 0.75, 5.9)
    q, zp, packed = int4_codes(row[None])
    assert zp.item() == 3.0
    # rounded after the zero point is added: 3.5 -> 4, 2.5 -> 3, 4.5 -> 5 (half away from 0)
    assert q[0].tolist() == [0, 15, 3, 4, 3, 7, 5, 15]
    bits = packed.view(torch.int32).item()
    assert bits & 0xF == 3 and (bits & ~0xF) == torch.tensor(0.5).view(torch.int32).item()
    assert int4_codes(row[None], "cpu")[0][0].tolist() == [0, 15, 3, 3, 2, 7, 4, 14]


def test_nvfp4_blocks_round_to_nearest_even_e2m1() -> None:
    block = _f32(6.0, 5.0, 4.9, 2.5, 2.6, 0.25, 0.3, 1.25, 1.75, -3.5, 0, 0, 0, 0, 0, 0)
    q, sf = nvfp4_codes(block[None])
    assert sf.item() == 1.0  # max 6 -> block scale 6 / 6
    assert q[0, 0, :10].tolist() == [6, 4, 4, 2, 3, 0, 0.5, 1, 2, -4]
    q, _ = nvfp4_codes(block[None], rounding="cpu")
    assert q[0, 0, :10].tolist() == [6, 4, 4, 2, 2, 0, 0, 1, 1.5, -3]
    # the per-tensor scale divides first: at k_scale 2, max 12 gives block scale 1.0 again
    assert nvfp4_codes(block[None] * 2, 2.0)[1].item() == 1.0
    with pytest.raises(ValueError, match="divisible by 16"):
        nvfp4_codes(torch.ones(1, 24))


def test_nvfp4_4over6_keeps_max_over_4_when_it_is_closer() -> None:
    block = torch.full((16,), 3.0)
    block[0] = 4.0
    # max/6: block scale 0.667 -> E4M3 0.6875; 4 -> 5.82 -> 6 (4.125), 3 -> 4.36 -> 4 (2.75)
    plain = nvfp4_roundtrip(block[None])
    assert plain[0, :2].tolist() == [4.125, 2.75]
    # max/4: block scale 1.0, both exact: the smaller squared error wins
    assert torch.equal(nvfp4_roundtrip(block[None], four_over_six=True)[0], block)
    # a block that max/6 represents exactly keeps it
    exact = _f32(6.0, 3.0, 1.5, *([0.0] * 13))
    q, sf = nvfp4_codes(exact[None], four_over_six=True)
    assert sf.item() == 1.0 and q[0, 0, :3].tolist() == [6.0, 3.0, 1.5]


def test_nvfp4_matches_vllms_reference_bit_for_bit() -> None:
    ref = pytest.importorskip("vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils")
    gen = torch.Generator().manual_seed(4)
    for scale in (1.0, 0.37, 12.0):
        x = (torch.randn(400, 64, generator=gen) * torch.logspace(-6, 3, 400)[:, None]).bfloat16()
        global_scale = torch.reciprocal(torch.tensor(scale))  # the kernel's 1 / k_scale
        want_q, want_sf = ref.ref_nvfp4_quant(x.float(), global_scale, 16)
        q, sf = nvfp4_codes(x, scale)
        assert torch.equal(q.reshape(400, 64), want_q), scale
        assert torch.equal(sf.squeeze(-1), want_sf), scale


def _vllm_triton_kernels(tmp_path: Path, key: Any, value: Any) -> dict[str, Any]:
    pytest.importorskip("triton")
    pytest.importorskip("vllm.v1.attention.ops.triton_reshape_and_cache_flash")
    src, dst = tmp_path / "in.pt", tmp_path / "out.pt"
    torch.save({"key": key, "value": value}, src)
    script = ROOT / "tests" / "support" / "vllm_triton_kernels.py"
    done = subprocess.run(
        [sys.executable, str(script), str(src), str(dst)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out: dict[str, Any] = torch.load(dst)
    return out


def test_per_token_head_codes_match_vllms_triton_kernels(tmp_path: Path) -> None:
    """vLLM's own cache-write kernels, interpreted on CPU (tests/support/vllm_triton_kernels.py)."""
    gen = torch.Generator().manual_seed(3)
    tokens = 40
    spread = torch.logspace(-3, 2, tokens)[:, None, None]
    key = (torch.randn(tokens, 2, 64, generator=gen) * spread).bfloat16()
    value = (torch.randn(tokens, 2, 64, generator=gen) + 0.3).bfloat16()
    key[0, 0, :5] = torch.tensor([0.5, -0.5, 1.5, 2.5, -2.5]).bfloat16()
    out = _vllm_triton_kernels(tmp_path, key, value)
    for side, x in (("key", key), ("value", value)):
        q, scale = int8_codes(x.float())
        assert torch.equal(q.to(torch.int8), out["int8"][side]), side
        assert torch.equal(scale.squeeze(-1), out["int8"][f"{side}_scale"]), side
        pre = out["fp8_prestore"]
        _, scale = fp8_head_codes(x.float())
        assert torch.equal(scale.squeeze(-1), pre[f"{side}_scale"]), side
        # what the store then rounds to nearest even (the GPU's cvt.rn.satfinite)
        want = pre[side].to(torch.float8_e4m3fn).float()
        assert torch.equal(fp8_head_codes(x.float())[0], want), side
        q, _, packed = int4_codes(single_rht(x.float()).to(x.dtype).float())
        nibbles = q.to(torch.uint8)
        assert torch.equal(nibbles[..., 0::2] | (nibbles[..., 1::2] << 4), out["int4"][side])
        stored = out["int4"][f"{side}_scale"].view(torch.int32)
        assert torch.equal(packed.squeeze(-1).view(torch.int32), stored), side


@pytest.mark.parametrize("fmt", EMULATED)
@pytest.mark.parametrize("rounding", ["cpu", "cuda"])
def test_every_format_keeps_dtype_and_works_in_both_layouts(fmt: str, rounding: str) -> None:
    gen = torch.Generator().manual_seed(5)
    hf = (torch.randn(1, 2, 9, 64, generator=gen) * 3).to(torch.bfloat16)  # [b, heads, seq, d]
    out = kv_roundtrip(fmt, hf, 1.0, rounding=rounding)
    assert out.dtype == torch.bfloat16 and out.shape == hf.shape
    vl = hf[0].transpose(0, 1).contiguous()  # vLLM: [tokens, heads, d]
    assert torch.equal(kv_roundtrip(fmt, vl, 1.0, rounding=rounding), out[0].transpose(0, 1))
    err = (out.float() - hf.float()).abs().mean().item()
    assert 0 < err < 1.0, err  # rounded, and not destroyed
    with pytest.raises(ValueError, match="rounding"):
        kv_roundtrip(fmt, hf, 1.0, rounding="fast")


@pytest.mark.parametrize("fmt", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_lookup_is_the_arithmetic_for_every_16_bit_pattern(
    fmt: str, rounding: str, dtype: torch.dtype
) -> None:
    """A bf16/fp16 tensor's FP8 round trip goes by table (kvcal._fp8_table): every one of
    the 65,536 patterns (NaNs, infinities, subnormals, -0 included), at a per-tensor scale
    of 1, of one that is not a power of two, and per KV head in both layouts, comes back
    with the bits the arithmetic gives."""
    kind = "e5m2" if fmt == "fp8_e5m2" else "e4m3"
    patterns = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int16).view(dtype)
    heads = torch.tensor([0.37, 1.0, 3e-3])
    layouts = [
        (patterns.reshape(1, 1, -1, 64).expand(1, 3, -1, 64), hf_head_scale(heads, 3)),
        (patterns.reshape(-1, 1, 64).expand(-1, 3, 64), vllm_head_scale(heads, 3)),
        (patterns, torch.tensor(1.0)),
        (patterns, torch.tensor(0.37)),
    ]
    for x, scale in layouts:
        looked_up = kv_roundtrip(fmt, x, scale, rounding=rounding)
        assert fp8_roundtrip_lookup(x, scale, rounding=rounding, kind=kind) is not None
        by_arithmetic = fp8_roundtrip(x, scale, rounding=rounding, kind=kind)
        assert looked_up.dtype == dtype and looked_up.shape == by_arithmetic.shape
        assert torch.equal(looked_up.view(torch.int16), by_arithmetic.view(torch.int16))
    # float32 K/V, and a Python-float scale, take the arithmetic (which checks the scale)
    assert fp8_roundtrip_lookup(patterns.float(), heads[0], rounding=rounding, kind=kind) is None
    assert fp8_roundtrip_lookup(patterns, 0.5, rounding=rounding, kind=kind) is None
    # a decode step's few values take the arithmetic too, with the same result
    step = patterns[:192].reshape(1, 3, 1, 64)
    assert fp8_roundtrip_lookup(step, heads[0], rounding=rounding, kind=kind) is None
    assert torch.equal(
        kv_roundtrip(fmt, step, heads[0], rounding=rounding).view(torch.int16),
        fp8_roundtrip(step, heads[0], rounding=rounding, kind=kind).view(torch.int16),
    )
