"""`llmgw bench` as a command: registration, exit statuses, output files, progress, Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from bench_helpers import quick_engine

from llmgw import cli
from llmgw.serving import free_port

ROOT_ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def bench(*args: str) -> int:
    return cli.main(["bench", *args])


def test_the_subcommand_is_registered_and_the_parser_needs_no_aiohttp():
    code = (
        "import sys; from llmgw.cli import build_parser; "
        "args = build_parser().parse_args(['bench', 'http://h:1']); "
        "print(args.target, 'aiohttp' in sys.modules, 'llmgw.services.bench.main' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.split() == ["llmgw.services.bench.main:run", "False", "False"]


def test_help_lists_the_options(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench("--help")
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for option in ("--concurrency", "--rate", "--sessions", "--sweep", "--plot", "exit status"):
        assert option in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["http://h:1", "--prompt-tokens", "zipf:1"], "--prompt-tokens"),
        (["http://h:1", "--turns", "3"], "--turns needs --sessions"),
        (["http://h:1", "--sweep", "-c", "4"], "--sweep chooses the concurrency"),
        (["http://h:1", "--sweep", "--levels", "4,2"], "increasing"),
        (["localhost:8080"], "not an http(s) URL"),
        (["http://h:1", "--band", "gold:0"], "--band"),
        (["http://h:1", "--extra-body", "[1]"], "JSON object"),
        (["http://h:1", "--header", "novalue"], "NAME:VALUE"),
        (["http://h:1", "--max-error-rate", "2"], "--max-error-rate"),
        (["http://h:1", "--requests", "0"], "--requests"),
        (["http://h:1", "--sessions", "0"], "--sessions"),
    ],
)
def test_bad_options_exit_2_naming_the_problem(capsys, args, message):
    assert bench(*args) == 2
    assert message in capsys.readouterr().err


def test_conflicting_load_shapes_are_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench("http://h:1", "-c", "2", "--rate", "3")
    assert exit_info.value.code == 2


def test_plot_without_matplotlib_exits_2_before_sending_anything(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert bench(f"http://127.0.0.1:{free_port()}", "--plot", "out.png") == 2
    assert "pip install 'llmgw[bench]'" in capsys.readouterr().err


def test_an_unreachable_target_exits_1(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    assert bench(url) == 1
    assert "cannot reach" in capsys.readouterr().err
    assert bench(url, "--model", "m", "-n", "3", "-c", "1") == 1
    captured = capsys.readouterr()
    assert "no request succeeded (3 of 3 failed)" in captured.err
    assert "| connection: 3 |" in captured.out and "- connection: Cannot connect" in captured.out


def test_a_run_writes_json_markdown_and_plot(capsys, threaded_engine, tmp_path):
    sim = threaded_engine(quick_engine())
    out = {name: tmp_path / name for name in ("r.json", "r.md", "r.png")}
    code = bench(
        sim.url + "/v1", "-n", "20", "-c", "4", "--output-tokens", "4", "--seed", "7",
        "--extra-body", '{"ignore_eos": true}',
        "--json", str(out["r.json"]), "--markdown", str(out["r.md"]),
        "--plot", str(out["r.png"]), "--progress",
    )  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0
    assert captured.out == out["r.md"].read_text()
    assert "| requests | ok | errors by status | req/s | output tok/s |" in captured.out
    assert "| latency p50 / p90 / p99 | TTFT p50 / p90 / p99 | TPOT p50 / p90 / p99 |" in (
        captured.out
    )
    assert "| all | 20 | 20 | none |" in captured.out
    assert "bench: 20/20 done, 0 in flight, 0 errors" in captured.err
    result = json.loads(out["r.json"].read_text())
    assert result["schema"] == "llmgw.bench/1" and result["kind"] == "run"
    assert result["config"]["model"] == "sim-llama"  # from GET /v1/models
    assert result["config"]["seed"] == 7 and result["config"]["concurrency"] == 4
    assert result["summary"]["ok"] == 20 and result["summary"]["tokens"]["output"] == 80
    assert len(result["requests"]) == 20
    assert all(r["ttft_s"] > 0 and r["error"] is None for r in result["requests"])
    assert out["r.png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_errors_by_status_and_the_max_error_rate(capsys, threaded_engine, tmp_path):
    sim = threaded_engine(quick_engine())
    sim.post("/sim/faults", {"error_rate": 0.5})
    path = tmp_path / "faults.json"
    assert bench(sim.url, "-n", "30", "--json", str(path), "--max-error-rate", "0.1") == 1
    captured = capsys.readouterr()
    errors = json.loads(path.read_text())["summary"]["errors"]
    assert set(errors) == {"500"} and 0 < errors["500"] < 30
    assert f"500: {errors['500']}" in captured.out
    assert "- 500: The server had an error while processing your request" in captured.out
    assert "more than --max-error-rate 0.1" in captured.err
    assert bench(sim.url, "-n", "10") == 0  # some errors, no limit: still a finished run


def test_json_on_stdout(capsys, threaded_engine):
    sim = threaded_engine(quick_engine())
    assert bench(sim.url, "-n", "5", "--no-stream", "--json", "-") == 0
    result = json.loads(capsys.readouterr().out)
    assert result["summary"]["ok"] == 5 and result["summary"]["ttft_s"] is None


def test_a_sweep_prints_the_knee_and_the_recommendation(capsys, threaded_engine, tmp_path):
    sim = threaded_engine(quick_engine(max_num_seqs=2, itl_base=0.02, prefill_base=0.0))
    path = tmp_path / "sweep.json"
    code = bench(
        sim.url, "--sweep", "--max-concurrency", "16", "--no-stream", "--output-tokens", "3",
        "--extra-body", '{"ignore_eos": true}',
        "--prompt-tokens", "16", "--json", str(path), "--plot", str(tmp_path / "sweep.png"),
        # Doubling past the 2 batch slots gains nothing; a short level on a busy host can still
        # show +10-20% by noise, so "flat" here means under +30%.
        "--knee-threshold", "0.3",
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    result = json.loads(path.read_text())
    assert result["kind"] == "sweep"
    # Doubling until throughput stops growing: 1, 2 and 4 at least (4 gains nothing over the
    # knee); on a noisy machine one more level may be needed to see the plateau.
    levels = [level["concurrency"] for level in result["levels"]]
    assert levels[:3] == [1, 2, 4] and levels in ([1, 2, 4], [1, 2, 4, 8]), levels
    rec = result["recommendation"]
    assert rec["knee_concurrency"] == 2 and rec["batch_capacity"] == 2
    assert "Knee at concurrency 2" in out and "2 (knee)" in out
    assert f"  target_waiting: {rec['target_waiting']}\n" in out
    assert "  - weight: 100" in out
    assert (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"


def test_ctrl_c_stops_sending_and_still_writes_the_results(threaded_engine, tmp_path):
    sim = threaded_engine(quick_engine())
    path = tmp_path / "partial.json"
    process = subprocess.Popen(
        [sys.executable, "-m", "llmgw", "bench", sim.url, "--duration", "60", "-c", "2",
         "--progress", "--json", str(path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ROOT_ENV,
    )  # fmt: skip
    try:
        first = process.stderr.readline()  # the first progress line: requests are flowing
        assert "bench:" in first and "done" in first
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == 130
    assert "stopping, waiting for requests in flight" in err
    summary = json.loads(path.read_text())["summary"]
    assert summary["requests"] == summary["ok"] > 0
