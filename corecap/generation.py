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
from collections.abc import Callable
from dataclasses import dataclass, field

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


@dataclass
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
            response.num_prompt, len(response.token_ids), response.finish_reason, response.stop_reason, response.seed, settings,
        )

    def line(self) -> str:
        if not self.reasons:
            return ""
        reasons = ", ".join(f"{reason} {n}" for reason, n in sorted(self.reasons.items()))
        return f"{self.num_tokens} tokens in {sum(self.reasons.values())} responses (finished by {reasons})"
