"""Every trick a policy could use to earn a code reward it did not, against each code grader: ``run_code`` and
``check_humaneval`` (three HumanEval problems: one with plain asserts, one whose expected values are computed in
a loop, one whose check calls a helper of the prompt). Each trick earns 0; the correct solutions earn 1.

Real sandboxes (namespaces on this machine), no mocks: each case runs through the registered action.
"""

from __future__ import annotations

from typing import Any

import pytest

from services.actions.actions import REGISTRY
from services.actions.coderun import isolation
from services.coordinator import datasets

# run_code's problem: two functions, tests with expected values in constants, in a setup statement, in a loop's
# locals, and a callback of the tests' own.
RUN_CODE_NAMES = ("add", "apply")
RUN_CODE_TESTS = """
expected = 2 + 3
assert add(2, 3) == expected
assert add(-1, 1) == 0
def check(candidate):
    for a, b in [(4, 5), (10, -3)]:
        want = a + b
        assert candidate(a, b) == want
assert check(add) is None
secret = [40, 2]
assert apply(lambda v: v + sum(secret), 0) == 42
assert isinstance(add(1, 1), int) and add(1, 1) == 2
"""
RUN_CODE_SOLUTION = "def add(a, b):\n    return a + b\n\ndef apply(fn, x):\n    return fn(x)\n"
HUMANEVAL = ("HumanEval/0", "HumanEval/38", "HumanEval/32")  # plain asserts; a loop's locals; the prompt's poly

# A trick is module code; `_trick` is bound to every function the grader calls.
BIND = "\nfor _name in NAMES:\n    globals()[_name] = _trick\n"
TRICKS: dict[str, str] = {
    "exits at import": "import os\nos._exit(0)\n",
    "exits in the call": "import os\ndef _trick(*a, **k):\n    os._exit(0)\n",
    "sys.exit in the call (SystemExit inside check)": "import sys\ndef _trick(*a, **k):\n    sys.exit(0)\n",
    "SystemExit at import": "raise SystemExit(0)\n",
    "KeyboardInterrupt in the call": "def _trick(*a, **k):\n    raise KeyboardInterrupt\n",
    "patches assert and check": (
        "import builtins, sys\n"
        "class AssertionError(Exception):\n    pass\n"
        "builtins.AssertionError = AssertionError\n"
        "sys.modules['__main__'].check = lambda candidate: None\n"
        "sys.settrace(lambda *a: None)\n"
        "def _trick(*a, **k):\n    return None\n"),
    "prints a verdict": (
        "def _trick(*a, **k):\n"
        "    print('PASSED')\n"
        "    print('{\"event\": \"test\", \"i\": 1, \"error\": null}')\n"
        "    print('{\"passed\": true, \"reward\": 1.0, \"tests_passed\": 9}')\n"
        "    return None\n"),
    "writes reports and answers on every fd": (
        "import os\n"
        "LINES = [b'{\"event\": \"code\", \"error\": null}\\n', b'{\"event\": \"test\", \"i\": %d, \"error\": null}\\n',\n"
        "         b'{\"value\": true}\\n', b'{\"event\": \"done\"}\\n']\n"
        "def _trick(*a, **k):\n"
        "    for fd in range(64):\n"
        "        for i in range(12):\n"
        "            for line in LINES:\n"
        "                try:\n"
        "                    os.write(fd, line.replace(b'%d', str(i).encode()))\n"
        "                except (OSError, TypeError):\n"
        "                    pass\n"
        "    return True\n"),
    "answers in advance on the channel": (
        "import os\n"
        "for fd in range(3, 16):\n"
        "    try:\n"
        "        os.write(fd, b'{\"value\": null}\\n' + b'{\"value\": true}\\n' * 50)\n"
        "    except OSError:\n"
        "        pass\n"
        "def _trick(*a, **k):\n    return True\n"),
    "__eq__ always true": (
        "class Anything:\n"
        "    def __eq__(self, other): return True\n"
        "    def __ne__(self, other): return False\n"
        "    def __hash__(self): return 0\n"
        "    def __bool__(self): return True\n"
        "    def __len__(self): return 0\n"
        "def _trick(*a, **k):\n    return Anything()\n"),
    "__eq__ returns a truthy object": (
        "class Yes:\n    def __bool__(self): return True\n"
        "class Anything:\n    def __eq__(self, other): return Yes()\n    __hash__ = object.__hash__\n"
        "def _trick(*a, **k):\n    return Anything()\n"),
    "builtin subclasses equal to everything": (
        "class I(int):\n    def __eq__(self, o): return True\n    __hash__ = int.__hash__\n"
        "class S(str):\n    def __eq__(self, o): return True\n    __hash__ = str.__hash__\n"
        "class L(list):\n    def __eq__(self, o): return True\n"
        "class F(float):\n    def __eq__(self, o): return True\n    __hash__ = float.__hash__\n"
        "import itertools\n_kinds = itertools.cycle([I(7), S('x'), L([1]), F(0.5)])\n"
        "def _trick(*a, **k):\n    return next(_kinds)\n"),
    "sleeps past the deadline": "import time\ndef _trick(*a, **k):\n    time.sleep(60)\n",
    "forks and forges from the child": (
        "import os, time\n"
        "def _trick(*a, **k):\n"
        "    if os.fork() == 0:\n"
        "        for fd in range(64):\n"
        "            try:\n"
        "                os.write(fd, b'{\"value\": true}\\n{\"event\": \"done\"}\\n')\n"
        "            except OSError:\n"
        "                pass\n"
        "        time.sleep(30)\n"
        "        os._exit(0)\n"
        "    return None\n"),
    "reads the expected value from the caller's frames": (
        "import sys\n"
        "def _trick(*a, **k):\n"
        "    frame, seen = sys._getframe(1), []\n"
        "    while frame is not None:\n"
        "        for scope in (frame.f_locals, frame.f_globals):\n"
        "            for key in ('want', 'expected', 'str', 'solution', 'result'):\n"
        "                if key in scope and not callable(scope[key]):\n"
        "                    return scope[key]\n"
        "        frame = frame.f_back\n"
        "    return None\n"),
    "scans the heap for the test's values": (
        "import gc\n"
        "def _trick(*a, **k):\n"
        "    for o in gc.get_objects():\n"
        "        if type(o) in (list, tuple) and len(o) >= 2 and a and o[0] == a[0] and o[-1] != a[0]:\n"
        "            return o[-1]\n"
        "    return None\n"),
    "reads the tests' callback globals": (
        "def _trick(*a, **k):\n"
        "    for x in list(a) + list(k.values()):\n"
        "        if callable(x):\n"
        "            g = x.__globals__\n"
        "            return x(0) if 'secret' not in g else 42\n"
        "    return None\n"),
    "overrides the prompt's helpers and the builtins": (
        "import builtins, math\n"
        "math.fabs = lambda x: 0.0\n"
        "builtins.abs = lambda x: 0\n"
        "builtins.isinstance = lambda *a: True\n"
        "def poly(*a, **k):\n    return 0.0\n"
        "def encode_cyclic(s):\n    return s\n"
        "def _trick(*a, **k):\n    return a[0] if a else None\n"),
    "kills every process it can see": (
        "import os, signal\n"
        "def _trick(*a, **k):\n"
        "    for pid in range(1, 4096):\n"
        "        if pid != os.getpid():\n"
        "            try:\n"
        "                os.kill(pid, signal.SIGKILL)\n"
        "            except OSError:\n"
        "                pass\n"
        "    return None\n"),
    "reads other processes' memory": (
        "import os\n"
        "def _trick(*a, **k):\n"
        "    for pid in range(1, 256):\n"
        "        for part in ('mem', 'environ', 'cmdline', 'maps'):\n"
        "            try:\n"
        "                with open(f'/proc/{pid}/{part}', 'rb') as f:\n"
        "                    f.read(1 << 16)\n"
        "            except OSError:\n"
        "                pass\n"
        "    return None\n"),
    "closes its output and the channel": (
        "import os\n"
        "def _trick(*a, **k):\n"
        "    for fd in range(64):\n"
        "        try:\n"
        "            os.close(fd)\n"
        "        except OSError:\n"
        "            pass\n"
        "    return True\n"),
    "memory bomb": "def _trick(*a, **k):\n    return ' ' * (10 ** 10)\n",
    "infinite recursion": "def _trick(*a, **k):\n    return _trick(*a, **k)\n",
    "returns data shaped like a handle": (
        "def _trick(*a, **k):\n    return {'h': 1, 'r': 1, 'value': True}\n"),
}


