"""benchmarks/gpu_check.py, the one command a CUDA machine runs, smoke-tested on CPU with --quick: one row per
check, each "pass", "FAIL: ..." or "skipped: ...", the exactness rows computed and passing, the table printed."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quick_cpu_run(tmp_path, capfd):
    gpu_check = load_gpu_check()
    out = tmp_path / "g.json"
    assert gpu_check.main(["--device", "cpu", "--quick", "--out", str(out)]) == 0
    printed = capfd.readouterr().out
    assert "| check | device | dtype | result | numbers |" in printed
    report = json.loads(out.read_text())
    assert report["environment"]["torch"] and report["environment"]["transformers"]
    for line in report["table_markdown"].splitlines():
        assert line in printed

    rows = {r["unit"]: r for r in report["rows"]}
    assert list(rows) == gpu_check.plan(True, "cpu")
    assert {u.split(":")[0] for u in rows} == {"exactness", "attention", "compile", "device_map", "speed"}
    assert {u.split(":")[1] for u in rows if u.startswith("attention")} == set(gpu_check.IMPLS)
    for r in rows.values():
        assert r["result"].startswith(("pass", "FAIL", "skipped")), r
        assert "\n" not in r["result"] and r["device"] == "cpu"

    # exactness: the cached decode crossed Memory-Cache segments and matched the recompute
    fp32 = rows["exactness:fp32"]
    assert fp32["result"] == "pass", fp32
    d = fp32["data"]
    assert d["total"] == 16 and d["identical"] == d["total"] and d["prompt"] == 19
    assert math.isfinite(d["max_dlogit"]) and 0 <= d["max_dlogit"] <= 1e-3 and d["max_abs_logit"] > 0
    bf16 = rows["exactness:bf16"]
    assert bf16["result"].startswith("pass") and bf16["data"]["total"] == 16
    assert math.isfinite(bf16["data"]["max_dlogit"])

    for unit in ("attention:eager:fp32", "attention:sdpa:fp32", "attention:sdpa:bf16"):
        assert rows[unit]["result"] == "pass", rows[unit]
        assert rows[unit]["data"]["max_dlogit_padded_vs_alone"] <= rows[unit]["data"]["tol"]
    assert rows["attention:flash_attention_2:bf16"]["result"].startswith("skipped")
    assert rows["device_map:fp32"]["result"].startswith("skipped")

    speed = rows["speed:fp32"]
    assert speed["result"] == "pass", speed
    assert len(speed["data"]["median"]) == 6 and all(v > 0 for v in speed["data"]["median"].values())
    compiled = rows["compile:fp32"]
    if compiled["result"] == "pass":
        assert compiled["data"]["tokens_equal"] and compiled["data"]["decode_compiled"]
    else:
        assert compiled["result"].startswith("skipped"), compiled


def test_crash_reason_is_one_line():
    gpu_check = load_gpu_check()
    stderr = (
        "munmap_chunk(): invalid pointer\nFatal Python error: Aborted\n\n"
        "Thread 0x01 (most recent call first):\n  File \"/x/threading.py\", line 331 in wait\n\n"
        "Current thread 0x02 (most recent call first):\n"
        "  File \"/w/site-packages/torch/nn/functional.py\", line 12 in scaled_dot\n"
        "  File \"/w/benchmarks/gpu_check.py\", line 9 in main\n\nExtension modules: torch._C (total: 1)\n"
    )
    reason = gpu_check.crash_reason(-6, stderr)
    assert reason == ("child process died (signal SIGABRT); munmap_chunk(): invalid pointer; "
                      "in scaled_dot (nn/functional.py:12)")
