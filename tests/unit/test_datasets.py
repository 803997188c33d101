"""Dataset tasks (gsm8k, reasoning_gym, humaneval, verl), their checks, and the user's reward functions."""

from __future__ import annotations

import json
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from services.actions import rewardfn
from services.actions.actions import REGISTRY, humaneval_program
from services.coordinator import datasets
from services.coordinator.tasks import TaskSource, heldout_tasks
from services.coordinator.workflows.episode import to_episode
from shared.kernel.config import RewardSection, TaskConfig
from shared.launcher import precheck
from shared.rlmath import gsm8k, rgym


def test_every_gsm8k_test_reference_parses_to_its_hashes_number():
    lines = (datasets.GSM8K_DIR / "test.jsonl").read_text().splitlines()
    assert len(lines) == 1319
    for line in lines:
        solution = json.loads(line)["answer"]
        raw = solution.rsplit("####", 1)[1].strip().replace(",", "")
        assert gsm8k.reference_answer(solution) == raw, solution[-80:]
        # the reference's own text scores 1.0 against itself
        assert gsm8k.score(solution, gsm8k.reference_answer(solution))[0] == 1.0


EXTRACT = [
    ("The total is 1,234 apples.", "1234"),
    ("She pays $18.", "18"),
    ("She pays $1,000.50 in all", "1000.5"),
    ("It weighs 12 kg.", "12"),
    ("The increase is 25%.", "25"),
    ("So the answer is 18.0", "18"),
    ("x = 3.50", "3.5"),
    ("The answer is 42. Check: 40 + 2 = 42 and 7 more is 49", "42"),
    ("The answer is: 7", "7"),
    ("The answer is **15** dollars", "15"),
    ("work 3 + 4 = 7\n#### 7", "7"),
    ("#### 1,000\nthen 5 more", "1000"),
    ("We get \\boxed{36} in the end, 2 checks", "36"),
    ("\\boxed{-5}", "-5"),
    ("The temperature dropped to -12 degrees.", "-12"),
    ("He is left with -3.", "-3"),
    ("The ratio is 0.25", "0.25"),
    ("Half is .5", "0.5"),
    ("No number here.", None),
    ("", None),
    ("First 10, then 20, finally 30.", "30"),
    ("Total: $ 45", "45"),
    ("#### 12\n\\boxed{13}", "12"),  # #### is preferred over \boxed
    ("The answer is 8 \\boxed{9}", "9"),  # \boxed over "the answer is"
    # thousands separators come in groups of three; anything else is a list of numbers
    ("The digits are 1,2,3", "3"),
    ("Pick from 12,34", "34"),
    ("It costs 1,234,567 in all", "1234567"),
    ("#### 2,500.50", "2500.5"),
    # the Unicode minus sign (and its look-alikes) is a minus
    ("The temperature is \u22125 degrees", "-5"),
    ("#### \u221212", "-12"),
    ("The answer is \uff0d3", "-3"),
]


@pytest.mark.parametrize(("response", "expected"), EXTRACT)
def test_gsm8k_extractor_takes_the_final_answer(response, expected):
    assert gsm8k.extract_answer(response) == expected


def test_gsm8k_score_is_exact_numeric_match():
    assert gsm8k.score("so she makes $18.00.", "18") == (1.0, "18")
    assert gsm8k.score("so she makes 17", "18") == (0.0, "17")
    assert gsm8k.score("no idea", "18") == (0.0, "")
    assert REGISTRY["check_gsm8k"]({"expected": "1000", "response": "#### 1,000"})["reward"] == 1.0


def test_gsm8k_heldout_slice_is_seeded_and_out_of_training():
    cfg = TaskConfig(name="gsm8k", heldout=20)
    held = heldout_tasks(cfg, 20, seed=3)
    assert [t.question for t in held] == [t.question for t in heldout_tasks(cfg, 20, seed=3)]
    src = TaskSource(3, cfg, "p")
    drawn = {src.next()[1].question for _ in range(300)}
    assert not drawn & {t.question for t in held}
    assert all(t.check == "check_gsm8k" and t.question.endswith('after "####".') for t in held)
    test = datasets.dataset_split(cfg, "test")
    assert len(test) == 1319 and test[0].answer == "18"
    assert TaskConfig(name="gsm8k", instruction="").instruction == ""
    assert not datasets.dataset_split(TaskConfig(name="gsm8k", instruction=""), "test")[0].question.endswith('"####".')


