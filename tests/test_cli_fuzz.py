"""The command-line tools on corrupt and wrong-shaped input files: a trace (`simulate`), stats
logs and CSV-monitor folders (`report`) and Megatron router traces (`trace --megatron`), written
valid by the package's own writers and then mutated: bit flips, truncation, dropped keys and
arrays, wrong dtypes and shapes, out-of-range values, 0 steps, counts near 2**62. Each run either
succeeds (a mutation that left the file valid) or ends with exit status 2 and one line on stderr
that names the file; an exception other than SystemExit (a traceback) fails the test. The
commands run in this process: a whole run takes milliseconds."""
import io
import json
import os
import shutil
import struct
import zipfile

import numpy as np
import pytest

from deepspeed_feplb import report
from deepspeed_feplb.__main__ import main
from deepspeed_feplb.integration.monitor import Record, events, summarize
from deepspeed_feplb.trace.format import Trace, load_trace, save_trace
from deepspeed_feplb.trace.generators import no_aux_trace

SEED = 20261204
DATA = os.path.join(os.path.dirname(__file__), "data")
STEPS, LAYERS, RANKS, EXPERTS = 4, 2, 2, 8


def run(argv, capsys) -> tuple[int, str]:
    """(exit status, stderr) of one command run in this process."""
    capsys.readouterr()
    try:
        code = main(argv) or 0
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


def check(argv, path, capsys, valid=None) -> int:
    """Run ``argv`` on the mutated ``path``: exit 0, or exit 2 with one line on stderr naming
    ``path``. ``valid``: the outcome the mutation must have (None: either)."""
    code, err = run(argv, capsys)
    assert "Traceback" not in err, err
    if valid is not False and code == 0:
        return code
    assert valid is not True, f"{path} was refused: {err}"
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and str(path) in lines[0], (code, err)
    return code


def flips(data: bytes, rng, count: int):
    """``count`` copies of ``data`` with one bit flipped each: at random, and in the first and last
    64 bytes (an archive's or file's headers) more often than by chance."""
    ends = [*range(min(64, len(data))), *range(max(0, len(data) - 64), len(data))]
    for n in range(count):
        at = int(rng.choice(ends)) if n % 2 else int(rng.integers(len(data)))
        yield at, data[:at] + bytes([data[at] ^ (1 << int(rng.integers(8)))]) + data[at + 1:]


# ---- traces: simulate --trace ----------------------------------------------------------------


def recorded_arrays() -> dict:
    """The arrays of a trace as a FEPLB run records it (counts, plans, stage times; `trace.format`)."""
    counts = no_aux_trace(STEPS, LAYERS, ranks=RANKS, experts=EXPERTS, tokens_per_rank=64, seed=3).counts
    moves = np.array([[step, layer, 1, 0, 1, 8, step == 1] for step in range(1, STEPS) for layer in range(LAYERS)],
                     np.int64)
    stage = np.full((STEPS, LAYERS, RANKS, 8), np.nan)
    stage[1:] = [30.0, 60.0, 5.0, 1.0, 0.5, 80.0, 20.0, 0.4]
    return {"counts": counts, "top_k": np.int64(2), "hidden": np.int64(64), "ffn_hidden": np.int64(128),
            "source": np.array("fuzz"), "plan_moves": moves, "stage_us": stage}


def simulate_argv(path) -> list:
    return ["simulate", "--trace", str(path), "--ranks-per-node", str(RANKS), "--dynamic-experts", "1",
            "--policies", "vanilla", "--compare-measured", "--no-progress"]


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "trace.npz"
    arrays = recorded_arrays()
    meta = {k: (int(v) if k in ("top_k", "hidden", "ffn_hidden") else v) for k, v in arrays.items() if k != "counts"}
    meta["source"] = str(meta["source"])
    save_trace(path, Trace(arrays["counts"], **meta))
    return path


def test_the_valid_trace_replays(trace_file, capsys):
    assert check(simulate_argv(trace_file), trace_file, capsys, valid=True) == 0
    assert load_trace(trace_file).plan_moves.shape == (6, 7)


def _set(key, value):
    return lambda a: {**a, key: value}


def _drop(*keys):
    return lambda a: {k: v for k, v in a.items() if k not in keys}


def _column(column, value):
    def mutate(a):
        moves = a["plan_moves"].copy()
        moves[2, column] = value
        return {**a, "plan_moves": moves}
    return mutate


