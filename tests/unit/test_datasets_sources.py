"""Prompt sets from every source a TRL user has one in (JSON Lines, a JSON list, CSV, a real
Parquet file, a real `save_to_disk` folder, a bucket URI, a Hub id through the HF cache), with
columns keeping their types across the wire, and one clear line for each kind of bad input."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from brigade.bucket import open_bucket
from brigade.config import ConfigError
from brigade.datasets import (
    DatasetError,
    eval_prompts,
    load_prompts,
    prompt_value,
    row_columns,
    train_prompts,
)
from brigade.spec_file import build_spec
from brigade.task import check_task
from brigade.v1 import brigade_pb2 as pb

datasets = pytest.importorskip("datasets")

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
ROWS = [
    {"prompt": "What is 2+2?", "answer": 4, "tags": ["easy", "math"], "meta": {"level": 1}, "ok": True},
    {"prompt": "What is 3+4?", "answer": 7, "tags": [], "meta": {"level": 2}, "ok": False},
]


def wire(prompts: list[pb.Prompt]) -> list[pb.Prompt]:
    """Through CreateRunRequest's bytes and back, as the proxy and the workers see them."""
    return list(pb.CreateRunRequest.FromString(pb.CreateRunRequest(prompts=prompts).SerializeToString()).prompts)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_columns_keep_their_types_across_the_wire(tmp_path):
    prompts = wire(load_prompts(str(write_jsonl(tmp_path / "p.jsonl", ROWS))))
    assert [prompt_value(p) for p in prompts] == ["What is 2+2?", "What is 3+4?"]
    assert row_columns(prompts[0]) == {"answer": 4, "tags": ["easy", "math"], "meta": {"level": 1}, "ok": True}
    assert type(row_columns(prompts[1])["answer"]) is int  # not the string '7'


def test_conversational_prompts_and_a_json_list(tmp_path):
    path = tmp_path / "chat.json"
    path.write_text(json.dumps([{"id": "q1", "prompt": CHAT, "answer": "4"}]))
    (p,) = wire(load_prompts(str(path)))
    assert prompt_value(p) == CHAT and p.id == "q1" and p.text == "2+2?"
    assert row_columns(p) == {"id": "q1", "answer": "4"}  # every column, as TRL passes them


def test_parquet_csv_and_prompt_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"question": ["a?", "b?"], "answer": [1, 2], "steps": [[1.5, 2.0], [3.0]]})
    pq.write_table(table, tmp_path / "train.parquet")
    prompts = wire(load_prompts(str(tmp_path / "train.parquet"), prompt_column="question"))
    assert [p.text for p in prompts] == ["a?", "b?"]
    assert row_columns(prompts[1]) == {"answer": 2, "steps": [3.0]}

    (tmp_path / "train.csv").write_text("question,answer\nx?,10\ny?,20\n")
    prompts = load_prompts(str(tmp_path / "train.csv"), prompt_column="question")
    assert [row_columns(p)["answer"] for p in prompts] == [10, 20]


def test_save_to_disk_folder_with_splits(tmp_path):
    folder = tmp_path / "ds"
    datasets.DatasetDict({
        "train": datasets.Dataset.from_list([{"prompt": CHAT, "answer": 4}]),
        "test": datasets.Dataset.from_list([{"prompt": "held out?", "answer": 5}]),
    }).save_to_disk(str(folder))
    spec = build_spec({"dataset": str(folder), "eval_dataset": "", "eval_split": "test"})
    (train,) = wire(train_prompts(spec))
    assert prompt_value(train) == CHAT and row_columns(train) == {"answer": 4}
    (held,) = eval_prompts(spec)
    assert held.text == "held out?" and row_columns(held) == {"answer": 5}
    with pytest.raises(DatasetError, match=r"no split 'validation' \(splits: train, test\); set dataset_split"):
        load_prompts(str(folder), split="validation")

    single = tmp_path / "single"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(single))
    assert row_columns(load_prompts(str(single))[0])["tags"] == ["easy", "math"]