def test_run_seeds_draw_independent_held_out_sets_and_training_streams():
    """reasoning-gym builds item i of seed s from Random(s + i): seeds used as they are made run seed s + 1 the
    stream of seed s shifted by one item. Hashed per split, ten seeds share what chance makes them share."""
    cfg = TaskConfig(name="reasoning_gym", dataset="basic_arithmetic",
                     dataset_config={"min_terms": 3, "max_terms": 4, "min_digits": 2, "max_digits": 3}, heldout=200)
    held = [[t.question for t in heldout_tasks(cfg, 200, seed)] for seed in range(10)]
    assert all(len(set(h)) == 200 for h in held)  # distinct questions within a set
    shared = max(len(set(held[a]) & set(held[b])) for a in range(10) for b in range(a + 1, 10))
    assert shared < 2, shared  # under 1% of 200, pairwise
    streams = [[TaskSource(seed, cfg, "p").next()[1].question for _ in range(1)] for seed in range(3)]
    firsts = [TaskSource(seed, cfg, "p") for seed in range(3)]
    heads = [[src.next()[1].question for _ in range(50)] for src in firsts]
    assert not set(heads[0]) & set(heads[1]) and not set(heads[1]) & set(heads[2])
    assert [s[0] for s in streams] == [h[0] for h in heads]  # the stream of a seed is the same every time
    for seed in range(3):  # a seed's training stream never asks a question of its held-out set
        src = TaskSource(seed, cfg, "p")
        assert not {src.next()[1].question for _ in range(300)} & set(held[seed])


def test_a_question_space_smaller_than_the_held_out_set_is_reported_by_chorus_check():
    from shared.kernel.config import ChorusConfig

    # chain_sum of two one-digit terms has 200 questions ("4 - 1 =", ...)
    small = {"name": "reasoning_gym", "dataset": "chain_sum", "heldout": 400,
             "dataset_config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}}
    cfg = ChorusConfig(run={"id": "r"}, models={"m": {}}, agents=AGENTS, task=small)
    problems = precheck.task_problems(cfg)
    assert len(problems) == 1 and "fewer than the 400 held-out ones asked for" in problems[0], problems
    assert "question space is too small" in problems[0]
    assert precheck.task_problems(ChorusConfig(run={"id": "r"}, models={"m": {}}, agents=AGENTS,
                                               task={**small, "heldout": 20})) == []


def test_reasoning_gym_tasks_are_scored_by_the_datasets_own_score_answer():
    cfg = TaskConfig(name="reasoning_gym", dataset="basic_arithmetic", dataset_config={"min_terms": 2,
                     "max_terms": 3}, heldout=5)
    src = TaskSource(7, cfg, "p")
    _, task = src.next()
    ds = rgym.dataset("basic_arithmetic", cfg.dataset_config, rgym.split_seed(7, "train"), cfg.size)
    assert task.meta["seed"] == rgym.split_seed(7, "train")
    entry = ds[task.meta["index"]]
    assert task.answer == str(entry["answer"]) and task.question.startswith(entry["question"])
    for response in (f"<answer>{entry['answer']}</answer>", "<answer>nope</answer>", "no tags"):
        from reasoning_gym.utils import extract_answer
        got = REGISTRY["score_reasoning_gym"]({**task.meta, "response": response, "expected": task.answer})
        assert got["reward"] == ds.score_answer(extract_answer(response), entry)
    assert {t.question for t in heldout_tasks(cfg, 5, 7)}.isdisjoint({src.next()[1].question for _ in range(50)})
    with pytest.raises(ValueError, match="dataset"):
        TaskConfig(name="reasoning_gym")


def test_flexible_answers_score_a_reply_without_tags_on_its_final_answer():
    conf = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    tags, flexible = (TaskSource(7, TaskConfig(name="reasoning_gym", dataset="chain_sum", dataset_config=conf,
                                               answer=a), "p").next()[1] for a in ("tags", "flexible"))
    assert tags.question == flexible.question and "flexible" not in tags.meta
    right = tags.answer
    wrong = str(int(right) + 1)
    for response, as_tags, as_flexible in (
            (f"The answer is {right}.", 0.0, 1.0), (f"The answer is {wrong}.", 0.0, 0.0),
            (f"<answer>{right}</answer>", 1.0, 1.0), (f"{wrong} <answer>{right}</answer> {wrong}", 1.0, 1.0),
            (f"<answer>{wrong}</answer> so {right}", 0.0, 0.0), ("no number", 0.0, 0.0)):
        for task, want in ((tags, as_tags), (flexible, as_flexible)):
            got = REGISTRY["score_reasoning_gym"]({**task.meta, "response": response, "expected": task.answer})
            assert got["reward"] == want, (response, task.meta, got)
    with pytest.raises(ValueError, match="answer: only read"):
        TaskConfig(name="gsm8k", answer="flexible")


def test_humaneval_response_as_a_body_or_as_a_fenced_function():
    p = datasets.humaneval_problems()[0]
    assert len(datasets.humaneval_problems()) == 164
    body = p["canonical_solution"]
    assert humaneval_program(body, p["prompt"], p["entry_point"]) == p["prompt"] + body
    full = f"Here:\n```python\ndef {p['entry_point']}(numbers, threshold):\n    return True\n```\n"
    program = humaneval_program(full, p["prompt"], p["entry_point"])
    assert program.startswith("from typing import List\n") and "return True" in program and '"""' not in program


def _verl_rows():
    return [{"data_source": "openai/gsm8k", "ability": "math",
             "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
             "reward_model": {"style": "rule", "ground_truth": "4"}, "extra_info": {"split": "train", "index": 0}},
            {"data_source": "lighteval/MATH", "ability": "math", "prompt": [{"role": "user", "content": "1/2+1/2?"}],
             "reward_model": {"style": "rule", "ground_truth": "1"}, "extra_info": {"index": 1}}]


def test_verl_parquet_rows_become_tasks(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(_verl_rows()), path)
    tasks = datasets.verl_tasks(TaskConfig(name="verl", path=path))
    assert tasks[0].question == "Be brief.\n\n2+2?" and tasks[0].answer == "4" and tasks[0].check == "check_gsm8k"
    # parquet gives a struct's missing fields as None
    assert tasks[1].check == "check_math" and tasks[1].meta["data_source"] == "lighteval/MATH"
    assert tasks[1].meta["extra_info"]["index"] == 1
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in _verl_rows()))
    assert [t.question for t in datasets.verl_tasks(TaskConfig(name="verl", path=jsonl))] == [t.question for t in tasks]
    with pytest.raises(ValueError, match="ground_truth"):
        jsonl.write_text(json.dumps({"prompt": [{"role": "user", "content": "x"}]}))
        datasets.verl_tasks(TaskConfig(name="verl", path=jsonl))


