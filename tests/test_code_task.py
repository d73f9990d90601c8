"""The code task: share-of-tests reward, data-file errors, the sandbox against hostile completions, a short run."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from polyrl.tasks import get_task, sandbox
from polyrl.tasks.code import CodeTask, extract_code, program_for, split_tests
from polyrl.tasks.math import DataFileError

ADD = "def add(a, b):\n"
TESTS = "assert add(1, 2) == 3\nassert add(2, 2) == 4\n"
LIMITS = dict(cpu_seconds=1, wall_seconds=3.0, memory_bytes=256 * 2**20)  # short: the file runs in seconds


def _write(path: Path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _toy_rows(n: int = 30) -> list[dict]:
    """Problems 'def add_i(a, b):' whose tests check a + b + i, with string and list tests."""
    rows = []
    for i in range(n):
        name = f"add_{i}"
        tests = [f"assert {name}({a}, {b}) == {a + b + i}" for a, b in ((1, 2), (3, 4))]
        rows.append({"prompt": f"def {name}(a, b):\n", "tests": tests if i % 2 else "\n".join(tests),
                     "entry_point": name})
    return rows


@pytest.fixture()
def task(tmp_path):
    return CodeTask(_write(tmp_path / "code.jsonl", _toy_rows()), heldout_percent=10, **LIMITS)


def _prompt(task: CodeTask, name: str = "add_0"):
    return next(p for split in ("train", "test") for p in task._pools[split] if p.text.startswith(f"def {name}("))


class Watch:
    """Records every sandbox run's process group and temporary directory."""

    def __init__(self, monkeypatch):
        self.groups, self.dirs = [], []
        popen, mkdtemp = sandbox.subprocess.Popen, sandbox.tempfile.mkdtemp

        def recording_popen(*args, **kwargs):
            proc = popen(*args, **kwargs)
            self.groups.append(proc.pid)  # start_new_session: its group id is its pid
            return proc

        def recording_mkdtemp(*args, **kwargs):
            path = mkdtemp(*args, **kwargs)
            self.dirs.append(path)
            return path

        monkeypatch.setattr(sandbox.subprocess, "Popen", recording_popen)
        monkeypatch.setattr(sandbox.tempfile, "mkdtemp", recording_mkdtemp)

    def left_running(self) -> list[int]:
        """Live processes in any recorded group (scanning /proc: field 5 of stat is the process group)."""
        alive = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) in self.groups and fields[0] != "Z":
                alive.append(int(entry.name))
        return alive


def test_correct_half_and_broken_solutions(task):
    prompt = _prompt(task, "add_0")
    assert task.reward(prompt, "    return a + b\n")[0] == 1.0  # a body continuing the prompt
    assert task.reward(prompt, "Here:\n```python\ndef add_0(a, b):\n    return a + b\n```\n")[0] == 1.0
    reward, info = task.reward(prompt, "    return 3\n")
    assert reward == 0.5 and info["passed"] == 1 and info["total"] == 2
    reward, info = task.reward(prompt, "    return a +\n")
    assert reward == 0.0 and info["status"] == "syntax_error"
    assert task.reward(prompt, "    raise ValueError\n")[0] == 0.0
    assert task.reward(prompt, "x = 1/0\ndef add_0(a, b):\n    return a + b\n")[0] == 0.0  # raises before the tests


def test_tests_split_into_asserts_with_their_setup():
    assert split_tests("import math\nassert math.floor(1.5) == 1\nassert 2 > 1\n") == \
        ["import math\nassert math.floor(1.5) == 1", "assert 2 > 1"]
    assert extract_code("```py\nx = 1\n```") == "x = 1\n" and extract_code("x = 2") == "x = 2"
    assert program_for(ADD, "    return a\n", "add") == ADD + "    return a\n"
    assert program_for(ADD, "def add(a, b):\n    return a\n", "add") == "def add(a, b):\n    return a\n"


@pytest.mark.parametrize("name,completion,status,why", [
    ("loop", "    while True:\n        pass\n", "killed", "SIGXCPU"),  # RLIMIT_CPU (the wall clock on a busy machine)
    ("sleep", "    import time\n    time.sleep(60)\n", "timeout", "wall-clock"),
    ("memory", "    x = []\n    while True:\n        x.append(bytearray(10**7))\n", "ok", "MemoryError"),  # RLIMIT_AS
    ("fork", "    import os\n    while True:\n        os.fork()\n", "ok", "os.fork is not allowed"),
    ("subprocess", "    import subprocess\n    subprocess.run(['sleep', '30'])\n    return a + b\n", "ok",
     "subprocess.Popen is not allowed"),
    ("system", "    import os\n    os.system('sleep 30')\n    return a + b\n", "ok", "os.system is not allowed"),
    ("socket", "    import socket\n    socket.socket().connect(('127.0.0.1', 9))\n    return a + b\n", "ok",
     "socket.__new__ is not allowed"),
])
def test_hostile_completions_score_zero_and_leave_nothing(task, monkeypatch, name, completion, status, why):
    watch = Watch(monkeypatch)
    started = time.perf_counter()
    reward, info = task.reward(_prompt(task), completion)
    if name == "loop" and info["status"] == "timeout":  # on a loaded machine 1 s of CPU can take > 3 s
        status, why = "timeout", "wall-clock"
    assert reward == 0.0 and info["status"] == status, info
    assert why in info.get("failure", "") + info.get("error", ""), info
    assert time.perf_counter() - started < LIMITS["wall_seconds"] + 2
    assert watch.groups and not watch.left_running()
    assert watch.dirs and not any(os.path.exists(d) for d in watch.dirs)


