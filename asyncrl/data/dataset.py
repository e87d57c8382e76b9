"""Prompt datasets: load verl-layout parquet/jsonl rows, tokenise prompts, batch them resumably."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from asyncrl.data.images import ImageInputError, image_columns, no_images

log = logging.getLogger(__name__)


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids for a left-padded batch: cumsum of the mask - 1, clamped at 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_(min=0)


class DatasetError(ValueError):
    """A data file or row that cannot be used as a prompt dataset (the message says what to fix)."""


def _from_arrow_value(value: Any) -> Any:
    # parquet maps come back as lists of (key, value) pairs; structs already come back as dicts
    if isinstance(value, list) and value and all(
        isinstance(v, tuple) and len(v) == 2 for v in value
    ):
        return {k: _from_arrow_value(v) for k, v in value}
    if isinstance(value, list):
        return [_from_arrow_value(v) for v in value]
    if isinstance(value, dict):
        return {k: _from_arrow_value(v) for k, v in value.items()}
    return value


EXPECTED_COLUMNS = ("prompt (a string or a list of {role, content} messages) and reward_model.ground_truth "
                    "(or a flat ground_truth or answer column); data_source and extra_info are optional")
SUFFIXES = (".parquet", ".jsonl", ".ndjson", ".json")
_TRUTH_KEYS = ("ground_truth", "answer")
IMAGE_COLUMNS = ("images", "image", "videos", "video")  # verl's multimodal layout, and one image a row
TEXT_ONLY = ("this model is text-only (its config.json has no vision_config), so the prompts would be read "
             "without their images; train a vision-language model (Qwen2.5-VL's layout) or drop the column for a "
             "text task")
NO_VIDEO = "videos are not read (images are); drop the column or give the frames as images"


def load_rows(path: str | Path | Sequence[str | Path]) -> list[dict]:
    """Rows of one or more .parquet / .jsonl / .json files (verl's layout or flat prompt rows)."""
    if isinstance(path, (list, tuple)):
        return [row for p in path for row in load_rows(p)]
    p = _existing(path)
    if p.suffix == ".parquet":
        return [_from_arrow_value(r) for r in _read_parquet(p).to_pylist()]
    if p.suffix in (".jsonl", ".ndjson"):
        return list(_jsonl_rows(p))
    return _json_rows(p)


def check_data_file(path: str | Path, prompt_key: str = "prompt", answer_key: str | None = None,
                    images: bool = False) -> None:
    """Refuse, before anything starts, a data file that is missing, of another format or
    without the prompt and ground-truth columns (parquet: its schema only; jsonl/json: its
    first row); an image column unless the model reads `images`, a video column always."""
    p = _existing(path)
    if p.suffix == ".parquet":
        import pyarrow as pa

        schema = _read_parquet(p, schema_only=True)
        columns = {name: _struct_fields(schema.field(name).type, pa) for name in schema.names}
    else:
        first = next(_jsonl_rows(p), None) if p.suffix in (".jsonl", ".ndjson") else next(iter(_json_rows(p)), None)
        if first is None:
            raise DatasetError(f"{p} holds no rows; a prompt dataset needs rows with {EXPECTED_COLUMNS}")
        if not isinstance(first, dict):
            raise DatasetError(f"{p}: its first row is a {type(first).__name__}, not an object with "
                               f"{EXPECTED_COLUMNS}")
        columns = {k: (sorted(v) if isinstance(v, dict) else None) for k, v in first.items()}
    rm = columns.get("reward_model")
    if answer_key is not None:
        top, _, rest = answer_key.partition(".")
        sub = columns.get(top)
        has_truth = top in columns and (not rest or sub is None or rest.partition(".")[0] in sub)
    else:
        has_truth = any(k in columns for k in _TRUTH_KEYS) or (
            "reward_model" in columns and (rm is None or "ground_truth" in rm))
    media = [c for c in IMAGE_COLUMNS if c in columns and (c.startswith("video") or not images)]
    if media:
        raise DatasetError(f"{p} has an image column {media[0]!r} (a vision-language layout): "
                           f"{NO_VIDEO if media[0].startswith('video') else TEXT_ONLY}")
    if prompt_key not in columns or not has_truth:
        wanted = (f"{EXPECTED_COLUMNS} (or set data.prompt_key and data.answer_key to your columns)"
                  if (prompt_key, answer_key) == ("prompt", None) else
                  f"the prompt column {prompt_key!r} (data.prompt_key) and the answer column "
                  f"{answer_key or 'reward_model.ground_truth'!r} (data.answer_key)")
        raise DatasetError(f"{p} has columns {', '.join(sorted(columns)) or '(none)'}; a prompt dataset needs "
                           f"{wanted}")


def _existing(path: str | Path) -> Path:
    p = Path(path)
    if not p.is_file():
        what = "is a directory" if p.is_dir() else "does not exist"
        raise DatasetError(f"data file {p} {what} (check the data.*_files setting)")
    if p.suffix not in SUFFIXES:
        raise DatasetError(f"{p}: unsupported data file type {p.suffix!r}; use .parquet or .jsonl with "
                           f"{EXPECTED_COLUMNS}")
    return p


def _read_parquet(p: Path, schema_only: bool = False) -> Any:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_schema(p) if schema_only else pq.read_table(p)
    except (pa.ArrowException, OSError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DatasetError(f"{p} is not a readable parquet file ({reason}); write it with "
                           "pandas.DataFrame.to_parquet or pyarrow, or use .jsonl") from None


def _struct_fields(arrow_type: Any, pa: Any) -> list[str] | None:
    """A struct column's field names (None: not a struct, or a map whose keys only rows show)."""
    if pa.types.is_struct(arrow_type):
        return [arrow_type.field(i).name for i in range(arrow_type.num_fields)]
    return None


def _jsonl_rows(p: Path) -> Iterator[Any]:
    with p.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{p}:{lineno}: not valid JSON ({e})") from None
            except UnicodeDecodeError:
                raise DatasetError(f"{p}:{lineno}: not UTF-8 text; is it a .jsonl file?") from None


def _json_rows(p: Path) -> list:
    try:
        rows = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DatasetError(f"{p}: not valid JSON ({str(e).splitlines()[0]})") from None
    if not isinstance(rows, list):
        raise DatasetError(f"{p}: a .json data file must hold a list of rows")
    return rows


def prompt_messages(row: dict, prompt_key: str = "prompt", images: bool = False) -> list[dict]:
    """The row's prompt as chat messages (a plain string becomes one user message); image content
    parts only where the model reads `images`."""
    if not isinstance(row, dict):
        raise DatasetError(f"row is a {type(row).__name__}, not an object of named fields")
    if prompt_key not in row:
        raise DatasetError(f"row has no {prompt_key!r} field (fields: {sorted(row)})")
    prompt = row[prompt_key]
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, (list, tuple)) and all(
        isinstance(m, dict) and "role" in m and "content" in m for m in prompt
    ):
        if not images and any(_media_part(m["content"]) for m in prompt):
            raise DatasetError(f"row field {prompt_key!r} has an image content part: {TEXT_ONLY}")
        return [{"role": m["role"], "content": m["content"]} for m in prompt]
    raise DatasetError(
        f"row field {prompt_key!r} must be a string or a list of {{role, content}} messages"
    )


def _media_part(content: Any) -> bool:
    """Whether a message's content holds an image or video part (HF chat-template content parts)."""
    return isinstance(content, (list, tuple)) and any(
        isinstance(part, dict) and str(part.get("type", "")).split("_")[0] in ("image", "video") for part in content)


def _check_text_only(row: dict) -> None:
    """Refuse a row that carries images (verl's `images` column, filled): they would be dropped."""
    media = [c for c in IMAGE_COLUMNS if row.get(c) not in (None, [], "", b"")]
    if media:
        raise DatasetError(f"row has an image column {media[0]!r}: "
                           f"{NO_VIDEO if media[0].startswith('video') else TEXT_ONLY}")


def row_images(row: dict) -> list:
    """A row's images: verl's `images` list, or a single `image`; a video column is refused."""
    if row.get("videos") not in (None, []) or row.get("video") not in (None, "", b""):
        raise DatasetError(f"row has a video column: {NO_VIDEO}")
    many, one = row.get("images"), row.get("image")
    if many not in (None, []):
        return list(many) if isinstance(many, (list, tuple)) else [many]
    return [] if one in (None, "", b"") else [one]


def ground_truth_of(row: dict, answer_key: str | None = None, required: bool = True) -> Any:
    """The row's reference answer: `answer_key` (dotted for a nested field) when given, else verl's
    `reward_model.ground_truth`, or a flat `ground_truth` / `answer` field. A null answer is an
    error, as a missing one is, when `required` (a rule or your reward function would get None)."""
    value = _ground_truth(row, answer_key)
    if value is None and required:
        raise DatasetError(f"row has a null {answer_key or 'reward_model.ground_truth'} (a reward function "
                           "would receive None); give every row its reference answer or drop the row")
    return value


def _ground_truth(row: dict, answer_key: str | None) -> Any:
    if answer_key is not None:
        value: Any = row
        for part in answer_key.split("."):
            if not isinstance(value, dict) or part not in value:
                raise DatasetError(f"row has no {answer_key!r} field (data.answer_key; fields: {sorted(row)})")
            value = value[part]
        return value
    rm = row.get("reward_model")
    if isinstance(rm, dict) and "ground_truth" in rm:
        return rm["ground_truth"]
    for key in ("ground_truth", "answer"):
        if key in row:
            return row[key]
    raise DatasetError(f"row has no reward_model.ground_truth (fields: {sorted(row)})")


def prompt_uid(text: str) -> str:
    """A stable id for a prompt string (GRPO groups responses by it)."""
    return hashlib.sha1(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class PromptItem:
    """One tokenised prompt and the metadata the reward needs."""

    input_ids: list[int]
    raw_prompt: str
    ground_truth: Any
    data_source: str
    extra_info: dict
    uid: str
    messages: list[dict] | None = None  # the chat messages the prompt was rendered from (API agents send them)
    pixel_values: torch.Tensor | None = None  # its images' patches [P, D] (asyncrl.data.images), for a model that reads them
    image_grid_thw: torch.Tensor | None = None  # and their grids [K, 3]


class PromptDataset:
    """Tokenised prompts of `rows`; prompts longer than `max_prompt_len` tokens are dropped."""

    def __init__(
        self,
        rows: Sequence[dict],
        tokenizer: Any,
        max_prompt_len: int,
        apply_chat_template: bool = True,
        prompt_key: str = "prompt",
        answer_key: str | None = None,
        require_answer: bool = True,  # False: a learned reward model scores, null answers are fine
        tools: list[dict] | None = None,  # tool descriptions the chat template shows (multi-turn with tools)
        images: Any = None,  # a vision-language model's `asyncrl.data.images.ImageReader`: rows may hold images
    ) -> None:
        self.tokenizer = tokenizer
        self.max_prompt_len = max_prompt_len
        self.pad_token_id = tokenizer.pad_token_id
        if self.pad_token_id is None:
            raise DatasetError("the tokenizer has no pad token; set tokenizer.pad_token first")
        self.items: list[PromptItem] = []
        self.images, self.apply_chat_template, self.tools = images, apply_chat_template, tools
        dropped = 0
        for index, row in enumerate(rows):
            try:
                messages = prompt_messages(row, prompt_key, images=images is not None)
                if images is None:
                    _check_text_only(row)
                ground_truth = ground_truth_of(row, answer_key, required=require_answer)
                item = self._tokenise(row, messages, index)
            except ImageInputError as e:  # it names the row
                raise DatasetError(str(e)) from None
            except DatasetError as e:
                raise DatasetError(f"row {index} {str(e).removeprefix('row ')}; a prompt dataset needs "
                                   f"{EXPECTED_COLUMNS}") from None
            if len(item.input_ids) > max_prompt_len:
                dropped += 1
                continue
            self.items.append(replace(item, ground_truth=ground_truth))
        if dropped:
            log.warning("dropped %d of %d prompts longer than max_prompt_len=%d",
                        dropped, len(rows), max_prompt_len)
        if not self.items:
            raise DatasetError(
                f"no usable prompts ({len(rows)} rows, {dropped} over max_prompt_len="
                f"{max_prompt_len}); raise max_prompt_len or check the data"
            )

    def _tokenise(self, row: dict, messages: list[dict], index: int) -> PromptItem:
        """The row's prompt as ids (its images' patches too, for a model that reads them)."""
        tokenizer, pixels, grid = self.tokenizer, None, None
        pictures = row_images(row) if self.images is not None else []
        if self.images is not None and (pictures or self.images.wants(messages)):
            text, ids, pixels, grid = self.images.encode(tokenizer, messages, pictures, f"row {index}")
            if (filled := ids.count(self.images.image_token_id)) > self.max_prompt_len:
                raise ImageInputError(f"row {index}: its images fill {filled} tokens, more than data.max_prompt_len="
                                   f"{self.max_prompt_len}; raise data.max_prompt_len or lower data.max_pixels")
        elif self.apply_chat_template:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                 **({"tools": self.tools} if self.tools else {}))
            ids = tokenizer.encode(text, add_special_tokens=False)
        else:
            text = "\n".join(m["content"] for m in messages)
            ids = tokenizer.encode(text, add_special_tokens=True)
        return PromptItem(input_ids=list(ids), raw_prompt=text, ground_truth=None,
                          data_source=str(row.get("data_source", "unknown")), extra_info=dict(row.get("extra_info") or {}),
                          uid=prompt_uid(text), messages=list(messages), pixel_values=pixels, image_grid_thw=grid)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> PromptItem:
        return self.items[i]

    def collate(self, items: Sequence[PromptItem]) -> dict[str, Any]:
        """Left-pad `items` into a batch dict (tensors + per-row lists)."""
        return collate_prompts(items, self.pad_token_id)


def pad_prompts(batch: dict[str, Any], width: int, pad_token_id: int) -> dict[str, Any]:
    """A collated prompt batch left-padded to `width` columns (no-op if it is that wide)."""
    extra = width - batch["input_ids"].shape[1]
    if extra < 0:
        raise ValueError(f"prompts of {batch['input_ids'].shape[1]} tokens do not fit width {width}")
    if extra == 0:
        return batch
    rows = batch["input_ids"].shape[0]
    ids = torch.cat([torch.full((rows, extra), pad_token_id, dtype=torch.long), batch["input_ids"]], dim=1)
    mask = torch.cat([torch.zeros((rows, extra), dtype=torch.long), batch["attention_mask"]], dim=1)
    return {**batch, "input_ids": ids, "attention_mask": mask, "position_ids": positions_from_mask(mask)}


def collate_prompts(items: Sequence[PromptItem], pad_token_id: int) -> dict[str, Any]:
    """input_ids/attention_mask/position_ids [B, P] left-padded, plus per-row metadata lists."""
    width = max(len(it.input_ids) for it in items)
    # one tensor from padded lists (a torch.tensor per row was half of a step's prompt batch)
    ids = torch.tensor([[pad_token_id] * (width - len(it.input_ids)) + list(it.input_ids) for it in items],
                       dtype=torch.long).reshape(len(items), width)
    mask = torch.tensor([[0] * (width - len(it.input_ids)) + [1] * len(it.input_ids) for it in items],
                        dtype=torch.long).reshape(len(items), width)
    images = {}
    if any(it.image_grid_thw is not None for it in items):
        images = image_columns([(it.pixel_values, it.image_grid_thw) if it.image_grid_thw is not None else no_images()
                                for it in items])
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": positions_from_mask(mask),
        **images,
        "ground_truth": [it.ground_truth for it in items],
        "data_source": [it.data_source for it in items],
        "raw_prompt": [it.raw_prompt for it in items],
        "extra_info": [it.extra_info for it in items],
        "messages": [it.messages for it in items],
        # a group per row of this batch (GRPO/RLOO normalise a prompt's samples together): two
        # rows with the same prompt text are two groups, not one of 2n samples
        "uid": [f"{it.uid}#{i}" for i, it in enumerate(items)],
    }


