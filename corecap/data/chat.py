"""Conversations: a row's "messages" (OpenAI style) or "conversations" (ShareGPT style), checked,
then rendered with the model's chat template into token ids and the assistant-token loss mask.
docs/datasets.md describes the mask method.
"""

from __future__ import annotations

import json
import re

import numpy as np

from corecap.errors import CorecapError
from corecap.data.media import IMAGE_TAG, expanded, message_content, sharegpt_images, split_image_tags, text_of
from corecap.data.rows import RowError

MESSAGE_ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
                  "assistant": "assistant", "system": "system"}
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def parse_messages(obj: dict, name: str, where: str, generate: bool = False, images=None,
                   found: list | None = None) -> list[dict]:
    """The conversation as OpenAI-style messages, checked; ShareGPT roles mapped. `generate`: the
    model writes the answer, so the conversation needs a user turn, not an assistant turn.
    A content may be a list of parts with images (corecap/data/media.py): `images` (a
    media.Images, None for a model that takes none) resolves them, appended to `found` in order."""
    turns = obj[name]
    sharegpt = name == "conversations"
    found = [] if found is None else found
    tagged = sharegpt_images(obj, where) if sharegpt else None
    role_field, content_field = ("from", "value") if sharegpt else ("role", "content")
    roles = SHAREGPT_ROLES if sharegpt else {r: r for r in MESSAGE_ROLES}
    if not isinstance(turns, list):
        raise RowError(where, f"field {name!r} must be a list of objects, got {type(turns).__name__}",
                       "malformed conversation")
    if not turns:
        raise RowError(where, f"field {name!r} is empty (no turns)", "empty conversation")
    messages = []
    for i, turn in enumerate(turns):
        at = f"{name}[{i}]"
        if not isinstance(turn, dict):
            raise RowError(where, f"{at} must be an object, got {type(turn).__name__}", "malformed conversation")
        for f in (role_field, content_field):
            if f not in turn:
                raise RowError(where, f"{at} has no field {f!r}", "malformed conversation")
        role, content = turn[role_field], turn[content_field]
        if not isinstance(role, str) or role not in roles:
            expected = ", ".join(map(repr, roles))
            raise RowError(where, f"{at}.{role_field}: unknown role {role!r} (expected one of {expected})",
                           "unknown role")
        if tagged is not None and isinstance(content, str) and IMAGE_TAG in content:
            content = split_image_tags(content)  # the row's images go in order (_place_sharegpt_images)
        elif not isinstance(content, str):
            content = message_content(content, where, f"{at}.{content_field}", images, found)
        messages.append({"role": roles[role], "content": content})
    if tagged is not None:
        _place_sharegpt_images(messages, tagged, found, images, where)
    if all(not text_of(m["content"]).strip() and isinstance(m["content"], str) for m in messages):
        raise RowError(where, f"field {name!r} has only empty or whitespace turns", "whitespace-only conversation")
    if generate:
        if not any(m["role"] == "user" for m in prompt_turns(messages)):
            raise RowError(where,
                           f"field {name!r} has no user turn before its last assistant turns (nothing to answer)",
                           "nothing to answer")
    elif not any(m["role"] == "assistant" for m in messages):
        answerable = any(m["role"] == "user" for m in messages)
        hint = "; add --max-tokens N to let the model answer it" if answerable else ""
        raise RowError(where, f"field {name!r} has no assistant turn (nothing to train on{hint})", "no assistant turn")
    return messages


def _place_sharegpt_images(messages: list[dict], refs: list, found: list, images, where: str) -> None:
    """ShareGPT/LLaVA: one `<image>` in the turns' text per reference of the row's `image`, in
    order; with none, a single image goes before the first user turn's text (LLaVA's custom)."""
    if images is None:
        raise CorecapError(f"{where}: field 'image': an image, which this command does not read (corecap run does)")
    tags = sum(isinstance(m["content"], list) and sum(p["type"] == "image" for p in m["content"]) for m in messages)
    if tags == 0 and len(refs) == 1:
        first = next((m for m in messages if m["role"] == "user"), None)
        if first is not None:
            first["content"] = [{"type": "image"}, *([{"type": "text", "text": first["content"]}]
                                                     if first["content"] else [])]
            tags = 1
    if tags != len(refs):
        raise RowError(where, f"{len(refs)} images in field 'image' and {tags} {IMAGE_TAG} in the turns' text "
                       "(expected one for each)", "bad image")
    found.extend(images.resolve(r, where, f"image[{i}]") for i, r in enumerate(refs))


def prompt_turns(messages: list[dict]) -> list[dict]:
    """What the model answers: the turns before the trailing assistant turns (which it replaces)."""
    end = len(messages)
    while end and messages[end - 1]["role"] == "assistant":
        end -= 1
    return messages[:end]


def answer_points(messages: list[dict]) -> list[int]:
    """Where the model answers when it rewrites every assistant turn (`--rewrite-turns all`): the
    start of each run of assistant turns with a user turn before it, and the end of a
    conversation whose last turn is not the assistant's. An assistant turn before any user turn
    (a greeting) is kept as written."""
    points, seen_user = [], False
    for i, m in enumerate(messages):
        if m["role"] == "user":
            seen_user = True
        elif m["role"] == "assistant" and seen_user and messages[i - 1]["role"] != "assistant":
            points.append(i)
    if messages[-1]["role"] != "assistant" and seen_user:
        points.append(len(messages))
    return points