def _count(value):
    def mutate(a):
        counts = a["counts"].copy()
        counts[1, 0, 1, 3] = value
        return {**a, "counts": counts}
    return mutate


REFUSED_TRACES = {
    "no counts": _drop("counts"),
    "counts float": lambda a: {**a, "counts": a["counts"].astype(np.float64)},
    "counts 3-D": lambda a: {**a, "counts": a["counts"][0]},
    "0 steps": lambda a: {**a, "counts": a["counts"][:0], "stage_us": a["stage_us"][:0],
                          "plan_moves": a["plan_moves"][:0]},
    "0 steps, no record": lambda a: {"counts": a["counts"][:0]},
    "0 experts": lambda a: {**a, "counts": a["counts"][..., :0]},
    "negative count": _count(-1),
    "count near 2**62": _count(2 ** 62 - 7),
    "count above 2**40": _count(2 ** 40 + 1),
    "top_k array": _set("top_k", np.array([2, 2])),
    "top_k float": _set("top_k", np.float64(2.0)),
    "top_k 0": _set("top_k", np.int64(0)),
    "top_k above the experts": _set("top_k", np.int64(EXPERTS + 1)),
    "hidden 2**40": _set("hidden", np.int64(2 ** 40)),
    "ffn_hidden string": _set("ffn_hidden", np.array("2048")),
    "source array": _set("source", np.array(["a", "b"])),
    "plan_moves (3, 5)": _set("plan_moves", np.zeros((3, 5), np.int64)),
    "plan_moves 1-D": _set("plan_moves", np.zeros(7, np.int64)),
    "plan_moves float": lambda a: {**a, "plan_moves": a["plan_moves"].astype(np.float64)},
    "plan_moves step out of range": _column(0, STEPS),
    "plan_moves layer out of range": _column(1, LAYERS),
    "plan_moves expert out of range": _column(2, EXPERTS),
    "plan_moves home_rank out of range": _column(3, RANKS),
    "plan_moves helper_rank negative": _column(4, -1),
    "plan_moves rows negative": _column(5, -8),
    "plan_moves rows near 2**62": _column(5, 2 ** 62),
    "plan_moves fresh 2": _column(6, 2),
    "stage_us (3, 5)": _set("stage_us", np.zeros((3, 5))),
    "stage_us one rank too many": lambda a: {**a, "stage_us": np.concatenate([a["stage_us"]] * 2, axis=2)[:, :, :3]},
    "stage_us one step short": lambda a: {**a, "stage_us": a["stage_us"][:-1]},
    "stage_us 4 columns": lambda a: {**a, "stage_us": a["stage_us"][..., :4]},
    "stage_us strings": lambda a: {**a, "stage_us": a["stage_us"].astype(str)},
    "object array": _set("counts", np.array([{"a": 1}], dtype=object)),
    "no runtime record": _drop("plan_moves", "stage_us"),  # --compare-measured needs one
}
VALID_TRACES = {
    "no metadata": _drop("top_k", "hidden", "ffn_hidden", "source"),
    "an older record (5 columns)": lambda a: {**a, "stage_us": a["stage_us"][..., :5]},
    "stage_us float32": lambda a: {**a, "stage_us": a["stage_us"].astype(np.float32)},
    "counts int32": lambda a: {**a, "counts": a["counts"].astype(np.int32)},
    "an unknown array": _set("notes", np.arange(3)),
    "counts of 2**40": lambda a: {**a, "counts": np.full_like(a["counts"], 2 ** 40)},
    "all counts 0": lambda a: {**a, "counts": np.zeros_like(a["counts"])},
}


@pytest.mark.parametrize("name", sorted(REFUSED_TRACES) + sorted(VALID_TRACES))
def test_a_malformed_trace_is_refused_in_one_line(tmp_path, capsys, name):
    path = tmp_path / "trace.npz"
    mutate = REFUSED_TRACES.get(name) or VALID_TRACES[name]
    with open(path, "wb") as f:
        np.savez_compressed(f, **mutate(recorded_arrays()))
    check(simulate_argv(path), path, capsys, valid=name in VALID_TRACES)


