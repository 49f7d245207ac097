"""The kept projections' buffers mapped from an image beside the prepared int4 file: written by
the first load, mapped by every load (the same pages), never serving other values than the
ones built, and left out where it cannot be written."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from structlog.testing import capture_logs
from support.converted_gguf import converted_tiny_gguf, prompt_logits
from support.gguf_files import TinyGgufSpec

from pdserve.engine import kernel_image
from pdserve.engine.kernel_image import image_path, map_buffers
from pdserve.engine.quant import Int4Linear


def projections(seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, Int4Linear]:
    """Two int4 projections (pdserve's kernel where it runs, else torch's) from random blocks."""
    generator = torch.Generator().manual_seed(seed)
    built = {}
    for name, rows in (("layers.0.qkv_proj", 96), ("layers.0.o_proj", 64)):
        values = torch.randint(0, 256, (rows, 64), dtype=torch.uint8, generator=generator)
        # NOTE: float16-exact scales and mins, as Q4_0 and Q4_1 store them.
        scales = torch.rand(rows, 4, generator=generator).half().float()
        mins = -torch.rand(rows, 4, generator=generator).half().float()
        built[name] = Int4Linear.from_blocks(values, scales, mins, None, dtype)
    return built


def copies(modules: dict[str, Int4Linear]) -> dict[str, torch.Tensor]:
    return {
        f"{m}.{n}": t.clone() for m, module in modules.items() for n, t in module.named_buffers()
    }


def mapped_inodes(modules: dict[str, Int4Linear]) -> set[int]:
    """The inodes of the file mappings every buffer of `modules` lies in (0: not a file)."""
    regions = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            low, high = (int(x, 16) for x in fields[0].split("-"))
            regions.append((low, high, int(fields[4])))
    inodes = set()
    for module in modules.values():
        for buffer in module.buffers():
            pointer = buffer.data_ptr()
            inodes.add(next((i for lo, hi, i in regions if lo <= pointer < hi), 0))
    return inodes


def test_the_first_load_writes_the_image_and_every_load_maps_its_pages(tmp_path: Path) -> None:
    source = tmp_path / "int4" / "model.safetensors"
    first, second = projections(), projections()
    expected = copies(first)
    path = image_path(source, copies(first))
    with capture_logs() as logs:
        assert map_buffers(first, source) == sum(t.nbytes for t in expected.values())
    assert [e["written"] for e in logs if e["event"] == "kernel_image_mapped"] == [True]
    written = path.stat()
    assert copies(first).keys() == expected.keys()
    assert all(torch.equal(copies(first)[k], v) for k, v in expected.items())
    assert mapped_inodes(first) == {written.st_ino}

    with capture_logs() as logs:
        map_buffers(second, source)
    assert [e["written"] for e in logs if e["event"] == "kernel_image_mapped"] == [False]
    assert path.stat().st_mtime_ns == written.st_mtime_ns
    assert mapped_inodes(second) == {written.st_ino}
    x = torch.randn(3, 64)
    for name, module in first.items():
        assert torch.equal(module(x), second[name](x))


def test_an_image_with_other_values_or_damaged_is_written_again(tmp_path: Path) -> None:
    source = tmp_path / "model.safetensors"
    map_buffers(projections(seed=0), source)
    other = projections(seed=1)
    expected = copies(other)
    path = image_path(source, expected)
    assert path.is_file()  # the same names, shapes and dtypes: the same image's name
    map_buffers(other, source)
    assert all(torch.equal(copies(other)[k], v) for k, v in expected.items())
    assert mapped_inodes(other) == {path.stat().st_ino}

    path.write_bytes(path.read_bytes()[:100])
    again = projections(seed=1)
    with capture_logs() as logs:
        map_buffers(again, source)
    assert "kernel_image_damaged" in {e["event"] for e in logs}
    assert all(torch.equal(copies(again)[k], v) for k, v in expected.items())
    assert mapped_inodes(again) == {path.stat().st_ino}


def test_engines_starting_together_write_one_image(tmp_path: Path) -> None:
    source = tmp_path / "model.safetensors"
    engines = [projections() for _ in range(3)]
    start = threading.Barrier(len(engines))
    with capture_logs() as logs:

        def load(modules: dict[str, Int4Linear]) -> None:
            start.wait()
            map_buffers(modules, source)

        threads = [threading.Thread(target=load, args=(e,)) for e in engines]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    mapped = [e for e in logs if e["event"] == "kernel_image_mapped"]
    assert sorted(e["written"] for e in mapped) == [False, False, True]
    inode = image_path(source, copies(engines[0])).stat().st_ino
    assert all(mapped_inodes(e) == {inode} for e in engines)


def test_where_no_image_can_be_written_the_built_buffers_stay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    modules = projections()
    expected = copies(modules)

    def refuse(path: Path, buffers: dict[str, torch.Tensor]) -> None:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(kernel_image, "_write", refuse)
    with capture_logs() as logs:
        assert map_buffers(modules, tmp_path / "model.safetensors") == 0
    assert [e["event"] for e in logs] == ["kernel_image_unwritable"]
    assert mapped_inodes(modules) == {0}
    assert all(torch.equal(copies(modules)[k], v) for k, v in expected.items())
    assert not any(p.suffix == ".safetensors" for p in tmp_path.iterdir())


def test_a_models_projections_map_one_image_and_compute_as_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = converted_tiny_gguf(
        tmp_path, TinyGgufSpec(architecture="llama", tensor_type=GGMLQuantizationType.Q4_1)
    )
    first, first_logits = prompt_logits(model_dir, "bfloat16", "auto")
    second, second_logits = prompt_logits(model_dir, "bfloat16", "auto")
    monkeypatch.setattr(kernel_image, "_write", lambda path, buffers: None)
    monkeypatch.setattr(kernel_image, "_read", lambda path, buffers: None)
    built, built_logits = prompt_logits(model_dir, "bfloat16", "auto")

    def kept(runner: object) -> dict[str, Int4Linear]:
        model = runner.model  # type: ignore[attr-defined]
        return {n: m for n, m in model.named_modules() if isinstance(m, Int4Linear)}

    assert kept(first)
    [inode] = mapped_inodes(kept(first))
    assert inode != 0 and mapped_inodes(kept(second)) == {inode}
    assert mapped_inodes(kept(built)) == {0}
    assert torch.equal(first_logits, built_logits)
    assert torch.equal(second_logits, built_logits)
