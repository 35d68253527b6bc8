"""Rewards: a number for each completion, from its prompt, its response text and the row's answer.

Built-ins (``rl.rewards`` names them; their sum, weighted by ``rl.reward_weights``, is the reward):

- ``exact_match``: 1 when the response, stripped of surrounding white space, is the answer (stripped);
- ``math``: 1 when the response's final answer, the content of its last ``\\boxed{...}`` or else its last
  number, equals the answer as a number: integers, decimals, fractions ``a/b`` and thousands separators
  are read as exact rationals (``0.5``, ``1/2`` and ``\\frac{1}{2}`` are one value). A documented equivalent
  of math-verify's numeric comparison, without its symbolic algebra (no expressions, sets or units);
- ``format``: 1 when the whole response (stripped) matches ``rl.format_regex``;
- ``module:function``: your own function, imported from the Python path or the folder the command runs in
  (it is code you run, as a recipe's own Python would be):
  ``function(prompt=..., response=..., answer=...)`` with three strings, returning a finite number (or a bool).

A reward that raises, or returns anything but a finite number, stops the run with one line that names
the reward, the prompt (its row) and what went wrong.
"""

from __future__ import annotations

import importlib
import math
import os
import re
import sys
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from fractions import Fraction

from titanctl.config.job_config import RL
from titanctl.errors import ConfigError, DataError
from titanctl.safe_io import visible

BUILT_IN = ("exact_match", "math", "format")


def exact_match(prompt: str, response: str, answer: str) -> float:
    return float(response.strip() == answer.strip())


_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?")
_FRAC = re.compile(r"\\[dt]?frac\{\s*([-+]?\d+)\s*\}\{\s*(\d+)\s*\}")


def number(text: str) -> Fraction | None:
    """The value of a number written as text ('1,024', '-3.50', '7/8', '\\frac{7}{8}'); None if it is none."""
    text = text.strip().strip("$").strip()
    frac = _FRAC.fullmatch(text)
    if frac:
        return Fraction(int(frac.group(1)), int(frac.group(2))) if int(frac.group(2)) else None
    if not _NUMBER.fullmatch(text):
        return None
    numerator, _, denominator = text.replace(",", "").replace(" ", "").partition("/")
    if denominator and not int(denominator):
        return None
    return Fraction(numerator) / (int(denominator) if denominator else 1)


def final_answer(response: str) -> str | None:
    """The content of the last \\boxed{...} (braces balanced), else the last number in the text."""
    at = response.rfind("\\boxed{")
    if at >= 0:
        depth, start = 0, at + len("\\boxed{")
        for i in range(start, len(response)):
            depth += {"{": 1, "}": -1}.get(response[i], 0)
            if depth < 0:
                return response[start:i]
    found = list(_FRAC.finditer(response)) or list(_NUMBER.finditer(response))
    return found[-1].group(0) if found else None


def math_answer(prompt: str, response: str, answer: str) -> float:
    expected, got = number(answer), final_answer(response)
    return float(expected is not None and got is not None and number(got) == expected)


@dataclass(frozen=True)
class Reward:
    name: str
    function: Callable[..., float]
    weight: float


def build_rewards(cfg: RL) -> list[Reward]:
    """The rewards ``rl.rewards`` names, checked (and user functions imported) before anything runs."""
    if not cfg.rewards:
        raise ConfigError("config key 'rl.rewards' is empty; name at least one: exact_match, math, format or "
                          "module:function")
    weights = cfg.reward_weights or [1.0] * len(cfg.rewards)
    if len(weights) != len(cfg.rewards):
        raise ConfigError(f"config key 'rl.reward_weights' has {len(weights)} weights for the {len(cfg.rewards)} "
                          f"rewards of rl.rewards; give one each, or none")
    if "format" in cfg.rewards and not cfg.format_regex:
        raise ConfigError("rl.rewards has format, which needs rl.format_regex (the pattern a response must match)")
    if cfg.format_regex and "format" not in cfg.rewards:
        raise ConfigError(f"config key 'rl.format_regex' = {cfg.format_regex!r} is read by the format reward only, "
                          "and rl.rewards does not have it; add format, or unset it")
    pattern = None
    if cfg.format_regex:
        try:
            pattern = re.compile(cfg.format_regex, re.DOTALL)
        except re.error as e:
            raise ConfigError(f"config key 'rl.format_regex' = {cfg.format_regex!r} is no regular expression: {e}") \
                from None
    rewards = []
    for name, weight in zip(cfg.rewards, weights):
        if name == "exact_match":
            function = exact_match
        elif name == "math":
            function = math_answer
        elif name == "format":
            function = _format(pattern)
        else:
            function = import_reward(name)
        rewards.append(Reward(name, function, weight))
    return rewards


def _format(pattern: re.Pattern) -> Callable[..., float]:
    def format_reward(prompt: str, response: str, answer: str) -> float:
        return float(pattern.fullmatch(response.strip()) is not None)
    return format_reward


def import_reward(name: str) -> Callable[..., float]:
    """``module:function`` imported; anything else is a one-line ConfigError."""
    module_name, sep, attribute = name.partition(":")
    if not sep or not module_name or not attribute:
        raise ConfigError(f"rl.rewards entry {name!r} is not a reward: use {', '.join(BUILT_IN)} or module:function")
    try:
        with _current_folder_importable():
            module = importlib.import_module(module_name)
    except Exception as e:  # the user's module: anything it raises while importing
        raise ConfigError(f"rl.rewards entry {name!r}: cannot import {module_name}: {type(e).__name__}: "
                          f"{_first_line(e)}") from None
    function = module
    for part in attribute.split("."):
        function = getattr(function, part, None)
        if function is None:
            raise ConfigError(f"rl.rewards entry {name!r}: module {module_name} has no {attribute}")
    if not callable(function):
        raise ConfigError(f"rl.rewards entry {name!r}: {attribute} is not a function")
    return function


@contextmanager
def _current_folder_importable():
    """As ``python -m`` would: a module in the folder the command runs in imports too."""
    folder = os.getcwd()
    sys.path.insert(0, folder)
    try:
        yield
    finally:
        sys.path.remove(folder)


def score(rewards: list[Reward], prompt: str, response: str, answer: str, where: str) -> float:
    """The weighted sum of the rewards of one completion; ``where`` names its prompt in errors."""
    total = 0.0
    for reward in rewards:
        try:
            value = reward.function(prompt=prompt, response=response, answer=answer)
        except Exception as e:  # the user's code: whatever it raises is reported, with the prompt
            raise DataError(f"reward {reward.name} raised {type(e).__name__}: {_first_line(e)} on prompt {where} "
                            f"({visible(prompt)[:80]!r})") from None
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise DataError(f"reward {reward.name} returned {visible(repr(value))[:40]}, not a finite number, on "
                            f"prompt {where} ({visible(prompt)[:80]!r})")
        total += reward.weight * float(value)
    return total


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return visible(text.splitlines()[0]) if text else "(no message)"