def array_bytes(data: bytes) -> set:
    """Where the arrays' (compressed) bytes lie in the .npz ``data``: a flip there breaks a CRC-32,
    whereas the archive's other bytes hold much that no reader checks (times, a local copy of the
    sizes, version fields)."""
    positions = set()
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        for info in z.infolist():
            name, extra = struct.unpack("<HH", data[info.header_offset + 26:info.header_offset + 30])
            start = info.header_offset + 30 + name + extra
            positions.update(range(start, start + info.compress_size))
    return positions


def test_a_corrupt_trace_file_is_refused_in_one_line(trace_file, tmp_path, capsys):
    data = trace_file.read_bytes()
    rng = np.random.default_rng(SEED)
    path = tmp_path / "bad.npz"
    cases = [("empty", b"", False), ("garbage", rng.bytes(2000), False), ("text", b"counts: 1 2 3\n", False)]
    cases += [(f"cut to {n} bytes", data[:n], False) for n in sorted(rng.integers(1, len(data), 12))]
    arrays = array_bytes(data)
    cases += [(f"bit {at} flipped", flipped, False if at in arrays else None) for at, flipped in flips(data, rng, 160)]
    stored = io.BytesIO()  # the same arrays uncompressed: flips reach the .npy headers
    with zipfile.ZipFile(trace_file) as src, zipfile.ZipFile(stored, "w", zipfile.ZIP_STORED) as dst:
        for member in src.namelist():
            dst.writestr(member, src.read(member))
    cases += [(f"stored, bit {at} flipped", flipped, None) for at, flipped in flips(stored.getvalue(), rng, 60)]
    np.save(tmp_path / "plain.npy", recorded_arrays()["counts"])
    cases.append(("a .npy array", (tmp_path / "plain.npy").read_bytes(), False))
    for what, content, valid in cases:
        path.write_bytes(content)
        try:
            check(simulate_argv(path), path, capsys, valid=valid)
        except AssertionError as e:
            raise AssertionError(f"{what}: {e}") from None


# ---- stats: report LOG|CSVDIR ----------------------------------------------------------------


def step_summaries() -> list:
    """What `integration.monitor.summarize` makes of four steps of two layers on two ranks."""
    def record(rank, seconds, before, migrated):
        stats = {"ranks": [0, 1], "token_straggler_before": before, "token_straggler_after": 1.0,
                 "migrated_tokens": migrated, "moves": 1, "plan_latency_us": 80.0, "fallback": False}
        return Record(rank, stats, seconds, hidden=8, elem_bytes=4, expert_bytes=1000, training=True)
    return [summarize([{0: {layer: record(rank, 0.002 + 0.001 * rank * step, 6.0 + step, 4 * step)
                            for layer in ("1.moe", "3.moe")}} for rank in range(RANKS)], step=step)
            for step in range(1, STEPS + 1)]


def stats_lines() -> list:
    """The log lines the examples print from those summaries (one JSON object per step), after a
    launcher's lines."""
    lines = ["[launcher] starting 2 ranks", "{'train_batch_size': 8}"]
    for summary in step_summaries():
        step = summary["step"]
        lines.append(json.dumps({"step": step, "loss": 5.0 - step / 2, "step_ms": 40.0 + step, "tokens": 4096,
                                 "layers": summary["layers"]}))
    return lines


def write_csv_dir(folder) -> list:
    """DeepSpeed's CSV monitor's files of the events of those summaries (`monitor.events`)."""
    files = {}
    for summary in step_summaries():
        for name, value, step in events(summary):
            _, layer, metric = name.split("/")
            files.setdefault(f"FEPLB_{layer}_{metric}.csv", [f"step,{metric}"]).append(f"{step},{value}")
    folder.mkdir(parents=True, exist_ok=True)
    for name, lines in files.items():
        (folder / name).write_text("\n".join(lines) + "\n")
    return sorted(folder.iterdir())


@pytest.fixture
def report_argv(tmp_path, monkeypatch):
    """``report INPUT --out DIR``; figures off (summary.json and summary.md only: milliseconds, not
    a second per run), unless ``draw``."""
    def raise_import_error():
        raise ImportError("figures off in this test")

    def argv(path, draw=False):
        if not draw:
            monkeypatch.setattr(report, "pyplot", raise_import_error)
        else:
            monkeypatch.undo()
        return ["report", str(path), "--out", str(tmp_path / "out")]
    return argv