class PromptLoader:
    """Batches of a `PromptDataset`, reshuffled per epoch, resumable via `state_dict()`.

    Iterating yields the rest of the current epoch; the next iteration starts the next epoch.
    `next_batch()` rolls over epochs by itself. The shuffle order is a pure function of
    (seed, epoch), so (epoch, position) is the whole state.
    """

    def __init__(
        self,
        dataset: PromptDataset,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
    ) -> None:
        if batch_size < 1:
            raise DatasetError(f"batch_size must be >= 1, got {batch_size}")
        if drop_last and len(dataset) < batch_size:
            raise DatasetError(
                f"dataset has {len(dataset)} prompts, fewer than batch_size={batch_size}; "
                "lower the batch size or add data"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.position = 0  # batches of this epoch already handed out
        self._drawn: tuple[int, list[int]] | None = None  # (epoch, its order)

    def __len__(self) -> int:
        n, b = len(self.dataset), self.batch_size
        return n // b if self.drop_last else -(-n // b)

    def _order(self, epoch: int) -> list[int]:
        """The epoch's order of the rows (drawn once per epoch, not once per batch)."""
        if self._drawn is not None and self._drawn[0] == epoch:
            return self._drawn[1]
        if not self.shuffle:
            order = list(range(len(self.dataset)))
        else:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            order = torch.randperm(len(self.dataset), generator=g).tolist()
        self._drawn = (epoch, order)
        return order

    def _batch(self) -> dict[str, Any]:
        order = self._order(self.epoch)
        start = self.position * self.batch_size
        idx = order[start:start + self.batch_size]
        self.position += 1
        return self.dataset.collate([self.dataset[i] for i in idx])

    def _roll_over(self) -> None:
        if self.position >= len(self):
            self.epoch += 1
            self.position = 0

    def __iter__(self) -> Iterator[dict[str, Any]]:
        self._roll_over()
        while self.position < len(self):
            yield self._batch()

    def next_batch(self) -> dict[str, Any]:
        """The next batch, starting a new epoch when this one is used up."""
        self._roll_over()
        return self._batch()

    def state_dict(self) -> dict[str, int | bool]:
        """Everything needed to continue exactly where this loader stopped."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_prompts": len(self.dataset),
            "batch_size": self.batch_size,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()`; refuses a state saved for other data or another batch size."""
        for key, mine in (("num_prompts", len(self.dataset)), ("batch_size", self.batch_size),
                          ("seed", self.seed), ("shuffle", self.shuffle)):
            if key in state and state[key] != mine:
                raise DatasetError(
                    f"loader state was saved with {key}={state[key]}, this loader has {mine}; "
                    "resume with the same data and data settings"
                )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
