"""Image prompts through a tiny Qwen2.5-VL: the native engine's rollouts and the trainer's pass
over them agree (fp32), with left padding, several images in a row and none in another."""

from __future__ import annotations

import pytest
import torch
from PIL import Image, ImageDraw

from asyncrl.data.images import (
    GRID,
    PIXELS,
    ROPE,
    ImageInputError,
    expand_image_tokens,
    flat_images,
    image_columns,
    image_token_counts,
    process_images,
    vision_token_ids,
)
from asyncrl.models.vision import IMAGE_PAD, MERGE, VISION_END, VISION_START, build_tiny_vl_model
from asyncrl.roles.forward import response_forward
from asyncrl.rollout.engine import RolloutEngine, SamplingParams
from asyncrl.single_controller.batch import Batch

WORDS = ["how", "many", "red", "blue", "squares", "?", *map(str, range(10))]


def squares(count: int, size: tuple[int, int] = (56, 84), colour: str = "red") -> Image.Image:
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    for i in range(count):
        draw.rectangle([4 + 12 * (i % 4), 4 + 12 * (i // 4), 12 + 12 * (i % 4), 12 + 12 * (i // 4)], fill=colour)
    return image


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    path = build_tiny_vl_model(tmp_path_factory.mktemp("vl"), WORDS)
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    return model, AutoTokenizer.from_pretrained(path), AutoImageProcessor.from_pretrained(path)


def prompts(tokenizer, processor, rows: list[tuple[list[Image.Image], str]]):
    """Left-padded ids (each placeholder widened), their mask and the image columns."""
    ids, images = [], []
    for row_images, text in rows:
        pixels, grid = process_images(processor, row_images)
        words = f"{VISION_START} {IMAGE_PAD} {VISION_END} " * len(row_images) + text
        row = tokenizer(words, add_special_tokens=False)["input_ids"]
        ids.append(expand_image_tokens(row, tokenizer.convert_tokens_to_ids(IMAGE_PAD),
                                       image_token_counts(grid, MERGE)))
        images.append((pixels, grid))
    width = max(map(len, ids))
    input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(r)) + r for r in ids])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in ids])
    return input_ids, mask, image_columns(images)


def test_rollout_log_probs_equal_the_trainers_for_image_prompts(vl):
    model, tokenizer, processor = vl
    rows = [([squares(2)], "how many red squares ?"),
            ([squares(3, (112, 56)), squares(1, colour="blue")], "how many blue squares ?"),
            ([], "how many ?")]
    input_ids, mask, columns = prompts(tokenizer, processor, rows)
    assert mask[2].sum() < mask.shape[1]  # the text-only row is left-padded
    engine = RolloutEngine(model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    out = engine.generate(input_ids, mask, SamplingParams(n=2, max_tokens=8, seed=0), images=columns)

    assert out[PIXELS].shape[0] == out[GRID].shape[0] == out[ROPE].shape[0] == 6
    assert out[ROPE].shape[-1] == out["input_ids"].shape[1]
    assert not torch.isin(out["responses"], torch.tensor(vision_token_ids(model.config))).any()
    assert torch.equal(out[GRID][2], columns[GRID][1])  # rows interleaved: p0, p0, p1, p1, ...
    logprobs, _ = response_forward(model, Batch(out), temperature=1.0)
    got = logprobs * out["response_mask"]
    assert (got - out["rollout_log_probs"]).abs().max() < 1e-5

    # the carried 3-D positions are the model's own: HF computes them for the whole sequence
    theirs = model(input_ids=out["input_ids"], attention_mask=out["attention_mask"],
                   pixel_values=flat_images(out)[0], image_grid_thw=flat_images(out)[1],
                   mm_token_type_ids=(out["input_ids"] == model.config.image_token_id).int()).logits
    r = out["responses"].shape[1]
    hf = torch.log_softmax(theirs[:, -r - 1:-1].float(), -1).gather(-1, out["responses"][..., None])[..., 0]
    assert ((hf - out["rollout_log_probs"]) * out["response_mask"]).abs().max() < 1e-5


def test_image_inputs_that_do_not_fit_are_refused(vl):
    model, tokenizer, processor = vl
    _, grid = process_images(processor, [squares(1)])
    with pytest.raises(ImageInputError, match="2 image placeholders for 1 images"):
        expand_image_tokens([5, 9, 5], 5, image_token_counts(grid, MERGE))
    input_ids, mask, columns = prompts(tokenizer, processor, [([squares(1)], "how many ?")])
    unexpanded = input_ids[input_ids != tokenizer.convert_tokens_to_ids(IMAGE_PAD)]
    engine = RolloutEngine(model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    with pytest.raises(ImageInputError, match="expand each placeholder"):
        engine.generate(torch.cat([unexpanded, torch.tensor([tokenizer.convert_tokens_to_ids(IMAGE_PAD)])])[None],
                        torch.ones(1, len(unexpanded) + 1, dtype=torch.long), SamplingParams(), images=columns)
