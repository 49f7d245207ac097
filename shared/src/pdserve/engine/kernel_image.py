"""The kept projections' buffers in their kernels' layout, written once beside the prepared int4
file (or in a directory of a released checkpoint's) and mapped by every engine that loads it.

A file's int4 and int8 projections (`pdserve.engine.int4_weights`) are not used as the file
stores them: the int4 values are reordered for the kernel, their scales narrowed, q/k/v and
gate/up stacked. Built in each engine, those buffers are private memory: on the default model
about 64 MB in the prefill and again in the decode, beside the file's own pages; a released
gpt-oss's MXFP4 experts, repacked for the int4 kernel (`pdserve.engine.moe.KeptExperts`), 10.7
GB for gpt-oss-20b. So the first
engine to load writes what it built to an image (a safetensors file, `image_path`) and every
engine, itself included, then holds the image's pages instead: one copy in the page cache,
shared by the prefill and the decode on a host.

An image is used only where each tensor equals, bit for bit, what this engine built (a stale or
damaged image is written again, under a lock, so engines starting together write it once); an
image that cannot be written leaves the built buffers in place (logged).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import structlog
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from pdserve.common.file_lock import locked

log = structlog.get_logger(__name__)

IMAGE_VERSION = 1
"""Bumped when what an image holds changes meaning (its tensors are checked besides)."""


def image_path(source: Path, buffers: dict[str, torch.Tensor]) -> Path:
    """Where the image of `buffers` (built from `source`) lives: beside `source`, named for the
    buffers' names, shapes and dtypes, so engines that keep different projections (another
    kernel, another dtype) each have their own."""
    layout = {k: [list(t.shape), str(t.dtype)] for k, t in sorted(buffers.items())}
    named = json.dumps({"version": IMAGE_VERSION, "tensors": layout})
    digest = hashlib.sha256(named.encode()).hexdigest()[:16]
    return source.parent / f"kernels-v{IMAGE_VERSION}-{digest}.safetensors"


def map_buffers(modules: dict[str, nn.Module], source: Path) -> int:
    """Replaces the buffers of `modules` by the same values mapped from their image, writing the
    image first where there is none that matches.

    Args:
        modules: The modules whose buffers loading built, by name.
        source: The file they were built from: the image lives beside it (in its directory,
            made where it is missing).

    Returns:
        Bytes now mapped from the image; 0 where it could not be written (the buffers stay).
    """
    buffers = {
        f"{module_name}.{name}": tensor
        for module_name, module in modules.items()
        for name, tensor in module.named_buffers(recurse=False)
        if tensor is not None
    }
    if not buffers:
        return 0
    path = image_path(source, buffers)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with locked(path.parent, f".{path.name}.lock"):
            mapped = _read(path, buffers)
            is_written = mapped is None
            if mapped is None:
                _write(path, buffers)
                mapped = _read(path, buffers)
    except (OSError, RuntimeError) as error:
        # NOTE: RuntimeError: safetensors refuses buffers that share memory.
        log.warning(
            "kernel_image_unwritable",
            path=str(path),
            error=str(error),
            effect="this engine keeps the projections it built (private memory)",
        )
        return 0
    if mapped is None:
        log.warning(
            "kernel_image_unreadable",
            path=str(path),
            effect="this engine keeps the projections it built (private memory)",
        )
        return 0
    for key, tensor in mapped.items():
        module_name, _, name = key.rpartition(".")
        modules[module_name].register_buffer(name, tensor)
    num_bytes = sum(t.numel() * t.element_size() for t in mapped.values())
    log.info(
        "kernel_image_mapped",
        path=str(path),
        num_tensors=len(mapped),
        bytes=num_bytes,
        written=is_written,
    )
    return num_bytes


def _read(path: Path, buffers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """The image's tensors (views of its pages), or None where it is missing, holds other
    tensors, or any tensor differs from `buffers` (dtype, shape or a bit)."""
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as reader:
            if set(reader.keys()) != set(buffers):
                return None
            mapped = {key: reader.get_tensor(key) for key in buffers}
    except (OSError, SafetensorError) as error:  # NOTE: a damaged file is written again
        log.warning("kernel_image_damaged", path=str(path), error=str(error))
        return None
    for key, tensor in mapped.items():
        built = buffers[key]
        if tensor.dtype != built.dtype or not torch.equal(tensor, built):
            return None
    return mapped


def _write(path: Path, buffers: dict[str, torch.Tensor]) -> None:
    """Writes the image beside its final name, then renames it into place (an engine that
    maps the old one keeps its pages)."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        save_file({key: tensor.contiguous() for key, tensor in buffers.items()}, str(partial))
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
