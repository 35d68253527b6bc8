"""RL rewards (built-ins, a user's module:function, errors that name the prompt) and prompts (rendering,
bad input in one line, a resumable order)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import REPO
from titanctl.config.job_config import RL
from titanctl.config.recipe import load_config
from titanctl.errors import ConfigError, DataError
from titanctl.rl import rewards
from titanctl.rl.prompts import PromptLoader, PromptSet


@pytest.mark.parametrize("response, answer, want", [
    ("85", "85", 1.0), (" 85\n", "85", 1.0), ("85.", "85", 0.0), ("the sum is 85", "85", 0.0),
])
def test_exact_match(response, answer, want):
    assert rewards.exact_match("", response, answer) == want


@pytest.mark.parametrize("response, answer, want", [
    ("The answer is 85.", "85", 1.0), ("so 1,024", "1024", 1.0), ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("x = 3/4 then \\boxed{0.75}", "3/4", 1.0), ("-7", "-7.0", 1.0), ("12 then 13", "12", 0.0),
    ("\\boxed{x + 1}", "1", 0.0), ("no number", "3", 0.0), ("1/0", "1", 0.0), ("85", "not a number", 0.0),
])
def test_math_compares_final_answers_as_numbers(response, answer, want):
    assert rewards.math_answer("", response, answer) == want


def test_rewards_are_weighted_and_summed():
    cfg = RL(rewards=["exact_match", "format"], reward_weights=[1.0, 0.25], format_regex=r"\d+")
    built = rewards.build_rewards(cfg)
    assert rewards.score(built, "p", "85", "85", "row 1") == 1.25
    assert rewards.score(built, "p", "86", "85", "row 1") == 0.25
    assert rewards.score(built, "p", "eighty", "85", "row 1") == 0.0


@pytest.mark.parametrize("cfg, says", [
    (RL(rewards=[]), "'rl.rewards' is empty"),
    (RL(rewards=["exact_match"], reward_weights=[1, 2]), "has 2 weights for the 1 rewards"),
    (RL(rewards=["format"]), "needs rl.format_regex"),
    (RL(format_regex="x"), "is read by the format reward only"),
    (RL(rewards=["format"], format_regex="("), "is no regular expression"),
    (RL(rewards=["exact"]), "is not a reward: use exact_match, math, format or module:function"),
    (RL(rewards=["no_such_module_here:f"]), "cannot import no_such_module_here: ModuleNotFoundError"),
    (RL(rewards=["tests.rl_rewards:missing"]), "module tests.rl_rewards has no missing"),
])
def test_bad_reward_settings_are_one_line(cfg, says):
    with pytest.raises(ConfigError, match=says):
        rewards.build_rewards(cfg)


def test_a_users_reward_in_the_current_folder_imports(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_here.py").write_text("def long(prompt, response, answer):\n    return len(response)\n")
    monkeypatch.chdir(tmp_path)
    (reward,) = rewards.build_rewards(RL(rewards=["my_rewards_here:long"]))
    assert rewards.score([reward], "p", "abc", "a", "row 1") == 3.0


@pytest.mark.parametrize("name, says", [
    ("raises", "reward tests.rl_rewards:raises raised ValueError: this reward always fails on prompt data:3 ('2+2')"),
    ("not_a_number", "reward tests.rl_rewards:not_a_number returned nan, not a finite number, on prompt data:3"),
])
def test_a_reward_that_fails_names_the_prompt(name, says):
    built = rewards.build_rewards(RL(rewards=[f"tests.rl_rewards:{name}"]))
    with pytest.raises(DataError) as e:
        rewards.score(built, "2+2", "4", "4", "data:3")
    assert says in str(e.value) and "\n" not in str(e.value)


# ----------------------------------------------------------------------------- prompts


def write_rows(tmp_path, rows) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_prompts_are_rendered_with_the_chat_template(tmp_path, tok):
    cfg = RL(dataset=write_rows(tmp_path, [{"prompt": "What is 1 + 2?", "answer": 3},
                                           {"prompt": [{"role": "system", "content": "Be brief."},
                                                       {"role": "user", "content": "And 2 + 2?"}], "answer": "4"}]))
    prompts = PromptSet(cfg, tok, seq_len=64)
    first, second = prompts[0], prompts[1]
    assert tok.decode(list(first.ids)).endswith("What is 1 + 2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    assert (first.text, first.answer, second.text, second.answer) == ("What is 1 + 2?", "3", "And 2 + 2?", "4")
    assert "Be brief." in tok.decode(list(second.ids)) and first.where.endswith("prompts.jsonl:1")
    assert tok.special_tokens["<|eot_id|>"] in prompts.stop_tokens


@pytest.mark.parametrize("rows, says", [
    ([{"prompt": "a", "answer": "1"}, {"prompt": "b"}], r"prompts.jsonl:2 has no 'answer' answer \(rl.answer_field; got "
                                                        r"none\): every prompt needs the answer its rewards check"),
    ([{"question": "a", "answer": "1"}], r"prompts.jsonl:1 has no 'prompt' \(rl.prompt_field\)"),
    ([{"prompt": "word " * 80, "answer": "1"}], r"prompts.jsonl:1's prompt has \d+ tokens, and rl.max_response_tokens "
                                                r"= 16 more exceed training.seq_len = 64, the model's positions"),
    ([{"prompt": [{"role": "king", "content": "a"}], "answer": "1"}], r"prompts.jsonl:1 is no prompt the chat "
                                                                      r"template renders: a row with an unknown role"),
    ([], "has no rows"),
])
def test_bad_prompts_are_one_line(tmp_path, tok, rows, says):
    with pytest.raises(DataError, match=says) as e:
        PromptSet(RL(dataset=write_rows(tmp_path, rows)), tok, seq_len=64)[0]  # a long prompt: when rendered
    assert "\n" not in str(e.value)


def test_a_group_of_one_is_refused():
    with pytest.raises(ConfigError, match=r"'rl.group_size' = 1 must be >= 2"):
        load_config(None, ["--rl.group_size", "1"])


def test_the_shipped_task_loads(tok):
    prompts = PromptSet(RL(), tok, seq_len=64)
    assert len(prompts) == 7000 and max(len(prompts[i].ids) for i in range(0, 7000, 97)) <= 64 - 16
    first = prompts[0]
    a, b = first.text.removeprefix("Which is larger, ").removesuffix("?").split(" or ")
    assert first.answer == str(max(int(a), int(b)))


def test_the_grpo_recipe_starts_from_the_task_sft_recipes_output():
    """The two commands of docs/rl.md need no flags: rl's initial load is where the SFT recipe saves."""
    sft = load_config(REPO / "recipes" / "llama3_debug_task_sft.toml", [], command="train")
    grpo = load_config(REPO / "recipes" / "llama3_debug_grpo.toml", [], command="rl")
    assert grpo.checkpoint.initial_load_path == f"{sft.job.dump_folder}/{sft.checkpoint.folder}"
    assert sft.training.dataset == f"chat:{grpo.rl.dataset}" and sft.checkpoint.enable_checkpoint
    assert (sft.model.name, sft.model.flavor, sft.training.seq_len) == (grpo.model.name, grpo.model.flavor,
                                                                        grpo.training.seq_len)


