"""The kernels' launch settings (kernels/hybrid_scale_kernels/settings.py): one entry per GPU architecture and head
dim, each holding every setting the kernels read; the entry a call takes follows its device's architecture (the meta
device's stands for one, as the compile gate sets it); the gate records each architecture's launches with its own
entry; and the device benchmark's tile variants (DEVICE_SPEED_TILES, its default list too) name entries and settings
that exist."""

import re
from pathlib import Path

import pytest
import torch

from benchmarks.device import settings as device_settings
from tools import kernel_compile

settings = pytest.importorskip("hybrid_scale_kernels.settings", reason="the kernels need triton")

KERNELS = Path(settings.__file__).parent


def read_settings() -> set[str]:
    """Every setting a kernel's launcher reads as cfg["name"] (a register cap, read with .get, may be absent)."""
    names = set()
    for path in KERNELS.glob("*.py"):
        names |= set(re.findall(r'cfg\["(\w+)"\]', path.read_text()))
    return names


def test_every_entry_holds_every_setting_the_kernels_read():
    read = read_settings()
    assert {"dchunk", "stages", "bwd_dchunk", "dkv_dchunk", "block_f"} <= read  # (the search finds them)
    assert set(settings.GPU_SETTINGS) == {(a, d) for a in settings.ARCHS for d in (64, 128)}
    for where, entry in settings.GPU_SETTINGS.items():
        assert read <= set(entry), (where, read - set(entry))
    assert read <= set(settings.interpreter(256))
    for d, changes in settings.SM90.items():  # sm_90 changes settings that exist, and takes the rest from sm_80
        assert set(changes) <= set(settings.SM80[d]), d
        assert settings.GPU_SETTINGS[(90, d)] == {**settings.SM80[d], **changes}


def test_a_call_takes_the_entry_of_its_devices_architecture(monkeypatch):
    meta = torch.empty(1, device="meta")
    assert settings.settings_for(meta, 128, 256) is settings.GPU_SETTINGS[(settings.ARCH_OFF_GPU, 128)]
    for arch in settings.ARCHS:
        with settings.standing_for(arch):
            assert settings.settings_for(meta, 64, 128) is settings.GPU_SETTINGS[(arch, 64)]
            assert settings.settings_for(meta, 100, 128) is settings.GPU_SETTINGS[(arch, 128)]
    assert settings.ARCH_OFF_GPU == 90  # (put back: the cost model's H100 / H200)
    with pytest.raises(ValueError, match="no settings for sm_75; architectures: sm_80, sm_90"):
        with settings.standing_for(75):
            pass
    for capability, arch in (((9, 0), 90), ((8, 0), 80), ((8, 9), 80), ((10, 0), 80)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert settings.arch_of(torch.device("cuda", 0)) == arch, capability
    assert settings.settings_for(torch.empty(1), 128, 256)["dkv_qblock"] == 32  # CPU: the interpreter's


def test_the_gate_records_each_architecture_with_its_own_settings():
    shape = kernel_compile.preset_shapes(["llama3-8b"])[0]
    assert settings.GPU_SETTINGS[(80, 128)] != settings.GPU_SETTINGS[(90, 128)]  # (else this test shows nothing)
    for arch in settings.ARCHS:
        cfg = settings.GPU_SETTINGS[(arch, 128)]
        recorded = kernel_compile.launches(shape, "hybrid+sinks+decay", torch.bfloat16, arch)
        seen = {x.name: x.kwargs for x in recorded}
        assert seen["_chunk_output"]["BLOCK_DK"] == min(128, cfg["dchunk"]), arch
        assert seen["_chunk_output"]["num_stages"] == cfg["stages"], arch
        assert seen["_chunk_bwd_dkv"]["BLOCK_DC"] == min(128, cfg["dkv_dchunk"]), arch
        assert seen["_chunk_bwd_dq"]["BLOCK_DK"] == min(128, cfg["bwd_dchunk"]), arch
        decode_rows = [x.args[20] for x in recorded if x.name == "_decode"]  # (its B: a step of one row and of 4)
        assert decode_rows == [1, kernel_compile.DECODE_ROWS]
        outputs = [x for x in recorded if x.name == "_chunk_output"]
        assert sum(x.kwargs["HAS_INIT"] for x in outputs) == 2  # stage 1's, and a prefill's with an initial state


def test_the_tile_variants_name_settings_that_exist():
    variants = device_settings.parse_tiles(device_settings.DEFAULT_TILES)
    assert len(variants) >= 3
    for name, changes in variants.items():
        entry = settings.GPU_SETTINGS[(device_settings.tile_arch(name) or 90, 128)]
        assert changes and set(changes) <= set(entry), (name, set(changes) - set(entry))
    assert all(device_settings.tile_arch(name) == 90 for name in variants)  # (the default list is sm_90's)
    assert device_settings.TILE_ARCHS == settings.ARCHS
    assert device_settings.parse_tiles("a@80:warps=4;b:stages=2") == {"a@80": {"warps": 4}, "b": {"stages": 2}}
    assert [device_settings.tile_arch(n) for n in ("a@80", "b")] == [80, None]
    for bad, says in (("a@70:warps=4", "sm_70"), ("a@x:warps=4", "NAME"), ("a:warps", "not key=integer")):
        with pytest.raises(SystemExit, match=says):
            device_settings.parse_tiles(bad)
