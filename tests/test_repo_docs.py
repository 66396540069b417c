"""tests/README.md lists every file of tests/ and tests/gpu/ (test modules, helpers, the device
check), and every file it names (`name.py`, `gpu/name.sh`, `plan/policy.py`, ...) exists."""
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
# where a name in the README may live: this folder, the repository, the package
BASES = (TESTS, ROOT, ROOT / "deepspeed_feplb")
NAMED = re.compile(r"`([\w./*-]+\.(?:py|sh))`")


def files_to_list(tests: Path = TESTS) -> set:
    """Every source file of tests/ and tests/gpu/, relative to tests/ (``gpu/device_check.py``)."""
    found = {p for p in tests.glob("*.py")} | {p for p in (tests / "gpu").glob("*") if p.suffix in (".py", ".sh")}
    return {p.relative_to(tests).as_posix() for p in found}


def problems(readme: str, listed: set, exists) -> list:
    """What is wrong with ``readme``: files of ``listed`` it does not name, and names in it for
    which ``exists(name)`` is false (a glob such as ``test_pipeline*.py`` names no file)."""
    named = set(NAMED.findall(readme))
    out = [f"tests/{name} is not listed in tests/README.md" for name in sorted(listed - named)]
    out += [f"tests/README.md names {name}, which does not exist" for name in sorted(named) if not exists(name)]
    return out


def _exists(name: str) -> bool:
    return "*" not in name and any((base / name).is_file() for base in BASES)


def test_the_readme_lists_every_test_file_and_only_existing_ones():
    found = problems((TESTS / "README.md").read_text(), files_to_list(), _exists)
    assert not found, "\n".join(found)


def test_the_checker_sees_a_missing_and_a_stale_name():
    listed = {"test_a.py", "gpu/test_b.py", "moe_cases.py"}
    readme = "* `test_a.py`: a\n* `moe_cases.py`: helpers\n* `test_gone.py`: removed\n* `test_a*.py`: a glob\n"
    found = problems(readme, listed, lambda name: name in listed)
    assert found == ["tests/gpu/test_b.py is not listed in tests/README.md",
                     "tests/README.md names test_a*.py, which does not exist",
                     "tests/README.md names test_gone.py, which does not exist"]
    assert problems(readme.replace("`test_gone.py`", "`gpu/test_b.py`").replace("`test_a*.py`", "`test_a.py`"),
                    listed, lambda name: name in listed) == []


def test_every_file_of_tests_and_gpu_is_found():
    listed = files_to_list()
    assert {"conftest.py", "moe_cases.py", "test_layout.py", "gpu/conftest.py", "gpu/run_device_checks.sh",
            Path(__file__).name} <= listed
    assert not any(name.startswith("data/") for name in listed)
