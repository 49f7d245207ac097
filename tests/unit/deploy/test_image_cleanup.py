"""What `make image` removes of earlier builds (deploy/image.py `superseded`).

A machine that builds the image on every change kept every earlier build (about 4 GB each) until
its disk filled and the build failed; these cases pin which images go and which stay.
"""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def load_image_module() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(
        "pdserve_deploy_image", ROOT / "deploy" / "image.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_untagged_images_of_other_builds_go_and_the_kept_build_stays() -> None:
    image = load_image_module()
    images = [
        ("final-now", "new", True),  # the tag's image, this build
        ("stage-now", "new", False),  # this build's stage: the next build's layer cache
        ("final-before", "old", False),  # the image the tag pointed to before
        ("stage-before", "old", False),
        ("stage-long-ago", "older", False),
        ("other-tag", "other", True),  # another tag (a GPU build, say) is left alone
    ]
    assert image.superseded(images, "new") == ["final-before", "stage-before", "stage-long-ago"]


def test_before_a_build_the_tags_own_stage_stays() -> None:
    image = load_image_module()
    images = [("final", "cur", True), ("stage", "cur", False), ("stale", "old", False)]
    assert image.superseded(images, "cur") == ["stale"]
    assert image.superseded(images, None) == ["stage", "stale"]