def test_bucket_uri_is_read_through_the_bucket_library(tmp_path, monkeypatch, s3_bucket_url):
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setenv("BRIGADE_CACHE", str(tmp_path / "cache"))
    pq.write_table(pa.table({"prompt": ["from s3"], "answer": [3]}), tmp_path / "p.parquet")

    async def upload():
        async with open_bucket(s3_bucket_url) as b:
            await b.put_new("data/p.parquet", (tmp_path / "p.parquet").read_bytes())

    asyncio.run(upload())
    (p,) = load_prompts(f"{s3_bucket_url}/data/p.parquet")
    assert p.text == "from s3" and row_columns(p) == {"answer": 3}
    assert list((tmp_path / "cache" / "datasets").iterdir())  # mirrored once, into the cache


def test_hub_id_not_cached_on_an_offline_machine(tmp_path, monkeypatch):
    """What an offline machine says about a Hub dataset it never downloaded: the id, why, the fix."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf-hub"))
    with pytest.raises(DatasetError) as e:
        load_prompts("nobody-org/never-downloaded")
    line = str(e.value)
    assert "\n" not in line
    assert "'nobody-org/never-downloaded': offline and not in the Hugging Face cache" in line
    assert "hf download --repo-type dataset nobody-org/never-downloaded" in line


def test_hub_id_is_read_from_the_hf_cache_on_an_offline_machine(tmp_path, monkeypatch):
    """A Hub dataset `datasets` cached earlier (its own cache layout, written here by its own Parquet
    builder under the repo's name and a commit hash), loaded by id with HF_HUB_OFFLINE=1."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets.packaged_modules.parquet.parquet import Parquet

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")
    pq.write_table(pa.table({"prompt": [[{"role": "user", "content": "hub?"}]], "answer": [1]}), tmp_path / "t.parquet")
    builder = Parquet(cache_dir=str(tmp_path / "hf-datasets"), dataset_name="tiny-org___prompts", hash="c" * 40,
                      config_id="default", data_files={"train": str(tmp_path / "t.parquet")})
    builder.download_and_prepare()
    for arrow in Path(builder.cache_dir).glob("tiny-org___prompts-*.arrow"):  # named as a Hub download names it
        arrow.rename(arrow.with_name(arrow.name.replace("tiny-org___", "")))
    (p,) = wire(load_prompts("tiny-org/prompts"))
    assert prompt_value(p) == [{"role": "user", "content": "hub?"}] and row_columns(p) == {"answer": 1}


def test_bad_input_is_one_line_naming_the_dataset_and_the_fix(tmp_path):
    path = str(write_jsonl(tmp_path / "p.jsonl", ROWS))
    with pytest.raises(DatasetError, match=r"no column 'question' \(columns: prompt, answer, tags, meta, ok\); "
                                           r"set prompt_column"):
        load_prompts(path, prompt_column="question")
    with pytest.raises(DatasetError, match=r"row 1: column 'answer' must be a non-empty string or a list"):
        load_prompts(path, prompt_column="answer")
    with pytest.raises(DatasetError, match="a single file is the split 'train', not 'test'"):
        load_prompts(path, split="test")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DatasetError, match=r"split 'train' is empty"):
        load_prompts(str(tmp_path / "empty.jsonl"))
    with pytest.raises(DatasetError, match="no such file or folder"):
        load_prompts(str(tmp_path / "missing.parquet"))


def test_check_task_refuses_before_anything_starts(tmp_path):
    path = str(write_jsonl(tmp_path / "p.jsonl", ROWS))
    spec = build_spec({"dataset": path, "prompt_column": "question", "eval_every": 0,
                       "rewards": [{"function": "no_such_pkg.mod:fn"}]})
    with pytest.raises(ConfigError) as e:
        check_task(spec)
    lines = str(e.value).splitlines()[1:]
    assert len(lines) == 2
    assert "no column 'question'" in lines[0]
    assert lines[1].strip().startswith("rewards[0]: reward function 'no_such_pkg.mod:fn' cannot be imported")
    ok = build_spec({"dataset": path, "eval_every": 0, "rewards": [{"function": "math"}]})
    assert len(check_task(ok)) == 2
