"""Deterministic English-like prompts of given token counts, and greedy continuations compared."""

from __future__ import annotations

import random

NEAR_TIE = 1e-3  # a first differing token is accepted only if the cold run nearly tied it
_SUBJECTS = ("the river", "a small town", "the old engineer", "our neighbour", "the committee",
             "a young teacher", "the city library", "the ship's captain", "a quiet student",
             "the northern road", "the museum", "a travelling painter", "the night train")
_VERBS = ("remembered", "described", "carried", "followed", "opened", "measured", "repaired",
          "visited", "explained", "painted", "counted", "wrote about", "looked for")
_OBJECTS = ("a letter from the coast", "the long winter", "three wooden boxes",
            "the harbour lights", "an unfinished map", "the market square", "a forgotten song",
            "the stone bridge", "a box of photographs", "the evening news", "the first snow",
            "a broken clock")
_TAILS = ("before the rain began", "after a long day", "with great care", "without a word",
          "as the bells rang", "for the second time", "under the grey sky", "near the station",
          "while the others slept", "in the spring of that year", "at the end of the street")


def _sentence(rng: random.Random) -> str:
    s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}."
    return s[0].upper() + s[1:]


def make(count_tokens, lengths: list[int]) -> list[str]:
    """One text per length: its token count (by `count_tokens`) is the length or a few more."""
    out = []
    for i, n in enumerate(lengths):
        rng, words = random.Random(1000 + i), [f"Story {i + 1}:"]
        while count_tokens(" ".join(words)) < n - 24:
            words.append(_sentence(rng))
        tail = _sentence(rng).split()
        while count_tokens(" ".join(words)) < n:
            words.append(tail.pop(0) if tail else (tail := _sentence(rng).split()).pop(0))
        out.append(" ".join(words))
    return out


def compare(cold: dict, got: dict) -> tuple[str, int, float]:
    """Two vLLM choices with logprobs: (identical|near-tie|FAIL, first differing step, max |Δ|)."""
    ct, gt = cold["logprobs"]["tokens"], got["logprobs"]["tokens"]
    ctop, gtop = cold["logprobs"]["top_logprobs"], got["logprobs"]["top_logprobs"]
    worst = 0.0
    for i, (a, b) in enumerate(zip(ct, gt)):
        shared = set(ctop[i]) & set(gtop[i])
        worst = max([worst, *(abs(ctop[i][k] - gtop[i][k]) for k in shared)])
        if a != b:
            tie = b in ctop[i] and abs(ctop[i][a] - ctop[i][b]) <= NEAR_TIE
            return ("near-tie" if tie else "FAIL"), i, worst
    return ("identical" if len(ct) == len(gt) else "FAIL"), -1, worst
