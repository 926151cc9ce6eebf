"""Images in a prompt (Qwen3-VL, Qwen3.5 / 3.6), the API side (no torch): transformers' own image processor (PIL
backend) over a request's images, and the prompt's placeholders expanded to the tokens the model fills.

A prompt names each image once, as vLLM's prompts do: one image-pad token (``<|image_pad|>``, between
``<|vision_start|>`` and ``<|vision_end|>`` in the chat template's layout), the k-th for the k-th image. Each
becomes t·h·w / merge² image-pad tokens, one per merged patch block, the count the vision tower returns for it.
What crosses to the core is an ``ImageInput``: the processor's pixel rows (float32 bytes), each image's patch grid,
and a hash of each image's pixels for the prefix cache (the image-pad ids alone would let two images share K/V).
"""

from __future__ import annotations

import hashlib

import numpy as np

from mili.engine.messages import ImageInput
from mili.errors import InvalidRequest


class ImageInputs:
    """Loads the checkpoint's image processor (``preprocessor_config.json``) on the first request with images."""

    def __init__(self, model_path: str, model_config, enabled: bool):
        self.model_path, self.model_config, self.enabled = model_path, model_config, enabled
        self._processor = None

    @property
    def processor(self):
        if self._processor is None:
            from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

            try:
                processor = Qwen2VLImageProcessorPil.from_pretrained(self.model_path)
            except OSError as e:
                raise InvalidRequest(f"the checkpoint has no image processor config (preprocessor_config.json): "
                                     f"{e}", param="multi_modal_data") from e
            vision = self.model_config.vision_config
            theirs = (processor.patch_size, processor.temporal_patch_size, processor.merge_size)
            ours = (vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size)
            if theirs != ours:
                raise InvalidRequest(f"the image processor's patch, temporal patch and merge sizes {theirs} are not "
                                     f"the vision tower's {ours}", param="multi_modal_data")
            self._processor = processor
        return self._processor

    @property
    def takes_images(self) -> bool:
        return self.enabled and self.model_config.image_token_id is not None

    def prepare(self, token_ids: list[int], images: list) -> tuple[list[int], ImageInput]:
        """(the prompt with each image's placeholder expanded, the images for the core); ``images``: PIL images."""
        image_token = self.model_config.image_token_id
        if not self.takes_images:
            raise InvalidRequest("this model takes no images (a text-only checkpoint, language_model_only, or "
                                 "limit_mm_per_prompt image 0)",
                                 param="multi_modal_data")
        places = [i for i, t in enumerate(token_ids) if t == image_token]
        if len(places) != len(images):
            raise InvalidRequest(f"the prompt has {len(places)} image placeholders (token {image_token}) for "
                                 f"{len(images)} images: one each", param="multi_modal_data")
        try:
            out = self.processor([image.convert("RGB") for image in images], return_tensors="np")
        except Exception as e:  # not an image, an unreadable one
            raise InvalidRequest(f"cannot process the images: {type(e).__name__}: {e}",
                                 param="multi_modal_data") from e
        pixels = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)
        grids = [tuple(int(x) for x in g) for g in out["image_grid_thw"]]
        merge = self.model_config.vision_config.spatial_merge_size
        expanded, last, start = [], 0, 0
        hashes = []
        for place, (t, h, w) in zip(places, grids):
            expanded += token_ids[last:place] + [image_token] * (t * h * w // merge ** 2)
            last = place + 1
            rows = pixels[start:start + t * h * w]
            start += t * h * w
            digest = hashlib.blake2b(rows.tobytes() + bytes(f"{t},{h},{w}", "ascii"), digest_size=8).digest()
            hashes.append(int.from_bytes(digest, "little") >> 2)
        expanded += token_ids[last:]
        return expanded, ImageInput(pixels.tobytes(), pixels.shape[1], [list(g) for g in grids], hashes)