def test_the_valid_stats_report(tmp_path, capsys, report_argv):
    log = tmp_path / "run.log"
    log.write_text("\n".join(stats_lines()) + "\n")
    csv_dir = tmp_path / "csv"
    write_csv_dir(csv_dir / "job")
    assert check(report_argv(log, draw=True), log, capsys, valid=True) == 0
    assert check(report_argv(csv_dir), csv_dir, capsys, valid=True) == 0
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["3.moe"]["migrated_tokens_total"] == 40


def _record(line_no, change):
    """Change the JSON record on line ``line_no`` of the log (``change(record)`` returns it)."""
    def mutate(lines):
        lines = list(lines)
        lines[line_no] = json.dumps(change(json.loads(lines[line_no])))
        return lines
    return mutate


def _metric(key, value, layer="1.moe"):
    return _record(3, lambda r: {**r, "layers": {**r["layers"], layer: {**r["layers"][layer], key: value}}})


def _every(change):
    return lambda lines: [json.dumps(change(json.loads(line))) if line.startswith("{\"") else line for line in lines]


REFUSED_LOGS = {
    "empty": lambda lines: [],
    "only a launcher's lines": lambda lines: lines[:2],
    "a record cut in the middle": lambda lines: lines[:3] + [lines[3][:40]] + lines[4:],
    "step a string": _record(3, lambda r: {**r, "step": "2"}),
    "step a list": _record(3, lambda r: {**r, "step": [2]}),
    "step null": _record(4, lambda r: {**r, "step": None}),
    "step negative": _record(3, lambda r: {**r, "step": -1}),
    "step fractional": _record(3, lambda r: {**r, "step": 1.5}),
    "loss a string": _record(3, lambda r: {**r, "loss": "4.5"}),
    "loss an object": _record(3, lambda r: {**r, "loss": {"value": 4.5}}),
    "loss beyond a float": _record(3, lambda r: {**r, "loss": 10 ** 400}),
    "step_ms negative": _record(3, lambda r: {**r, "step_ms": -3.0}),
    "tokens a string": _record(3, lambda r: {**r, "tokens": "4096"}),
    "layers a list": _record(3, lambda r: {**r, "layers": [r["layers"]]}),
    "a layer a list": _record(3, lambda r: {**r, "layers": {"1.moe": [1.0]}}),
    "a metric a string": _metric("gemm_straggler_ms", "1.5"),
    "a metric NaN": _metric("gemm_straggler_ms", float("nan")),
    "a metric inf": _metric("plan_latency_us", float("inf")),
    "a metric beyond a float": _metric("migrated_bytes", 10 ** 400),
    "rows near 2**62": _metric("migrated_tokens", 2 ** 62),
    "rows negative": _metric("migrated_tokens", -4),
    "a straggler near 2**62": _metric("token_straggler_before", 2.0 ** 62),
    "no step key": _every(lambda r: {k: v for k, v in r.items() if k != "step"}),
    "no layers key": _every(lambda r: {k: v for k, v in r.items() if k != "layers"}),
    "binary garbage": lambda lines: [bytes(np.random.default_rng(SEED).integers(0, 256, 3000, np.uint8)).decode(
        "latin-1")],
}
VALID_LOGS = {
    "the last record cut (a run still writing)": lambda lines: lines[:-1] + [lines[-1][:50]],
    "no loss, step_ms or tokens": _every(lambda r: {k: v for k, v in r.items() if k in ("step", "layers")}),
    "loss NaN (a diverged run)": _record(3, lambda r: {**r, "loss": float("nan")}),
    "null values": _record(3, lambda r: {**r, "loss": None, "tokens": None}),
    "unknown keys and metrics": _metric("new_metric", 3),
    "blank lines": lambda lines: [x for line in lines for x in (line, "")],
    "step 0": _record(2, lambda r: {**r, "step": 0}),
}


@pytest.mark.parametrize("name", sorted(REFUSED_LOGS) + sorted(VALID_LOGS))
def test_a_malformed_stats_log_is_refused_in_one_line(tmp_path, capsys, report_argv, name):
    log = tmp_path / "run.log"
    mutate = REFUSED_LOGS.get(name) or VALID_LOGS[name]
    log.write_text("\n".join(mutate(stats_lines())) + "\n", encoding="latin-1" if "garbage" in name else "utf-8")
    check(report_argv(log), log, capsys, valid=name in VALID_LOGS)


