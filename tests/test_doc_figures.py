"""Every figure a doc quotes from a file in benchmarks/data equals that file.

A doc marks a quoted figure with an HTML comment right after it (GitHub and most renderers hide it):

    DeepSpeed's MoE 26.7 ms<!-- h200_device_checks_grouped_bf16.json: stages.layer_speed.deepspeed_moe_ms -->
    median 6.7%<!-- cpu_model_parity.json: cases.ranks2-hidden128-tokens1024.recorded_costs.median_abs_rel_error % -->
    41.9 ms<!-- h200_launch_budget.json: variants.grouped, balanced.host_us_median_slower_rank /1000 -->

* the file is a JSON file of benchmarks/data; the path goes down its objects by key and its lists
  by index, dot-separated (``stages.syncs.per_rank.0.forward``); a key that itself holds dots or
  spaces is written as it is (``simulate.stdlib_moe_ep8_4k.npz h200.feplb.expert_time_us``): the
  longest key the rest of the path starts with is taken;
* an optional last word scales the JSON value before the comparison: ``%`` (a fraction quoted as a
  percentage: x 100), ``*K`` or ``/K`` (units: ``/1000`` for µs quoted in ms);
* the figure is the number right before the comment (units, ``%``, ``x`` or ``**`` may sit in
  between, no other digit); ``2,522``, ``+3.0``, ``−5.6`` (a minus sign) and ``2.5e-7`` read as
  numbers;
* it must equal the value at the precision printed: ``12.3`` matches 12.34 and 12.25 but not 12.4
  (within half a unit of its last digit); an integer in the JSON must be quoted exactly.

A marker whose file, path or number is missing fails as a wrong figure does.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "benchmarks" / "data"
DOCS = sorted([*ROOT.glob("docs/*.md"), *ROOT.glob("benchmarks/*.md"), ROOT / "README.md"])

MARKER = re.compile(r"<!--\s*([\w.-]+\.json):\s*(.*?)\s*-->")
SCALE = re.compile(r"^(.*\S)\s+(%|[*/]\d+(?:\.\d+)?)$")
# the number that ends the text before a marker: sign, digits (thousands by commas), decimals, exponent,
# then at most 10 characters of unit or emphasis that hold no digit
FIGURE = re.compile(r"(?<![\w.,])([+\-\u2212]?)(\d{1,3}(?:,\d{3})+|\d+)(?:\.(\d+))?(?:e([+\-\u2212]?\d+))?"
                    r"[^\d\n<>|]{0,10}$")


def resolve(data, path: str):
    """The value at ``path`` (keys and list indices, dot-separated) in ``data``; KeyError naming
    the part of the path that matches nothing."""
    rest, node = path, data
    while rest:
        if isinstance(node, dict):
            keys = [k for k in node if rest == k or rest.startswith(k + ".")]
            if not keys:
                raise KeyError(f"no key for {rest!r}")
            key = max(keys, key=len)
        elif isinstance(node, list):
            key, _, _ = rest.partition(".")
            if not key.isdigit() or int(key) >= len(node):
                raise KeyError(f"no index {key!r} in a list of {len(node)}")
        else:
            raise KeyError(f"{rest!r} goes below a {type(node).__name__}")
        node = node[key] if isinstance(node, dict) else node[int(key)]
        rest = rest[len(key) + 1:]
    return node


def markers(text: str):
    """(line number, quoted text before the marker, file, path) of every marker in ``text``."""
    for number, line in enumerate(text.splitlines(), 1):
        for m in MARKER.finditer(line):
            start = max((p.end() for p in MARKER.finditer(line, 0, m.start())), default=0)
            yield number, line[start:m.start()], m.group(1), m.group(2)


def problem(before: str, name: str, path: str, data_dir: Path = DATA) -> str | None:
    """Why the figure at the end of ``before`` does not equal ``name``'s value at ``path``; None if it does."""
    file = data_dir / name
    if not file.is_file():
        return f"{name} is not a file of {data_dir.name}/"
    scaled = SCALE.match(path)
    factor = 1.0
    if scaled:
        path, word = scaled.groups()
        factor = 100.0 if word == "%" else float(word[1:]) ** (1 if word[0] == "*" else -1)
    try:
        value = resolve(json.loads(file.read_text()), path)
    except KeyError as e:
        return f"{name}: {path}: {e.args[0]}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{name}: {path} holds {value!r}, not a number"
    m = FIGURE.search(before)
    if not m:
        return f"no number right before the marker of {name}: {path}"
    sign, whole, decimals, exponent = m.groups()
    quoted = float(whole.replace(",", "") + ("." + decimals if decimals else ""))
    places = len(decimals or "")
    if exponent:
        power = int(exponent.replace("\u2212", "-"))
        quoted, places = quoted * 10.0 ** power, places - power
    quoted = -quoted if sign in ("-", "\u2212") else quoted
    expected = value * factor
    if isinstance(value, int) and factor == 1.0 and not decimals and not exponent:
        ok = quoted == value
    else:
        ok = abs(quoted - expected) <= 0.5 * 10.0 ** -places * (1 + 1e-9) + 1e-12 * abs(expected)
    if ok:
        return None
    shown = m.group(0).strip()
    return f"{shown} quotes {name}: {path}, which is {expected:.6g}"


