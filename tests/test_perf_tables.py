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