def test_a_corrupt_stats_log_is_refused_in_one_line(tmp_path, capsys, report_argv):
    data = ("\n".join(stats_lines()) + "\n").encode()
    rng = np.random.default_rng(SEED + 1)
    log = tmp_path / "run.log"
    cases = [(f"cut to {n} bytes", data[:n]) for n in sorted(rng.integers(1, len(data), 12))]
    cases += [(f"bit {at} flipped", flipped) for at, flipped in flips(data, rng, 80)]
    for what, content in cases:
        log.write_bytes(content)
        try:
            check(report_argv(log), log, capsys)
        except AssertionError as e:
            raise AssertionError(f"{what}: {e}") from None


CSV_REFUSED = {
    "one field": "1",
    "three fields": "1,2.0,3",
    "not a number": "1,fast",
    "an empty value": "1,",
    "step fractional": "1.5,2.0",
    "step negative": "-1,2.0",
    "step NaN": "nan,2.0",
    "value inf": "2,inf",
    "value NaN": "2,nan",
    "value beyond a float": "2,1e400",
}


@pytest.mark.parametrize("name", sorted(CSV_REFUSED) + ["rows near 2**62", "binary garbage", "no CSV file"])
def test_a_malformed_csv_monitor_file_is_refused_in_one_line(tmp_path, capsys, report_argv, name):
    folder = tmp_path / "csv"
    files = write_csv_dir(folder / "job")
    target = next(p for p in files if p.name.endswith("_gemm_straggler_ms.csv"))
    if name in CSV_REFUSED:
        target.write_text(target.read_text() + CSV_REFUSED[name] + "\n")
    elif name == "rows near 2**62":
        target = next(p for p in files if p.name.endswith("_migrated_tokens.csv"))
        target.write_text(target.read_text() + f"9,{2 ** 62}\n")
    elif name == "binary garbage":
        target.write_bytes(np.random.default_rng(SEED).bytes(3000))
    else:
        shutil.rmtree(folder / "job")
        (folder / "job").mkdir()
        (folder / "job" / "notes.txt").write_text("no stats here\n")
        target = folder
    check(report_argv(folder), target, capsys, valid=False)


def test_a_corrupt_csv_monitor_file_is_refused_in_one_line(tmp_path, capsys, report_argv):
    folder = tmp_path / "csv"
    files = write_csv_dir(folder / "job")
    rng = np.random.default_rng(SEED + 2)
    for target in (files[0], files[len(files) // 2]):
        data = target.read_bytes()
        cases = [(f"cut to {n} bytes", data[:n]) for n in sorted(rng.integers(0, len(data), 4))]
        cases += [(f"bit {at} flipped", flipped) for at, flipped in flips(data, rng, 20)]
        for what, content in cases:
            target.write_bytes(content)
            try:
                check(report_argv(folder), target, capsys)
            except AssertionError as e:
                raise AssertionError(f"{target.name}, {what}: {e}") from None
        target.write_bytes(data)


# ---- Megatron router traces: trace --megatron ----------------------------------------------------


def test_a_corrupt_megatron_router_trace_is_refused_in_one_line(tmp_path, capsys):
    shipped = os.path.join(DATA, "megatron_router_trace", "router_trace_rank0.jsonl")
    with open(shipped, "rb") as f:
        data = f.read()
    rng = np.random.default_rng(SEED + 3)
    path = tmp_path / "router_trace_rank0.jsonl"
    out = tmp_path / "t.npz"
    argv = ["trace", "--megatron", str(path), "--out", str(out)]
    path.write_bytes(data)
    assert check(argv, path, capsys, valid=True) == 0
    record = json.loads(data.splitlines()[0])
    cases = [("empty", b"", False), ("garbage", rng.bytes(700), False)]
    cases += [(f"{key} {value!r}", json.dumps({**record, key: value}).encode(), False) for key, value in (
        ("step", "x"), ("layer", None), ("rank", [0]), ("top_indices", [[0, 1], [2]]), ("top_indices", [[-1, 2]]),
        ("top_indices", [[2 ** 40, 1]]), ("topk", "two"), ("mtp_idx", "x"))]
    cases += [(f"cut to {n} bytes", data[:n], None) for n in sorted(rng.integers(1, len(data), 6))]
    cases += [(f"bit {at} flipped", flipped, None) for at, flipped in flips(data, rng, 40)]
    for what, content, valid in cases:
        path.write_bytes(content)
        try:
            check(argv, path, capsys, valid=valid)
        except AssertionError as e:
            raise AssertionError(f"{what}: {e}") from None
