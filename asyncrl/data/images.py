"""Images in prompts, for vision-language models (Qwen2.5-VL's layout): a row's image patches as
batch columns, an image placeholder widened to the tokens its merged patches fill, and the 3-D
rope positions (M-RoPE) computed once per row and carried with it.

Columns (rows first, so a batch splits over data-parallel ranks like any other):
- `pixel_values` [rows, patches, patch dim]: each row's images' patches in order, zeros after;
- `image_grid_thw` [rows, images, 3]: each image's (frames, height, width) in patches, zero rows after;
- `rope_position_ids` [rows, 3, sequence]: the (time, height, width) position of every token.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from asyncrl.errors import AsyncRLError

PIXELS, GRID, ROPE = "pixel_values", "image_grid_thw", "rope_position_ids"
PLACEHOLDER = "<image>"  # verl's multimodal layout: where a row's next image goes in the prompt text
IMAGE_INPUTS = (PIXELS, GRID)


class ImageInputError(AsyncRLError, ValueError):
    """Image inputs that do not fit their prompt or model."""


def vision_token_ids(config) -> list[int]:
    """A vision-language model's image and video placeholder and delimiter tokens ([] for a text model)."""
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    if config is None or getattr(config, "vision_config", None) is None:
        return []
    return sorted({i for i in (getattr(config, name, None) for name in names) if isinstance(i, int)})


def image_token_counts(grid: Tensor, merge: int) -> list[int]:
    """Tokens each image fills in the language model: its patches over the merge window's area."""
    return (grid.prod(-1) // (merge * merge)).tolist()


def expand_image_tokens(ids: Sequence[int], image_token: int, counts: Sequence[int]) -> list[int]:
    """`ids` with its i-th image placeholder token repeated `counts[i]` times (what HF's processor
    does to the text, here on token ids: no video processor needed)."""
    places = [i for i, token in enumerate(ids) if token == image_token]
    if len(places) != len(counts):
        raise ImageInputError(f"the prompt has {len(places)} image placeholders for {len(counts)} images: "
                              "give each image one placeholder")
    out: list[int] = []
    start = 0
    for place, count in zip(places, counts, strict=True):
        out.extend(ids[start:place])
        out.extend([image_token] * count)
        start = place + 1
    out.extend(ids[start:])
    return out


def load_image(value: Any, where: str):
    """A row's image as RGB: verl's `{bytes, path}` struct, raw bytes, a file path or a PIL image."""
    from PIL import Image

    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, dict):
        value = value.get("bytes") or value.get("path")
    if isinstance(value, (bytes, bytearray)):
        source: Any = io.BytesIO(value)
    elif isinstance(value, str) and value:
        source = value
    else:
        raise ImageInputError(f"{where} holds no image (a {type(value).__name__}): give encoded image bytes, "
                              "a {bytes, path} struct or a file path")
    try:
        with Image.open(source) as image:
            return image.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as e:  # missing, unidentifiable, truncated, huge
        raise ImageInputError(f"{where}: the image cannot be read ({e}); give PNG or JPEG bytes or an "
                              "existing file") from None


def with_image_parts(messages: Sequence[Mapping[str, Any]]) -> list[dict]:
    """Chat messages with verl's `<image>` placeholders in their text as HF content parts (an
    image part where each stood); messages already in parts are kept."""
    out = []
    for m in messages:
        content = m["content"]
        if isinstance(content, str) and PLACEHOLDER in content:
            pieces = content.split(PLACEHOLDER)
            parts: list[dict] = []
            for i, piece in enumerate(pieces):
                if i:
                    parts.append({"type": "image"})
                if piece.strip():
                    parts.append({"type": "text", "text": piece.strip()})
            content = parts
        out.append({"role": m["role"], "content": content})
    return out


def image_parts(messages: Sequence[Mapping[str, Any]]) -> int:
    """How many image content parts the messages hold."""
    return sum(1 for m in messages if not isinstance(m["content"], str)
               for part in m["content"] if isinstance(part, dict) and part.get("type") in ("image", "image_url"))