AGENTS = {"solver": {"model": "m"}, "verifier": {"model": "m"}}


def _routing_rows() -> list[dict]:
    def row(source: str, truth: object, question: str) -> dict:
        return {"data_source": source, "ability": "math", "prompt": [{"role": "user", "content": question}],
                "reward_model": {"style": "rule", "ground_truth": truth}, "extra_info": {"q": question}}

    return [row("lighteval/MATH", "\\frac{1}{2}", "half?"), row("HuggingFaceH4/MATH-500", "(0,1]", "interval?"),
            row("aime_2024", "2\\sqrt{2}", "root?"), row("openai/gsm8k", "#### 1,000", "thousand?"),
            row("openai/gsm8k", 72, "int?")]


def test_verl_rows_are_scored_as_verl_routes_their_data_source(tmp_path):
    from services.coordinator.workflows.scoring import check_request
    from shared.kernel.config import ChorusConfig

    path = tmp_path / "math.parquet"
    pq.write_table(pa.Table.from_pylist(_routing_rows()[:4]), path)  # one column type: the int row goes as JSON
    cfg = ChorusConfig(run={"id": "r"}, models={"m": {}}, agents=AGENTS, task={"name": "verl", "path": str(path)})
    jsonl = tmp_path / "int.jsonl"
    jsonl.write_text(json.dumps(_routing_rows()[4]))
    tasks = datasets.verl_tasks(cfg.task) + datasets.verl_tasks(TaskConfig(name="verl", path=jsonl))
    assert [t.check for t in tasks] == ["check_math"] * 3 + ["check_gsm8k"] * 2
    assert [t.answer for t in tasks][3:] == ["1000", "72"]

    def reward(task, response: str) -> float:
        kind, payload = check_request(cfg, task, response, True)
        return REGISTRY[kind](payload)["reward"]

    # MATH-style rows by math equivalence: the same value written another way earns 1
    assert [reward(tasks[0], r) for r in ("$\\boxed{0.5}$", "$\\boxed{\\frac{2}{4}}$", "$\\boxed{0.4}$")] == [1, 1, 0]
    assert [reward(tasks[1], r) for r in ("$\\boxed{(0, 1]}$", "$\\boxed{[0,1]}$")] == [1, 0]
    assert [reward(tasks[2], r) for r in ("$\\boxed{\\sqrt{8}}$", "$\\boxed{2.83}$")] == [1, 0]
    # GSM8K rows exactly, on the final number: no partial credit, no tolerance
    assert [reward(tasks[3], r) for r in ("so #### 1,000", "#### 1000.0", "#### 999", "#### 1000.5")] == [1, 1, 0, 0]
    assert [reward(tasks[4], r) for r in ("#### 72", "#### 71")] == [1, 0]
    assert precheck.grader_problems(cfg) == []


