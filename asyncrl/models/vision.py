"""A tiny Qwen2.5-VL-shaped vision-language model built locally (no model hub): the tiny word-level
tokenizer with Qwen's vision tokens, random weights, and Qwen2-VL's image processor saved beside
them, so `AutoModelForImageTextToText`, `AutoTokenizer` and `AutoImageProcessor` load the directory."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from asyncrl.data.images import encode_image_prompt, flat_images, image_columns, rope_positions
from asyncrl.data.synthetic import get_task, make_examples
from asyncrl.models.words import build_tokenizer

VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"
VISION_TOKENS = (VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD)
PATCH, MERGE, FRAMES = 14, 2, 2  # Qwen2.5-VL's patch side, merge window and frames a patch


# the tiny chat template (asyncrl.models.tiny) with HF content parts: an image part is Qwen's
# `<|vision_start|> <|image_pad|> <|vision_end|>`, whose placeholder widens to the image's tokens
VL_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|> ' }}"
    "{% if message['content'] is string %}{{ message['content'] + ' ' }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}{{ '<|vision_start|> <|image_pad|> <|vision_end|> ' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] + ' ' }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ eos_token + ' ' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def build_vl_tokenizer(symbols: list[str]):
    """The tiny tokenizer over `symbols` and the vision tokens, its chat template taking image parts."""
    tokenizer = build_tokenizer([*VISION_TOKENS, *symbols])
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    return tokenizer


PATCHES = {"qwen2_5_vl": 14, "qwen3_vl": 16}  # each family's patch side


def build_vl_config(tokenizer, *, hidden: int = 64, layers: int = 2, heads: int = 4, vision_hidden: int = 32,
                    vision_depth: int = 2, family: str = "qwen2_5_vl"):
    """A small Qwen2.5-VL (or, `family="qwen3_vl"`, Qwen3-VL) config sized to the tokenizer: M-RoPE
    sections over a head of hidden / heads, a vision tower of `vision_depth` blocks (Qwen2.5-VL:
    the last with full attention; Qwen3-VL: the first feeding its deepstack)."""
    head = hidden // heads
    sections = [head // 8, 3 * head // 16, 3 * head // 16]  # time, height, width: half the head's rotary pairs
    sections[0] += head // 2 - sum(sections)
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in
           (("vision_start_token_id", VISION_START), ("image_token_id", IMAGE_PAD),
            ("vision_end_token_id", VISION_END), ("video_token_id", VIDEO_PAD))}
    special = {"pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
               "eos_token_id": tokenizer.eos_token_id}
    text = dict(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=512, rms_norm_eps=1e-5,
                tie_word_embeddings=True, **special)
    vision = dict(depth=vision_depth, hidden_size=vision_hidden, intermediate_size=2 * vision_hidden, num_heads=2,
                  out_hidden_size=hidden, patch_size=PATCHES[family], spatial_merge_size=MERGE,
                  temporal_patch_size=FRAMES)
    if family == "qwen3_vl":
        from transformers import Qwen3VLConfig

        text.update(head_dim=head, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                     "mrope_section": sections, "mrope_interleaved": True})
        vision.update(deepstack_visual_indexes=[0], num_position_embeddings=64)
        return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)
    from transformers import Qwen2_5_VLConfig

    text.update(rope_scaling={"type": "mrope", "mrope_section": sections})
    vision.update(fullatt_block_indexes=[vision_depth - 1], window_size=PATCH * MERGE * 2)
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids, **special)


def build_image_processor(min_pixels: int = 28 * 28, max_pixels: int = 112 * 112, patch: int = PATCH):
    """Qwen2-VL's image processor for this model's patches (its PIL backend without torchvision)."""
    from transformers import Qwen2VLImageProcessor

    return Qwen2VLImageProcessor(min_pixels=min_pixels, max_pixels=max_pixels, patch_size=patch,
                                 merge_size=MERGE, temporal_patch_size=FRAMES)


def build_tiny_vl_model(out: str | Path, symbols: list[str], *, seed: int = 0, family: str = "qwen2_5_vl",
                        **shape) -> Path:
    """Write a random-weight tiny Qwen2.5-VL or Qwen3-VL (fp32), its tokenizer and image processor to `out`."""
    from transformers import AutoModelForImageTextToText

    out = Path(out)
    tokenizer = build_vl_tokenizer(symbols)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(build_vl_config(tokenizer, family=family, **shape))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    patch = PATCHES[family]
    build_image_processor(min_pixels=(2 * patch) ** 2, max_pixels=(8 * patch) ** 2, patch=patch).save_pretrained(out)
    return out


def vl_warm_start(model, tokenizer, task: str, *, steps: int, lr: float, batch_size: int = 64, seed: int = 0,
                  targets: str = "format") -> float:
    """`sft_warm_start` (asyncrl.models.tiny) for a task with images: `steps` AdamW steps on its
    templated image prompts, loss on the answer (random answer symbols with targets="format")."""
    spec, processor = get_task(task), build_image_processor()
    rng = random.Random(f"sft-format:{task}:{seed}")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    threads = torch.get_num_threads()
    # one thread: as fast for a model this size, and a build beside other work (a launch's workers,
    # a test suite) does not fight it for the cores (two such builds at once took 20x longer)
    torch.set_num_threads(1)
    try:
        loss = _warm_steps(model, tokenizer, processor, spec, rng, opt, steps, batch_size, seed, targets)
    finally:
        torch.set_num_threads(threads)
    model.eval()
    return loss


def _warm_steps(model, tokenizer, processor, spec, rng: random.Random, opt, steps: int, batch_size: int, seed: int,
                targets: str) -> float:
    loss = float("nan")
    task = spec.name
    for step in range(steps):
        rows = []
        for prompt, answer, png in make_examples(task, batch_size, seed=10_000 * (seed + 1) + step):
            if targets == "format":
                answer = " ".join(rng.choice(spec.answer_symbols) for _ in answer.split())
            _, ids, pixels, grid = encode_image_prompt(tokenizer, processor, model.config.image_token_id,
                                                       [{"role": "user", "content": prompt}], [png], "warm start")
            tail = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
            rows.append((ids + tail, [-100] * len(ids) + tail, pixels, grid))
        out = model(**_padded_image_batch(model, tokenizer.pad_token_id, rows))
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        opt.step()
        loss = float(out.loss.detach())
    return loss


def _padded_image_batch(model, pad: int, rows: list) -> dict[str, torch.Tensor]:
    """Left-padded (ids, labels, patches, grid) rows as a forward's keyword arguments."""
    width = max(len(ids) for ids, *_ in rows)
    ids = torch.tensor([[pad] * (width - len(r)) + r for r, *_ in rows])
    labels = torch.tensor([[-100] * (width - len(r)) + r for _, r, *_ in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r, *_ in rows])
    pixels, grid = flat_images(image_columns([(p, g) for *_, p, g in rows]))
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "pixel_values": pixels, "image_grid_thw": grid,
            "position_ids": rope_positions(model, ids, mask, grid).permute(1, 0, 2)}
