"""Rewards for the RL tests, named as a user names theirs (rl.rewards = ["tests.rl_rewards:digits"])."""

import math


def digits(prompt: str, response: str, answer: str) -> float:
    """The share of the response's characters that are digits: a signal even a random model's samples vary in."""
    return sum(c.isdigit() for c in response) / max(1, len(response))


def raises(prompt: str, response: str, answer: str) -> float:
    raise ValueError("this reward always fails")


def not_a_number(prompt: str, response: str, answer: str) -> float:
    return math.nan


def chars(prompt: str, response: str, answer: str) -> float:
    """The response's length in characters / 16: varied even among a randomly initialized model's samples."""
    return len(response) / 16
