"""One-line errors for the math task's data files, the held-out split and the accepted formats."""

from __future__ import annotations

import hashlib
import json

import pytest

from polyrl.tasks.math import ANSWER_KEYS, COLUMNS_HELP, QUESTION_KEYS, DataFileError, MathTask


def _bucket(question: str) -> int:
    """The held-out rule's bucket: a row is held out when this is below heldout_percent."""
    return int(hashlib.sha256(question.encode()).hexdigest()[:8], 16) % 100


def _questions(n: int, low: int, high: int) -> list[str]:
    """The first ``n`` questions 'What is i + 1?' whose bucket lies in [low, high)."""
    found = (f"What is {i} + 1?" for i in range(100_000))
    out = [q for q, _ in zip((q for q in found if low <= _bucket(q) < high), range(n))]
    assert len(out) == n
    return out


def _write(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _error(path: str, **kw) -> str:
    """The DataFileError message of loading ``path``: one line that names the file."""
    with pytest.raises(DataFileError) as info:
        MathTask(path, **kw)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"data_file {path!r}"), message
    return message


def test_columns_help_names_every_accepted_column():
    assert all(k in COLUMNS_HELP for k in QUESTION_KEYS + ANSWER_KEYS) and "\n" not in COLUMNS_HELP


def test_empty_and_blank_files_say_what_a_row_needs(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank.jsonl").write_text("\n  \n\r\n\n")
    for name in ("empty.jsonl", "blank.jsonl"):
        message = _error(str(tmp_path / name))
        assert "is empty: it needs one JSON object per line with" in message and COLUMNS_HELP in message


def test_malformed_line_is_reported_with_its_number(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"question": "1+1?", "answer": "2"}\n\n{"question": "2+2?" "answer": "4"}\n')
    message = _error(str(path))
    assert " line 3 is not valid JSON (Expecting ',' delimiter: column 21)" in message


def test_a_line_that_is_not_an_object_is_named(tmp_path):
    path = _write(tmp_path / "list.jsonl", [{"question": "1+1?", "answer": "2"}, ["2+2?", "4"]])
    assert "row 2 (line 2) is an array, not a JSON object" in _error(path)


def test_missing_answer_column_lists_accepted_and_actual_columns(tmp_path):
    path = _write(tmp_path / "cols.jsonl", [{"question": "1+1?", "result": "2"}, {"question": "2+2?", "id": 7}])
    message = _error(path)
    assert "has no answer column (answer, solution or ground_truth); its columns: question, result, id" in message
    assert "has no answer column ('res', set by answer_key)" in _error(path, answer_key="res")


def test_null_or_missing_answer_names_the_row(tmp_path):
    rows = [{"question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(5)]
    rows[3]["answer"] = None
    assert "row 4 (line 4) has no answer ('answer' is null)" in _error(_write(tmp_path / "null.jsonl", rows))
    del rows[3]["answer"]
    assert "row 4 (line 4) has no answer ('answer' is missing)" in _error(_write(tmp_path / "gone.jsonl", rows))


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_a_non_finite_answer_is_refused_with_its_row(tmp_path, value):
    """JSON's NaN and Infinity read as floats: an answer 'nan' no completion can match would train on a reward of 0."""
    path = tmp_path / "nan.jsonl"
    path.write_text("".join(f'{{"question": "q{i}", "answer": {value if i == 2 else i}}}\n' for i in range(5)))
    word = {"NaN": "nan", "Infinity": "inf", "-Infinity": "-inf"}[value]
    assert f"row 3 (line 3) has {word} in 'answer'; the answer must be text or a finite number" in _error(str(path))


def test_a_small_file_with_no_heldout_row_names_the_flag(tmp_path):
    # 9 questions that stay in training up to heldout_percent 50, one held out from 10 % up to its bucket
    questions = _questions(9, 50, 100) + _questions(1, 10, 50)
    path = _write(tmp_path / "small.jsonl", [{"question": q, "answer": "1"} for q in questions])
    message = _error(path, heldout_percent=10)
    assert "has 10 rows: 10 fall in the training split and 0 in the held-out split (heldout_percent = 10" in message
    assert "add rows (about 10 per held-out row) or raise --heldout-percent" in message
    task = MathTask(path, heldout_percent=50)
    assert [p.text.split("\n")[0] for p in task.prompts("test", 1, 0)] == questions[-1:]
    assert len({p.id for p in task.prompts("train", 20, 0)}) == 9


def test_a_file_with_no_training_row_names_the_flag(tmp_path):
    path = _write(tmp_path / "held.jsonl", [{"question": q, "answer": "1"} for q in _questions(3, 0, 20)])
    assert "0 fall in the training split and 3 in the held-out split" in _error(path, heldout_percent=20)
    assert "lower --heldout-percent" in _error(path, heldout_percent=20)


def test_heldout_percent_zero_keeps_every_row_for_training(tmp_path):
    path = _write(tmp_path / "all.jsonl", [{"question": q, "answer": "1"} for q in _questions(3, 0, 20)])
    task = MathTask(path, heldout_percent=0)
    assert len(task.prompts("train", 3, 0)) == 3
    with pytest.raises(DataFileError, match=r"evaluation needs --heldout-percent > 0") as info:
        task.prompts("test", 1, 0)
    assert "\n" not in str(info.value)
    for bad in (-1, 51, 10.0, True):
        with pytest.raises(ValueError, match="from 0 to 50"):
            MathTask(path, heldout_percent=bad)


def test_json_array_and_json_lines_files_load(tmp_path):
    rows = [{"problem": f"What is {i} + {i}?", "solution": str(2 * i)} for i in range(60)]
    (tmp_path / "array.json").write_text(json.dumps(rows, indent=2))
    _write(tmp_path / "lines.json", rows)
    tasks = [MathTask(str(tmp_path / name), heldout_percent=0) for name in ("array.json", "lines.json")]
    assert tasks[0].prompts("train", 60, 0) == tasks[1].prompts("train", 60, 0)
    (tmp_path / "broken.json").write_text('[\n  {"problem": "1+1?", "solution": "2"},\n  {"problem": }\n]')
    assert "line 3 is not valid JSON" in _error(str(tmp_path / "broken.json"))
    (tmp_path / "none.json").write_text("[]")
    assert "is empty" in _error(str(tmp_path / "none.json"))
    (tmp_path / "numbers.json").write_text("[1, 2]")
    assert "row 1 is a number, not a JSON object" in _error(str(tmp_path / "numbers.json"))


def test_parquet_loads_and_an_empty_or_broken_one_is_one_line(tmp_path):
    from datasets import Dataset

    questions = [f"What is {i} + {i}?" for i in range(60)]
    Dataset.from_dict({"prompt": questions, "ground_truth": [2 * i for i in range(60)]}).to_parquet(
        str(tmp_path / "m.parquet"))
    task = MathTask(str(tmp_path / "m.parquet"), heldout_percent=0)
    assert sorted(p.answer for p in task.prompts("train", 60, 0)) == sorted(str(2 * i) for i in range(60))
    Dataset.from_dict({"question": [], "answer": []}).to_parquet(str(tmp_path / "empty.parquet"))
    assert "is empty: it needs one row per problem with" in _error(str(tmp_path / "empty.parquet"))
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all\n" * 4)
    assert "is not a readable Parquet file (" in _error(str(tmp_path / "junk.parquet"))


def test_unreadable_text_and_unknown_suffix_are_one_line(tmp_path):
    (tmp_path / "latin.jsonl").write_bytes('{"question": "caf\xe9", "answer": "1"}\n'.encode("latin-1"))
    assert "is not UTF-8 text" in _error(str(tmp_path / "latin.jsonl"))
    (tmp_path / "m.csv").write_text("question,answer\n1+1?,2\n")
    assert "use a .jsonl, .json or .parquet file" in _error(str(tmp_path / "m.csv"))
