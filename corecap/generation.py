"""Generation and capture in one run (`corecap run --max-tokens N`): the target model writes each
sample's response, and the states of every stored token, prompt and response, are captured as
the engine computes them.

A step samples a token and the next step feeds it, computing its states. So corecap decides
itself when a response ends (end of sequence, a stop string, `--max-tokens`) and keeps the
request running one step more, which computes the final token's states: vLLM is asked for one
token more than `--max-tokens` and never stops on its own for an end-of-sequence token. The
token that step samples is dropped and the request is aborted (`Response.take`). The stored
sample is then prompt + response, each token with its states, and a loss mask on the response.

Each request's sampling seed comes from `--seed` and the sample's key (`request_seed`), so a
resumed or repeated run writes the same responses on the same machine and configuration.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from corecap.data.chat import kept_images, rewritten_turns
from corecap.data.media import expanded
from corecap.store.generated import Generation

FINISH_EOS = "eos"  # the model wrote an end-of-sequence token (stored)
FINISH_STOP = "stop"  # a `--stop` string (the token that completed it is stored)
FINISH_LENGTH = "length"  # `--max-tokens` tokens, or the sample reached --max-model-len


def request_seed(seed: int, key: str) -> int:
    """The sampling seed of the sample `key`: stable across processes, machines and resumes."""
    digest = hashlib.blake2b(f"{seed}\0{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # 63 bits: a torch.Generator's seed


@dataclass
class StopRule:
    """When a response ends: its end-of-sequence ids, stop strings and length."""

    eos_token_ids: frozenset[int]
    stop: tuple[str, ...] = ()
    decode: Callable[[list[int]], str] | None = None  # the tokenizer's, for stop strings

    @property
    def window(self) -> int:
        """Tokens decoded to look for a stop string that the newest token completes: at least one
        per character of the longest, and a few more for characters split across tokens."""
        return 2 * max(map(len, self.stop), default=0) + 4


@dataclass(kw_only=True)
class Response:
    """One request's response as its tokens are sampled (corecap/_vllm/engine.py feeds it)."""

    num_prompt: int
    max_tokens: int
    rule: StopRule
    seed: int = 0
    token_ids: list[int] = field(default_factory=list)  # the response: every token here is stored, with its states
    finish_reason: str | None = None
    stop_reason: str | None = None  # the stop string that matched
    done: bool = False  # the final token's states were computed: nothing more to run

    def take(self, new_token_ids) -> bool:
        """The tokens a step sampled for this request; True once the final token was fed (the
        request is then done: the token sampled after it is not part of the response)."""
        for t in new_token_ids:
            if self.finish_reason is not None:
                self.done = True
                return True
            self.token_ids.append(int(t))
            self._check(int(t))
        return False

    def capped(self) -> None:
        """vLLM ended the request itself (the sample reached the model's length): the last
        sampled token was never fed, so it has no states and is not stored."""
        if not self.done:
            if self.token_ids and self.finish_reason is None:
                self.token_ids.pop()
            self.finish_reason = self.finish_reason or FINISH_LENGTH
            self.done = True

    def _check(self, token: int) -> None:
        rule = self.rule
        if token in rule.eos_token_ids:
            self.finish_reason = FINISH_EOS
            return
        if rule.stop:
            text = rule.decode(self.token_ids[-rule.window :])
            matched = next((s for s in rule.stop if s in text), None)
            if matched is not None:
                self.finish_reason, self.stop_reason = FINISH_STOP, matched
                return
        if len(self.token_ids) >= self.max_tokens:
            self.finish_reason = FINISH_LENGTH


class Responses:
    """The responses a run wrote: each one's header record, and their counts for the last line."""

    def __init__(self):
        self.num_tokens = 0
        self.reasons: dict[str, int] = {}

    def record(self, response: Response, settings: dict) -> Generation:
        self.num_tokens += len(response.token_ids)
        self.reasons[response.finish_reason] = self.reasons.get(response.finish_reason, 0) + 1
        return Generation(
            num_prompt=response.num_prompt, num_generated=len(response.token_ids), finish_reason=response.finish_reason,
            stop=response.stop_reason, seed=response.seed, sampling=settings,
        )

    def line(self) -> str:
        if not self.reasons:
            return ""
        reasons = ", ".join(f"{reason} {n}" for reason, n in sorted(self.reasons.items()))
        return f"{self.num_tokens} tokens in {sum(self.reasons.values())} responses (finished by {reasons})"


CAPTURE_BUFFER_BYTES = 4 << 30  # --buffer-gb's default for a capture of given tokens
# --buffer-gb's default with --max-tokens: this share of the memory available at start. The sink
# holds every response in flight whole until it is committed, and a decode step runs as many
# requests as fit: 4 GiB held an 8B model's 1,024 sequences to ~85 at once (docs/benchmarks.md,
# "Generation").
GENERATION_MEMORY_SHARE = 0.4


