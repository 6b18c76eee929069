"""What a sample's header says of the response the target model wrote for it (`corecap run
--max-tokens`, corecap/generation.py): the sample's input_ids are its prompt, then the response.
"""

from __future__ import annotations

from typing import Any

import msgspec


class Generation(msgspec.Struct, array_like=True, frozen=True, kw_only=True):
    num_prompt: int  # the sample's first num_prompt tokens are the prompt, the rest the response
    num_generated: int
    finish_reason: str  # "eos" (stored), "stop" (a stop string), "length"
    stop: str | None = None  # the stop string that ended it
    seed: int = 0  # the request's sampling seed (from --seed and the key)
    sampling: dict[str, Any] = {}  # the settings in effect, by vLLM's SamplingParams names

    def problem(self, num_tokens: int) -> str | None:
        """What is wrong with it for a sample of `num_tokens` tokens (None: nothing)."""
        if self.num_prompt < 0 or self.num_generated < 0 or self.num_prompt + self.num_generated != num_tokens:
            return (f"generation record has {self.num_prompt} prompt and {self.num_generated} generated tokens, "
                    f"expected them to add up to its {num_tokens} tokens")
        if self.finish_reason not in ("eos", "stop", "length"):
            return f"generation record has finish reason {self.finish_reason!r}, expected eos, stop or length"
        return None