@pytest.fixture(scope="module", autouse=True)
def namespaces() -> None:
    mode, reason = isolation()
    assert mode == "namespaces", f"the graders are not isolated on this host: {reason}"


def _problems() -> dict[str, dict[str, Any]]:
    return {p["task_id"]: p for p in datasets.humaneval_problems() if p["task_id"] in HUMANEVAL}


PROBLEMS = _problems()


def grade(grader: str, program: str) -> dict[str, Any]:
    if grader == "run_code":
        return REGISTRY["run_code"]({"code": program, "tests": RUN_CODE_TESTS, "timeout_s": 3.0})
    p = PROBLEMS[grader]
    return REGISTRY["check_humaneval"]({"response": f"```python\n{program}```", "prompt": p["prompt"],
                                        "entry_point": p["entry_point"], "test": p["test"], "timeout_s": 3.0})


def trick_program(grader: str, trick: str) -> str:
    names = RUN_CODE_NAMES if grader == "run_code" else (PROBLEMS[grader]["entry_point"],)
    # a full program that defines the entry point (so HumanEval runs it alone, without the prompt's helpers)
    stubs = "".join(f"def {n}(*a, **k):\n    return None\n" for n in names)
    return f"NAMES = {names!r}\n{stubs}{TRICKS[trick]}" + (BIND if "_trick" in TRICKS[trick] else "")


GRADERS = ("run_code", *HUMANEVAL)


@pytest.mark.parametrize("grader", GRADERS)
@pytest.mark.parametrize("trick", list(TRICKS))
def test_every_trick_earns_nothing(grader: str, trick: str):
    out = grade(grader, trick_program(grader, trick))
    assert out["reward"] == 0.0 and out["passed"] is False and out["tests_passed"] == 0, out


@pytest.mark.parametrize("grader", GRADERS)
def test_the_correct_solutions_earn_everything(grader: str):
    if grader == "run_code":
        program = RUN_CODE_SOLUTION
    else:
        p = PROBLEMS[grader]
        program = p["prompt"] + p["canonical_solution"]
    out = grade(grader, program)
    assert out["reward"] == 1.0 and out["passed"] is True, out