def check(text: str, data_dir: Path = DATA) -> tuple[int, list[str]]:
    """(markers found, one line per wrong or unresolvable figure) for a doc's ``text``."""
    found, out = 0, []
    for number, before, name, path in markers(text):
        found += 1
        why = problem(before, name, path, data_dir)
        if why:
            out.append(f"line {number}: {why}")
    return found, out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_quoted_figure_equals_its_json(doc):
    _, problems = check(doc.read_text())
    assert not problems, f"{doc.relative_to(ROOT)}:\n" + "\n".join(problems)


def test_the_docs_mark_their_figures():
    counts = {doc.relative_to(ROOT).as_posix(): check(doc.read_text())[0] for doc in DOCS}
    for doc in ("benchmarks/PLANNER.md", "docs/GPU.md", "benchmarks/GPU.md", "benchmarks/LAYER.md"):
        assert counts[doc] > 0, f"{doc} marks no figure from benchmarks/data"


def test_the_checker_catches_wrong_figures(tmp_path):
    """The checker is real: right figures pass, and a wrong figure, a missing file or path, a
    marker without a number each fail."""
    (tmp_path / "t.json").write_text(json.dumps({
        "a": {"b": 12.34, "n": 7, "half": 12.25, "f": -0.0561, "big": 19155.06, "e": 2.5047e-07,
              "us": 41918.5, "flag": True},
        "l": [1.5, {"v": 2}],
        "x.npz h200": {"feplb": {"t": 2522.26}},
        "x.npz": {"other": 1}}))

    def wrong(text):
        return check(text, tmp_path)[1]

    right = ["12.3<!-- t.json: a.b -->", "**12**<!-- t.json: a.b -->", "7<!-- t.json: a.n -->",
             "12.2 and 12.3<!-- t.json: a.half -->", "(−5.6%)<!-- t.json: a.f % -->",
             "-5.61%<!-- t.json: a.f % -->", "19,155 µs<!-- t.json: a.big -->", "2.5e-7<!-- t.json: a.e -->",
             "41.9 ms<!-- t.json: a.us /1000 -->", "| 1.5x<!-- t.json: l.0 --> | 2<!-- t.json: l.1.v --> |",
             "2,522<!-- t.json: x.npz h200.feplb.t -->", "1<!-- t.json: x.npz.other -->"]
    for text in right:
        assert check(text, tmp_path) == (text.count("<!--"), []), text
    assert wrong("12.4<!-- t.json: a.b -->") and wrong("12.35<!-- t.json: a.b -->")
    assert wrong("7.4<!-- t.json: a.n -->") and wrong("8<!-- t.json: a.n -->")
    assert wrong("5.6%<!-- t.json: a.f % -->"), "a sign is part of the figure"
    assert wrong("(-5.6%)<!-- t.json: a.f -->"), "a fraction quoted as a percentage needs its %"
    assert wrong("19,156<!-- t.json: a.big -->") and wrong("2.6e-7<!-- t.json: a.e -->")
    assert wrong("41.8 ms<!-- t.json: a.us /1000 -->")
    assert "not a file" in wrong("12.3<!-- nope.json: a.b -->")[0]
    assert "no key" in wrong("12.3<!-- t.json: a.c -->")[0]
    assert "no index" in wrong("1.5<!-- t.json: l.2 -->")[0]
    assert "not a number" in wrong("1<!-- t.json: a.flag -->")[0]
    assert "no number" in wrong("about<!-- t.json: a.b -->")[0]
    assert "no number" in wrong("12.3 and then more than ten characters<!-- t.json: a.b -->")[0]
    # a synthetic doc: one right figure, one wrong one in a table, reported with its line
    doc = "# Doc\n\n| case | time |\n|---|---:|\n| a | 12.3<!-- t.json: a.b --> |\n| b | 12.9<!-- t.json: a.b --> |\n"
    found, problems = check(doc, tmp_path)
    assert found == 2 and len(problems) == 1 and problems[0].startswith("line 6: 12.9 quotes t.json: a.b")