def test_the_prompt_order_is_a_permutation_per_epoch_and_resumes(tok, tmp_path):
    prompts = PromptSet(RL(dataset=write_rows(tmp_path, [{"prompt": str(i), "answer": "0"} for i in range(10)])),
                        tok, seq_len=64)
    loader = PromptLoader(prompts, per_step=4, seed=3, group_size=2)
    steps = [loader.next_step() for _ in range(5)]  # 20 prompts: two epochs
    assert sorted(steps[0] + steps[1] + steps[2][:2]) == list(range(10))
    assert sorted(steps[2][2:] + steps[3] + steps[4]) == list(range(10))
    resumed = PromptLoader(prompts, per_step=4, seed=3, group_size=2)
    resumed.load_state_dict(PromptLoader(prompts, 4, 3, 2).state_dict() | {"taken": 8})
    assert [resumed.next_step() for _ in range(3)] == steps[2:]
    assert PromptLoader(prompts, 4, 4, 2).next_step() != steps[0]  # another seed, another order


@pytest.mark.parametrize("name", ["deepseek_v3", "qwen3_5"])
def test_a_family_without_a_per_head_kv_cache_is_one_line(name):
    from titanctl.models.registry import model_args_from_config
    from titanctl.parallel.layouts.dims import ParallelDims
    from titanctl.rl.layouts import check_rl_layout

    cfg = load_config(None, ["--model.name", name], command="rl")
    args = model_args_from_config(cfg.model, 512, cfg.training.seq_len)
    with pytest.raises(ConfigError, match=rf"model.name = '{name}': titanctl rl samples the families whose every "
                                          "layer keeps a per-head KV cache"):
        check_rl_layout(cfg, ParallelDims.from_config(cfg.parallelism, 1), args)


def test_prompts_are_rendered_when_first_sampled(tmp_path, tok):
    """A prompt past the model's positions is found when a step samples it (not up front); a rendered prompt
    is kept, the same object on every later step."""
    prompts = PromptSet(RL(dataset=write_rows(tmp_path, [{"prompt": "1 + 2?", "answer": "3"},
                                                         {"prompt": "word " * 80, "answer": "1"}])), tok, seq_len=64)
    assert len(prompts) == 2 and prompts[0] is prompts[0]
    with pytest.raises(DataError, match=r"prompts.jsonl:2's prompt has \d+ tokens"):
        prompts[1]