def encode_image_prompt(tokenizer, processor, image_token_id: int, messages: Sequence[Mapping[str, Any]],
                        images: Sequence[Any], where: str) -> tuple[str, list[int], Tensor, Tensor]:
    """A prompt with images as the model reads it: the templated text (the tokenizer's chat
    template writes each image part's placeholder), its ids with each placeholder widened to its
    image's tokens, and the images' patches [P, D] and grids [K, 3]. `where` names the row."""
    messages = with_image_parts(messages)
    wanted = image_parts(messages)
    if wanted != len(images):
        raise ImageInputError(f"{where}: the prompt has {wanted} image placeholders for {len(images)} images; "
                              "give each image one <image> (or one image content part)")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    pixels, grid = process_images(processor, [load_image(v, f"{where}, image {i}") for i, v in enumerate(images)])
    counts = image_token_counts(grid, processor.merge_size) if len(grid) else []
    try:
        return text, expand_image_tokens(ids, image_token_id, counts), pixels, grid
    except ImageInputError as e:
        raise ImageInputError(f"{where}: {e} (the chat template wrote them)") from None


def reads_images(model_dir: str | None) -> bool:
    """Whether the model directory holds a vision-language model (a `vision_config` in its config.json)."""
    import json
    from pathlib import Path

    config = Path(model_dir or "") / "config.json"
    try:
        return isinstance(json.loads(config.read_text()).get("vision_config"), dict)
    except (OSError, ValueError, AttributeError):
        return False


def no_images() -> tuple[Tensor, Tensor]:
    """A row without images: no patches, no grids."""
    return torch.zeros(0, 0), torch.zeros(0, 3, dtype=torch.long)


class ImageReader:
    """How a vision-language model reads a prompt's images: its image processor (min and max
    pixels as configured) and image placeholder token."""

    def __init__(self, processor: Any, image_token_id: int) -> None:
        self.processor, self.image_token_id = processor, image_token_id

    @classmethod
    def of_model(cls, path: str, min_pixels: int | None = None, max_pixels: int | None = None) -> ImageReader | None:
        """The reader of the model directory at `path`; None for a text-only model (no vision_config)."""
        from transformers import AutoConfig, AutoImageProcessor

        config = AutoConfig.from_pretrained(path)
        if getattr(config, "vision_config", None) is None:
            return None
        sizes = {k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v is not None}
        return cls(AutoImageProcessor.from_pretrained(path, **sizes), config.image_token_id)

    def wants(self, messages: Sequence[Mapping[str, Any]]) -> bool:
        """Whether the messages hold an image placeholder or part."""
        return image_parts(with_image_parts(messages)) > 0

    def encode(self, tokenizer, messages: Sequence[Mapping[str, Any]], images: Sequence[Any],
               where: str) -> tuple[str, list[int], Tensor, Tensor]:
        """The templated text, its ids (placeholders widened), patches and grids (`encode_image_prompt`)."""
        return encode_image_prompt(tokenizer, self.processor, self.image_token_id, messages, images, where)


def process_images(processor, images: Sequence) -> tuple[Tensor, Tensor]:
    """A row's images (PIL) through the model's image processor: patches [P, D] and grids [K, 3]
    (empty for none)."""
    if not images:
        return no_images()
    out = processor(images=list(images), return_tensors="pt")
    return out[PIXELS], out[GRID]


