"""benchmarks/perf_tables.py renders a bench_speed JSON as docs/performance.md's table, and refuses other JSON."""

from __future__ import annotations

import importlib
import json
from pathlib import Path


def test_perf_tables_renders_rows_targets_and_notes(monkeypatch, tmp_path, capsys):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    tables = importlib.import_module("perf_tables")
    result = {
        "machine": {"cpu": {"avx512_bf16": False, "amx_bf16": False, "l3": "32 MB"}, "torch_threads": 2},
        "settings": {"prompt": 256, "new_tokens": 128, "repeats": 2},
        "table": [
            {"path": "float32 eager, batch 1", "measure": "decode tok/s", "spike_whale": 8.5, "anchor": 13.0,
             "ratio": 0.65, "target": 1.0},
            {"path": "int8 compile_config", "measure": "decode tok/s", "spike_whale": 18.7, "anchor": 9.2,
             "anchor_name": "float32 eager", "ratio": 2.03, "target": 2.0},
        ],
        "notes": {"mc_share_prefill4096_float32": 0.103, "compile_cost_fresh_process": {"first_compiled_step_s": 3.5}},
        "targets": {"mc_share": 0.15, "compile_cost_s": 10},
    }
    path = tmp_path / "speed.json"
    path.write_text(json.dumps(result))
    assert tables.main([str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("CPU: avx512_bf16 False") and "2 threads" in out[0]
    assert "| float32 eager, batch 1 | 8.50 tok/s | 13.00 tok/s | 0.65× | ≥ 1× |" in out
    assert "| int8 compile_config | 18.70 tok/s | 9.20 tok/s (float32 eager) | **2.03×** | ≥ 2× |" in out
    assert "| Memory-Cache share of prefill 4096, float32 | **10.3%** | | | ≤ 15% |" in out
    assert "| first compiled step in a fresh process | **3.5 s** | | | ≤ 10 s |" in out

    other = tmp_path / "other.json"
    other.write_text("[1, 2]")
    assert tables.main([str(other)]) == 1
    assert capsys.readouterr().err.count("\n") == 1


def test_perf_tables_renders_bench_ab_runs_as_one_table(monkeypatch, tmp_path, capsys):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    tables = importlib.import_module("perf_tables")

    def row(old, new, shares):
        return {"old_median_ms": old, "new_median_ms": new, "speed_ratio_of_medians": old / new,
                "paired_median_speed_ratio": 0.99, "pairs_new_faster": 2, "pairs": 5, "equal_ids_share": shares}

    def run(rows, **kw):
        return {"base": "f9f76d9", "head": "abc1234", "dirty": False, "dtype": "float32", "int8": False,
                "accel": "on", "threads": 2, "prompt": 128, "new_tokens": 32, "rounds": 5, "interleave": "generate",
                "load_average": [0.5, 1.5], "torch": "2.13.0", "rows": rows, **kw}

    first = tmp_path / "a.json"
    first.write_text(json.dumps(run({"compiled_b1": row(51.6, 50.6, [1.0] * 5),
                                     "fresh_compiled_step": row(2973.7, 2233.5, [1.0] * 5)},
                                    cpu={"model": "Some CPU", "avx2": True, "avx512f": False})))
    second = tmp_path / "b.json"
    second.write_text(json.dumps(run({"eager_b8": row(190.6, 262.4, [1.0, 0.75])}, int8=True, accel="off",
                                     dirty=True)))
    assert tables.main([str(first), str(second)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (f"{first}: Some CPU (avx2), 2 threads, torch 2.13.0; prompt 128, 32 new tokens, 5 rounds "
                      "(generate); load 0.50 → 1.50")
    assert out[1].startswith(f"{second}: CPU not recorded (flags not recorded)")
    assert "| compiled_b1 | f9f76d9 → abc1234 | float32 | on | 51.6 ms/step | 50.6 ms/step | **1.020×** | 0.990× " \
           "| 2 of 5 | same |" in out
    assert "| fresh_compiled_step | f9f76d9 → abc1234 | float32 | on | 2.97 s | 2.23 s | **1.331×** | 0.990× " \
           "| 2 of 5 | same |" in out
    assert "| eager_b8 | f9f76d9 → abc1234 (dirty) | float32, int8 | off | 190.6 ms/step | 262.4 ms/step | " \
           "0.726× | 0.990× | 2 of 5 | 75.0% equal |" in out

    speed = tmp_path / "speed.json"
    speed.write_text(json.dumps({"table": []}))
    assert tables.main([str(first), str(speed)]) == 1
    assert "only bench_ab.py results" in capsys.readouterr().err
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(run({"eager_b1": {"old_median_ms": 1.0}})))
    assert tables.main([str(broken)]) == 1
    assert capsys.readouterr().err.startswith("perf_tables: not a bench_ab.py result (KeyError")