def buffer_bytes(given: int | None, generate: bool, available: int) -> int:
    """The sink's memory bound (`RunConfig.buffer_bytes`): `given` (--buffer-gb), else 4 GiB, or
    with --max-tokens GENERATION_MEMORY_SHARE of the `available` bytes, at least 4 GiB."""
    if given is not None:
        return given
    if not generate:
        return CAPTURE_BUFFER_BYTES
    return max(CAPTURE_BUFFER_BYTES, int(GENERATION_MEMORY_SHARE * available))


def turn_key(key: str, index: int) -> str:
    """The key of a conversation's answer `index` (0-based) when every turn is rewritten."""
    return f"{key}/turn-{index + 1}"


@dataclass(kw_only=True)
class Turn:
    """One answer of a conversation whose every assistant turn the model rewrites."""

    key: str
    token_ids: np.ndarray  # int32: its prompt, the model's earlier answers in it
    max_tokens: int
    conversation: object  # the data.Sample of the whole conversation
    index: int  # which of its answer points (data/chat.py answer_points)
    answers: list[str]  # the model's answers before this one, as text
    images: tuple = ()  # the images its prompt holds (data.media.ImageRef, in order)
    media: object = None  # with images: what the store keeps of them (store.Media)


class Conversations:
    """`--rewrite-turns all`: every answer of a conversation written in order, each given the
    model's own earlier answers (data/chat.py `rewritten_turns`); each a sample of its own,
    KEY/turn-K, whose prompt shares its prefix with the turn before (stored once with prefix
    caching on). A rerun reads the answers already stored back as text and goes on from the first
    turn not stored. A later turn's prompt is only known once the earlier answers are: one that
    leaves less room than `max_tokens` under `max_len` gets a shorter answer under --overflow
    truncate and otherwise ends its conversation there (counted in `num_cut`).

    A conversation with images keeps them in every prompt that holds their turns: each later
    prompt is rendered with its images' placeholders and expanded by the model's processor
    (`expand`, as the input's prompts were), so it shares its prefix, images included, with the
    turn before (vLLM's block hashes cover the images' content hashes)."""

    def __init__(self, renderer, decode: Callable[[list[int]], str], max_tokens: int, max_len: int, overflow: str,
                 committed, stored_answer: Callable[[str], str], expand=None):
        self.renderer, self.decode, self.max_tokens, self.max_len, self.overflow = (
            renderer, decode, max_tokens, max_len, overflow
        )
        self.expand = expand
        self.committed, self.stored_answer = committed, stored_answer
        self.ready: deque[Turn] = deque()
        self.asked: dict[str, Turn] = {}  # req_id → the turn it answers
        self.num_cut = 0

    def start(self, conversation) -> None:
        """Queue the conversation's first answer not yet stored."""
        answers = []
        for k in range(len(conversation.points)):
            key = turn_key(conversation.key, k)
            if key not in self.committed:
                self._queue(conversation, answers)
                return
            answers.append(self.stored_answer(key))

    def answered(self, req_id: str, response: Response) -> None:
        """A response came: queue the conversation's next answer, given this one."""
        turn = self.asked.pop(req_id, None)
        if turn is not None and turn.index + 1 < len(turn.conversation.points):
            self._queue(turn.conversation, [*turn.answers, self.decode(response.token_ids)])

    def _queue(self, conversation, answers: list[str]) -> None:
        k = len(answers)
        messages, points = list(conversation.messages), list(conversation.points)
        kept = kept_images(messages, points, k) if conversation.images else []
        images = tuple(conversation.images[i] for i in kept)
        if k == 0:  # checked with the input, before the model loaded
            ids, max_tokens, media = conversation.token_ids, conversation.max_tokens, conversation.media
        else:
            before = rewritten_turns(messages, points, answers)
            ids = self.renderer.prompt(None, conversation.where, before)
            # the processor checked these images with the input (data/chat.py first_prompt_images)
            pairs = [(conversation.images[i], conversation.digests[i]) for i in kept]
            ids, _, media = expanded(ids, None, pairs, self.expand, conversation.where)
            ids = ids.astype(np.int32)
            room = self.max_len - len(ids)
            if room < 1 or (room < self.max_tokens and self.overflow != "truncate"):
                self.num_cut += 1
                return
            max_tokens = min(self.max_tokens, room)
        self.ready.append(Turn(
            key=turn_key(conversation.key, k), token_ids=ids, max_tokens=max_tokens, conversation=conversation, index=k,
            answers=answers, images=images, media=media,
        ))

    def line(self) -> str:
        if not self.num_cut:
            return ""
        return (f"{self.num_cut} conversations ended before their last answer: its prompt, the model's earlier "
                f"answers in it, left no room for --max-tokens under --max-len")