@pytest.mark.parametrize("hack", [
    "import builtins\nbuiltins.exec = lambda *a, **k: None\n",
    "import builtins\n_c = builtins.compile\nbuiltins.compile = lambda s, f, m, *a, **k: _c('pass', f, m)\n",
    "import json\njson.dumps = lambda *a, **k: '{\"test\": 0, \"ok\": true, \"why\": \"\"}'\n",
    "import sys, os\nr = sys.modules['__main__'].report\nr.write('{\"test\": 0, \"ok\": true, \"why\": \"\"}\\n')\n"
    "r.write('{\"done\": true}\\n'); r.flush(); os._exit(0)\n",
])
def test_a_completion_that_replaces_the_runners_builtins_still_fails_its_tests(task, hack):
    """The runner calls exec, compile and json.dumps after the program ran: bound before it, so replacing them from the
    completion does not make a wrong function pass; nor does writing to the report found in the runner's globals."""
    reward, info = task.reward(_prompt(task), hack + "def add_0(a, b):\n    return 0\n")
    assert reward == 0.0 and info["passed"] == 0, info


def test_writes_outside_the_sandbox_are_blocked(task, monkeypatch, tmp_path):
    watch = Watch(monkeypatch)
    target = tmp_path / "escaped.txt"
    for completion in (f"    open({str(target)!r}, 'w').write('x')\n    return a + b\n",
                       f"    import os\n    os.close(os.open({str(target)!r}, os.O_CREAT | os.O_WRONLY))\n"
                       "    return a + b\n",
                       f"    import os\n    os.symlink({str(target)!r}, 'link')\n    open('link', 'w')\n"
                       "    return a + b\n"):
        assert task.reward(_prompt(task), completion)[0] == 0.0
        assert not target.exists()
    inside = "    open('scratch.txt', 'w').write('x')\n    return a + b\n"  # its own directory is writable
    assert task.reward(_prompt(task), inside)[0] == 1.0
    assert not watch.left_running() and not any(os.path.exists(d) for d in watch.dirs)


def test_data_file_errors_name_file_line_and_field(tmp_path):
    cases = [
        ([{"prompt": ADD, "tests": TESTS}, {"tests": TESTS}], "row 2 (line 2) has no prompt ('prompt' is missing"),
        ([{"prompt": ADD}], "row 1 (line 1) has no tests ('tests' is missing)"),
        ([{"prompt": ADD, "tests": "assert add(1,"}], "row 1 (line 1) has tests that are not valid Python"),
        ([{"prompt": ADD, "tests": "x = 1"}], "row 1 (line 1) has tests with no assert statement"),
        # a list entry without an assert passed whatever the completion did (accuracy 1.0 for any model)
        ([{"prompt": ADD, "tests": ["assert add(1, 2) == 3", "x = 1"]}],
         "row 1 (line 1) has test 1 with no assert statement ('x = 1')"),
        ([{"prompt": ADD, "tests": {"a": 1}}], "row 1 (line 1) has a dict in 'tests'"),
        ([{"prompt": ADD, "tests": ["assert )"]}], "row 1 (line 1) has test 0 that is not valid Python"),
        ([{"prompt": ADD, "tests": TESTS, "entry_point": "1x"}], "row 1 (line 1) has entry_point '1x'"),
    ]
    for i, (rows, message) in enumerate(cases):
        path = _write(tmp_path / f"bad{i}.jsonl", rows)
        with pytest.raises(DataFileError) as err:
            CodeTask(path)
        text = str(err.value)
        assert "\n" not in text and text.startswith(f"data_file {path!r}") and message in text, text
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps({"prompt": ADD, "tests": TESTS}) + "\n{oops\n")
    with pytest.raises(DataFileError, match="line 2 is not valid JSON"):
        CodeTask(str(broken))
    with pytest.raises(ValueError, match="task 'code' needs --data-file"):
        get_task("code")


def test_get_task_and_splits(tmp_path):
    path = _write(tmp_path / "code.jsonl", _toy_rows())
    task = get_task("code", data_file=path, heldout_percent=20)
    train, test = task.prompts("train", 40, seed=0), task.prompts("test", 3, seed=0)
    assert {p.id for p in train}.isdisjoint({p.id for p in test})
    assert task.prompts("train", 40, seed=0) == train


def test_cli_trains_two_steps_on_generated_problems(tmp_path):
    from polyrl.cli import main
    from polyrl.tinyhf import build_tiny

    model = build_tiny("llama", tmp_path / "tiny")  # a byte-level BPE tokenizer: the character one lacks "_"
    data = _write(tmp_path / "code.jsonl", _toy_rows())
    run_dir = tmp_path / "run"
    code = main(["train", "--task", "code", "--data-file", data, "--heldout-percent", "20", "--model", str(model),
                 "--method", "grpo", "--steps", "2", "--prompts-per-step", "2", "--group-size", "2",
                 "--max-new-tokens", "6", "--eval-prompts", "2", "--eval-every", "0", "--checkpoint-every", "0",
                 "--log-every", "0", "--no-tensorboard", "--threads", "1",
                 "--reward-funcs", "task,tests.reward_fns:digit_fraction", "--run-dir", str(run_dir)])
    assert code == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in rows if "reward/mean" in r]) == 2