def test_an_unknown_data_source_without_a_reward_function_is_refused(tmp_path):
    from shared.kernel.config import ChorusConfig

    rows = _routing_rows() + [{**_routing_rows()[0], "data_source": "my/puzzles"},
                              {**_routing_rows()[1], "data_source": "lighteval/MATH",
                               "reward_model": {"style": "rule", "ground_truth": ["1", "one"]}}]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    base = {"run": {"id": "r"}, "models": {"m": {}}, "agents": AGENTS,
            "task": {"name": "verl", "path": str(path)}}
    problems = precheck.grader_problems(ChorusConfig(**base))
    assert len(problems) == 1 and problems[0].startswith("task.path: no built-in grader for data_source ")
    assert "'my/puzzles' (1 rows)" in problems[0] and "ground truth not one answer" in problems[0]
    assert "reward.function" in problems[0]
    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(isinstance(ground_truth, list))\n")
    with_fn = ChorusConfig(**{**base, "reward": {"function": f"{reward}:compute_score"}})
    assert precheck.grader_problems(with_fn) == []
    # the user's function gets the ground truth as the row has it: a list stays a list
    from services.coordinator.workflows.scoring import check_request

    listed = datasets.verl_tasks(with_fn.task)[-1]
    kind, payload = check_request(with_fn, listed, "x", True)
    assert kind == "compute_score" and payload["ground_truth"] == ["1", "one"]
    assert REGISTRY[kind](payload)["reward"] == 1.0


def _payload(fn_file, name="compute_score", **kw):
    return {"function": f"{fn_file}:{name}", "data_source": "d", "solution_str": "s", "ground_truth": "g",
            "extra_info": None, **kw}


def test_reward_function_floats_and_dicts_and_failures(tmp_path):
    f = tmp_path / "reward.py"
    f.write_text("import math\n"
                 "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                 "    return 0.25 if solution_str == 's' else 1\n"
                 "def as_dict(data_source, solution_str, ground_truth, extra_info=None):\n"
                 "    return {'score': 0.5, 'acc': True, 'len': 3, 'note': 'x'}\n"
                 "def raises(*a, **k):\n    raise RuntimeError('boom')\n"
                 "def nan(*a, **k):\n    return math.nan\n"
                 "def text(*a, **k):\n    return '1'\n")
    assert REGISTRY["compute_score"](_payload(f))["reward"] == 0.25
    assert REGISTRY["compute_score"](_payload(f, "as_dict")) == {"reward": 0.5, "correct": False,
                                                                  "scores": {"len": 3.0}}
    for name, reason in (("raises", "raised RuntimeError: boom"), ("nan", "expected a finite number"),
                         ("text", "expected a finite number"), ("missing", "defines no function")):
        with pytest.raises(ValueError, match=reason):
            REGISTRY["compute_score"](_payload(f, name))
    with pytest.raises(ValueError, match="cannot read"):
        rewardfn.load(f"{tmp_path}/nope.py:compute_score")


def test_reward_function_is_resolved_against_the_config_dir_and_checked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "r.py").write_text("def f(*a, **k):\n    return 1.0\n")
    assert RewardSection(function="r.py:f").function == f"{tmp_path / 'r.py'}:f"
    with pytest.raises(ValueError, match="compute_score"):
        RewardSection(function="r.py")


def test_a_sample_whose_reward_failed_is_dropped_with_its_group():
    # to_episode over two rollouts of one agent's turn, one marked reward_error: the group is short, dropped
    from services.coordinator.tasks import Task
    from services.coordinator.workflows.api import GenResult
    from shared.kernel.config import ChorusConfig

    cfg = ChorusConfig.model_validate({
        "models": {"m": {}}, "agents": {"solver": {"model": "m"}, "verifier": {"model": "m"}},
        "workflow": {"group_size": 2}})

    class Ctx:
        def __init__(self) -> None:
            self.generations = [GenResult(ids=[1], logprobs=[0.0], finished=True, version=0, seconds=0.0,
                                          text="a", prompt_ids=[1], agent="solver", gen_id=0)]

    def traj(error):
        meta = {"gen_id": 0, **({"reward_error": error} if error else {})}
        return {"trajectory": [{"turn_id": 0, "agent_name": "solver", "agent_output": "a", "reward": 1.0,
                                "metadata": meta}], "final_reward": 1.0}

    task = Task(task_id="t", question="q", answer="1")
    ep = to_episode(cfg, task, 0, [traj(None), traj("reward.function raised")], [Ctx(), Ctx()], {}, 0.0)
    assert ep.reward_errors == ["reward.function raised"] and ep.samples == [] and ep.dropped_groups == 1
    ep = to_episode(cfg, task, 0, [traj(None), traj(None)], [Ctx(), Ctx()], {}, 0.0)
    assert len(ep.samples) == 2 and not math.isnan(ep.samples[0].reward)