def rewritten_turns(messages: list[dict], points: list[int], responses: list[str]) -> list[dict]:
    """The turns the model answers at point len(responses): those before it, with the assistant
    turns of each earlier point replaced by the model's own answer there."""
    out, i, k = [], 0, 0
    while i < points[len(responses)]:
        if k < len(responses) and i == points[k]:
            out.append({"role": "assistant", "content": responses[k]})
            i += 1
            while i < len(messages) and messages[i]["role"] == "assistant":
                i += 1
            k += 1
        else:
            out.append(messages[i])
            i += 1
    return out


def kept_images(messages: list[dict], points: list[int], num_answers: int) -> list[int]:
    """Which of a conversation's images (by their order in it) the prompt of its answer
    `num_answers` holds (`rewritten_turns`): those of the turns before that answer point, less the
    assistant turns the model's earlier answers replace."""
    replaced = set()
    for point in points[:num_answers]:
        i = point
        while i < len(messages) and messages[i]["role"] == "assistant":
            replaced.add(i)
            i += 1
    kept, n = [], 0
    for i, m in enumerate(messages[: points[num_answers]]):
        count = sum(p["type"] == "image" for p in m["content"]) if isinstance(m["content"], list) else 0
        if i not in replaced:
            kept.extend(range(n, n + count))
        n += count
    return kept


def first_prompt_images(found: list, turns, renderer, expand, where: str) -> list:
    """The (image, SHA-256) pairs of a row's prompt (`found`: all of the row's). A conversation
    whose every turn the model rewrites (`turns`: its messages and answer points): those of its
    first prompt; its later prompts' images go through the model's processor here too (the last
    prompt, with empty answers, holds every one of them), so that one the processor refuses stops
    the run before the model loads, as any image row's does."""
    if turns is None or not found:
        return found
    messages, points = list(turns[0]), list(turns[1])
    first, last = kept_images(messages, points, 0), len(points) - 1
    later = kept_images(messages, points, last)
    if expand is not None and len(later) > len(first):
        ids = renderer.prompt(messages, where, rewritten_turns(messages, points, [""] * last))
        expanded(ids, None, [found[i] for i in later], expand, where)
    return [found[i] for i in first]


class ChatRenderer:
    """Renders a conversation with the model's chat template into token ids and an assistant mask.

    With {% generation %} markers in the template, the mask is HF's assistant-token mask.
    Without, it is found by prefixes: the assistant turn i spans the characters between the
    rendering of messages[:i] plus the generation prompt, and the rendering of messages[:i+1];
    a template that renders a prefix differently from the start of the whole conversation
    (e.g. one that drops earlier turns' reasoning) is refused. docs/datasets.md says more."""

    def __init__(self, tokenizer, where: str, name: str, template_kwargs: dict | None = None):
        if tokenizer is None:
            raise CorecapError(f"{where}: field {name!r} needs a tokenizer, and the model directory has none")
        if not getattr(tokenizer, "chat_template", None):
            raise CorecapError(
                f"{where}: field {name!r} needs the tokenizer's chat template, and the model directory has none"
            )
        if not getattr(tokenizer, "is_fast", False):
            raise CorecapError(f"{where}: field {name!r} needs a fast tokenizer (tokenizer.json) for its loss mask")
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})  # the template's own switches (e.g. enable_thinking)
        template = tokenizer.chat_template
        self.marked = (_GENERATION_TAG.search(template if isinstance(template, str) else json.dumps(template))
                       is not None)

    def _text(self, messages: list[dict], where: str, add_generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **self.template_kwargs
            )
        except Exception as e:  # jinja2 and the template's own raise_exception raise many types
            raise RowError(where, f"the chat template failed ({type(e).__name__}: {e})",
                           "chat template failed") from None

    def prompt(self, messages: list[dict], where: str, before: list[dict] | None = None) -> np.ndarray:
        """The token ids the model answers: the template over `before` (default: `prompt_turns`),
        with its generation prompt (the start of an assistant turn)."""
        text = self._text(prompt_turns(messages) if before is None else before, where, True)
        return np.asarray(self.tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int64)

    def render(self, messages: list[dict], where: str) -> tuple[np.ndarray, np.ndarray]:
        if self.marked:
            try:
                out = self.tokenizer.apply_chat_template(
                    messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                    add_generation_prompt=False, **self.template_kwargs,
                )
            except Exception as e:  # as in _text
                raise RowError(where, f"the chat template failed ({type(e).__name__}: {e})",
                               "chat template failed") from None
            return np.asarray(out["input_ids"], dtype=np.int64), np.asarray(out["assistant_masks"], dtype=np.uint8)
        full = self._text(messages, where, False)
        enc = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        ids = np.asarray(enc["input_ids"], dtype=np.int64)
        offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
        mask = np.zeros(len(ids), dtype=bool)
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            if i == 0:
                raise RowError(
                    where, "the conversation starts with an assistant turn; without {% generation %} markers "
                    "in the chat template its mask cannot be found", "assistant turn first",
                )
            start = self._text(messages[:i], where, True)
            end = self._text(messages[: i + 1], where, False)
            if not (full.startswith(start) and full.startswith(end) and len(start) <= len(end)):
                # A property of the template, not of this row: skipping would drop data unevenly.
                raise CorecapError(
                    f"{where}: the chat template renders the conversation up to turn {i} differently from the "
                    "start of the whole conversation, so the assistant mask cannot be found by prefixes; add "
                    "{% generation %} markers to the template, or give input_ids and loss_mask"
                )
            mask |= (offsets[:, 0] < len(end)) & (offsets[:, 1] > len(start))
        return ids, mask.astype(np.uint8)