def image_columns(rows: Sequence[tuple[Tensor, Tensor]]) -> dict[str, Tensor]:
    """Each row's (patches [P, D], grid [K, 3]) as the two padded columns (a row may have none:
    P = K = 0)."""
    dim = max((p.shape[-1] for p, _ in rows if p.numel()), default=0)
    most_patches = max(p.shape[0] for p, _ in rows)
    most_images = max(g.shape[0] for _, g in rows)
    pixels = torch.zeros(len(rows), most_patches, dim)
    grid = torch.zeros(len(rows), most_images, 3, dtype=torch.long)
    for i, (p, g) in enumerate(rows):
        if int(g.prod(-1).sum()) != p.shape[0]:
            raise ImageInputError(f"row {i}: {p.shape[0]} patches for image grids {g.tolist()}")
        if len(g):
            pixels[i, :p.shape[0]] = p
            grid[i, :g.shape[0]] = g
    return {PIXELS: pixels, GRID: grid}


def has_images(columns: Mapping[str, Tensor] | object) -> bool:
    """Whether a batch (or a dict of columns) carries image inputs."""
    return GRID in columns  # type: ignore[operator]


def flat_images(columns: Mapping[str, Tensor]) -> tuple[Tensor, Tensor]:
    """The columns as the model takes them: every row's patches end to end [sum P, D] and every
    image's grid [sum K, 3], in row order."""
    pixels, grid = columns[PIXELS], columns[GRID]
    patches = grid.prod(-1).sum(-1)  # per row
    real_patches = torch.arange(pixels.shape[1], device=pixels.device) < patches[:, None]
    return pixels[real_patches], grid[grid[..., 0] > 0]


def row_images(columns: Mapping[str, Tensor]) -> list[tuple[Tensor, Tensor]]:
    """The columns back as each row's (patches [P, D], grids [K, 3]), padding dropped."""
    return [(p[:int(g.prod(-1).sum())], g[g[:, 0] > 0]) for p, g in zip(columns[PIXELS], columns[GRID], strict=True)]


def rope_positions(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor, grid: Tensor) -> Tensor:
    """The model's 3-D rope positions [rows, 3, sequence] of left-padded rows whose images have
    the grids `grid` [images, 3] (in row order)."""
    base = getattr(model, "model", model)
    if not hasattr(base, "get_rope_index"):
        raise ImageInputError(f"{type(model).__name__} takes no images (no 3-D rope positions): "
                              "use a vision-language model such as Qwen2.5-VL")
    image_token = model.config.image_token_id
    tokens = (input_ids == image_token).int()
    if int(tokens.sum()) != sum(image_token_counts(grid, model.config.vision_config.spatial_merge_size)):
        raise ImageInputError(f"{int(tokens.sum())} image tokens in the prompts for images of "
                              f"{image_token_counts(grid, model.config.vision_config.spatial_merge_size)} "
                              "tokens: expand each placeholder with `expand_image_tokens`")
    positions, _ = base.get_rope_index(input_ids, tokens, image_grid_thw=grid if len(grid) else None,
                                       attention_mask=attention_mask)
    return positions.permute(1, 0, 2).contiguous()


def vision_tower(model: torch.nn.Module) -> torch.nn.Module | None:
    """A vision-language model's vision tower with its patch merger (Qwen2.5-VL's `model.visual`);
    None for a text model."""
    base = getattr(model, "model", model)
    tower = getattr(base, "visual", None) or getattr(model, "visual", None)
    return tower if isinstance(tower, torch.nn.Module) else None


def freeze_vision(model: torch.nn.Module, path: str) -> int:
    """Stop `model`'s vision tower training (`actor.freeze_vision`); returns its parameters."""
    tower = vision_tower(model)
    if tower is None:
        raise ImageInputError(f"actor.freeze_vision=true: {path} has no vision tower (its config.json has no "
                              "vision_config); unset it for a text model")
    tower.requires_grad_(False)
    return sum(p.numel() for p in tower.parameters())


def model_image_kwargs(columns: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The forward's keyword arguments for a batch with images (patches, grids, 3-D positions),
    {} for one without."""
    if not has_images(columns):
        return {}
    pixels, grid = flat_images(columns)
    out = {"position_ids": columns[ROPE].permute(1, 0, 2)}
    if len(grid):
        out.update(pixel_values=pixels, image_grid_thw=grid)
    return out
