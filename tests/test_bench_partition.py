"""peagle.evaluation.bench_partition (behind benchmarks/bench_partition.py): the memory guard's predictions and skips
and the markdown table (pure functions on synthetic rows), one point measured in this process, and one tiny run of
the script (behaviour only: nothing here is timed or compared by speed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from peagle.evaluation import bench_partition as bp

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_partition.py"
DEFAULT_HEAD_CONFIG = ROOT / bp.SHIPPED_HEAD_CONFIG


def _row(length, s, mib, step=1.0, **extra):
    return {"length": length, "partitions": s, "peak_mem_mib": mib, "step_s": step, **extra}


# ------------------------------------------------------------------------------------------ predictions


def test_extrapolate_without_points_and_from_one():
    assert bp.extrapolate([], 1000) is None
    assert bp.extrapolate([(1000, 100.0)], 2000) == pytest.approx(400.0)  # quadratic: the worst case
    assert bp.extrapolate([(1000, 100.0)], 2000, single_exponent=1.0) == pytest.approx(200.0)
    assert bp.extrapolate([(1000, 100.0)], 500) == 100.0  # never below the value measured


def test_extrapolate_two_points_takes_the_larger_of_linear_and_power_law():
    assert bp.extrapolate([(1000, 100.0), (2000, 200.0)], 4000) == pytest.approx(400.0)
    assert bp.extrapolate([(1000, 100.0), (2000, 400.0)], 4000) == pytest.approx(1600.0)  # L^2
    # an offset: the linear extrapolation (200 + 100/1000 * 2000) is above the power law (exponent 0.58)
    assert bp.extrapolate([(1000, 100.0), (2000, 150.0)], 4000) == pytest.approx(250.0)
    # a noisy exponent (6.6) is capped at 2
    assert bp.extrapolate([(1000, 10.0), (2000, 1000.0)], 4000) == pytest.approx(4000.0)
    assert bp.extrapolate([(1000, 100.0), (2000, 90.0)], 4000) == pytest.approx(90.0)  # floor: the last value
    # only the last two points count below three points; the order of the input does not matter
    assert bp.extrapolate([(2000, 400.0), (1000, 100.0)], 4000) == pytest.approx(1600.0)


def test_extrapolate_three_points_fits_a_quadratic():
    def f(length):
        return 50 + 0.1 * length + 1e-5 * length**2

    pts = [(x, f(x)) for x in (1000, 2000, 4000)]
    # linear (1250) and power-law (1283) extrapolations fall short of the quadratic; the fit is exact
    assert bp.extrapolate(pts, 8000) == pytest.approx(f(8000))
    assert bp.extrapolate(pts, 20480) == pytest.approx(f(20480))


# ---------------------------------------------------------------------------------------------- the guard


def test_guard_skips_points_predicted_over_the_memory_limit():
    rows = [_row(1000, 1, 100.0), _row(2000, 1, 400.0), _row(1000, 4, 50.0), _row(2000, 4, 100.0)]
    skip = bp.guard(rows, 4000, 1, memory_limit_mib=1000)
    assert skip["skipped"] and skip["reason"] == "memory"
    assert skip["predicted_peak_mib"] == pytest.approx(1600.0)
    assert skip["predicted_total_mib"] == pytest.approx(1600.0)  # rows without a whole peak: the step's own
    assert bp.guard(rows, 4000, 1, memory_limit_mib=2000) is None
    assert bp.guard(rows, 4000, 4, memory_limit_mib=1000) is None  # S=4 predicts 200 MiB
    assert bp.guard(rows, 4000, 8, memory_limit_mib=1000) is None  # nothing measured: run it
    assert bp.guard(rows, 4000, 1) is None  # no limit


def test_guard_compares_the_whole_peak():
    # 100 MiB for the step + 500 MiB held before it; at twice the length: 4 x 100 + 2 x 500
    rows = [_row(1000, 1, 100.0, peak_total_mib=600.0)]
    skip = bp.guard(rows, 2000, 1, memory_limit_mib=1300)
    assert skip["predicted_total_mib"] == pytest.approx(1400.0)
    assert skip["predicted_peak_mib"] == pytest.approx(400.0)
    assert bp.guard(rows, 2000, 1, memory_limit_mib=1500) is None


def test_guard_is_monotone_in_the_length():
    rows = [
        _row(1000, 1, 100.0),
        {"length": 2000, "partitions": 1, "skipped": True, "reason": "memory", "predicted_peak_mib": 1e5},
        _row(1000, 2, 50.0),
        {"length": 2000, "partitions": 2, "error": "exit -9", "reason": "memory"},  # the OOM killer
        _row(1000, 4, 20.0),
        {"length": 2000, "partitions": 4, "error": "ValueError: something else"},
    ]
    for s, why, predicted in ((1, "skipped at 2000", 1600.0), (2, "failed at 2000", 800.0)):
        skip = bp.guard(rows, 4000, s)  # no limit: skipped because a shorter length was
        assert skip["reason"] == "memory" and why in skip["why"]
        assert skip["predicted_peak_mib"] == pytest.approx(predicted)  # from 1000 tokens, x (4000 / 1000)^2
    assert bp.guard(rows, 4000, 4) is None  # an unrelated failure does not stop longer lengths
    assert bp.guard(rows, 2000, 1, memory_limit_mib=1e9) is None  # only shorter lengths count


def test_guard_skips_points_predicted_over_the_time_limit():
    rows = [_row(1000, 1, 10.0, step=1.0), _row(2000, 1, 20.0, step=2.0)]
    skip = bp.guard(rows, 4000, 1, time_limit_s=5, steps_per_point=2)  # 2 steps of ~4 s
    assert skip["reason"] == "time" and skip["predicted_step_s"] == pytest.approx(4.0)
    assert skip["predicted_peak_mib"] == pytest.approx(40.0)
    assert bp.guard(rows, 4000, 1, time_limit_s=5, steps_per_point=1) is None
    later = bp.guard([*rows, skip], 8000, 1, time_limit_s=1e9)
    assert later["reason"] == "time"  # monotone too


# --------------------------------------------------------------------------------------- table and slopes


def _table_rows():
    return [
        _row(2048, 1, 2292.0, step=1.5, elements=6763, largest_pass=6763),
        _row(2048, 4, 856.4, step=1.75, elements=6763, largest_pass=1700),
        _row(2048, "auto", 900.0, step=0.4567, elements=6763, chosen_partitions=4, budget="4GB"),
        {"length": 4096, "partitions": 1, "skipped": True, "reason": "memory", "predicted_peak_mib": 9000.4},
        _row(4096, 4, 1811.0, step=123.4, elements=13672),
        {"length": 4096, "partitions": "auto", "error": "partition_memory_budget is not supported"},
        {"length": 8192, "partitions": 1, "skipped": True, "reason": "time", "predicted_step_s": 612.0},
        {"length": 8192, "partitions": 4, "skipped": True, "reason": "memory", "predicted_peak_mib": None},
    ]


def test_markdown_table():
    table = bp.markdown_table(_table_rows(), budget="4GB").splitlines()
    assert table[0] == "| tokens | elements | S = 1 | S = 4 | auto (4GB) |"
    assert table[1] == "|---:|---:|---:|---:|---:|"
    assert table[2] == "| 2,048 | 6,763 | 2,292 / 1.50 | 856 / 1.75 | 900 / 0.457 (S=4) |"
    assert table[3] == "| 4,096 | 13,672 | (~9,000 MiB, skipped) | 1,811 / 123 | failed |"
    assert table[4] == "| 8,192 |  | (~612 s, skipped) | (skipped) |  |"
    assert len(table) == 5
    assert bp.markdown_table(_table_rows()).splitlines()[0].endswith("| S = auto |")


def test_series_order_and_memory_slopes():
    rows = _table_rows()
    assert bp.series_order(rows) == [1, 4, "auto"]
    slopes = bp.memory_slopes(rows)
    # S = 4: (1811 - 856.4) MiB over 2048 tokens; S = 1 and auto have one measured length each
    assert slopes == {"4": pytest.approx(1000 * (1811.0 - 856.4) / 2048)}
    line = [_row(x, 2, 100 + 0.2 * x) for x in (1000, 2000, 4000)]
    assert bp.memory_slopes(line) == {"2": pytest.approx(200.0)}  # MiB per 1,000 tokens


def test_guard_leaves_the_memory_of_auto_rows_to_the_budget():
    rows = [_row(1000, "auto", 3000.0), _row(2000, "auto", 9000.0)]  # S changes with the length: no curve
    assert bp.guard(rows, 4000, "auto", memory_limit_mib=10_000) is None
    assert bp.guard([_row(1000, 1, 3000.0), _row(2000, 1, 9000.0)], 4000, 1, memory_limit_mib=10_000)[
        "skipped"
    ]


def test_fixed_segment_length_series():
    assert bp.partitions_for(8, 4096) == 8
    assert [bp.partitions_for("L/1024", n) for n in (1000, 2048, 20480)] == [1, 2, 20]
    rows = [
        _row(2048, "L/1024", 500.0, chosen_partitions=2),
        _row(4096, "L/1024", 900.0, chosen_partitions=4),
    ]
    table = bp.markdown_table(rows).splitlines()
    assert table[0] == "| tokens | elements | S = L/1024 |"
    assert table[3] == "| 4,096 |  | 900 / 1.00 (S=4) |"


# ------------------------------------------------------------------------------------------ head shape


def test_head_shape_defaults_to_the_shipped_head():
    assert DEFAULT_HEAD_CONFIG.is_file()
    shipped = bp.read_head_config(DEFAULT_HEAD_CONFIG)
    assert shipped == bp.SHIPPED_HEAD  # the fallback matches the file
    assert (shipped["layers"], shipped["hidden"], shipped["heads"], shipped["kv_heads"]) == (4, 576, 9, 3)
    assert shipped["frozen_embeddings"] and shipped["draft_vocab"] == 8192 and shipped["k"] == 8
    assert bp.model_shape(shipped, {"layers": 1}) == {**shipped, "layers": 1}
    tiny = bp.model_shape(shipped, {"hidden": 64, "intermediate": 128, "frozen_embeddings": False})
    assert (tiny["heads"], tiny["kv_heads"], tiny["head_dim"], tiny["frozen_embeddings"]) == (1, 1, 64, False)
    wide = bp.model_shape(shipped, {"hidden": 1152})
    assert (wide["heads"], wide["kv_heads"]) == (18, 6)  # head size 64, 3 query heads per KV head
    with pytest.raises(ValueError, match="--heads"):
        bp.model_shape(shipped, {"hidden": 576, "heads": 7})


# --------------------------------------------------------------------------------------------- measuring


def _tiny_cfg(out) -> dict:
    shape = bp.model_shape(
        bp.SHIPPED_HEAD, {"layers": 1, "hidden": 64, "intermediate": 128, "vocab": 512, "draft_vocab": 128}
    )
    return {
        "device": "cpu", "dtype": "float32", **shape, "max_positions": bp.MIN_MAX_POSITIONS,
        "cod_ratio": 0.7, "cod_min_ratio": 0.2, "repeats": 1, "warmup": False, "budget": "4GB",
        "attn": "sdpa", "threads": 1, "out": str(out),
    }  # fmt: skip


def test_gradient_check_compares_partition_counts(tmp_path):
    rows = bp.gradient_check(_tiny_cfg(tmp_path), 96, [1, 3])
    assert [(r["partitions"], r["reference"]) for r in rows] == [(1, 1), (3, 1)]
    assert rows[0]["relative_difference"] == 0.0 and 0.0 < rows[1]["relative_difference"] < 1e-5


def test_one_point_in_process_and_the_budget_row(tmp_path):
    cfg = _tiny_cfg(tmp_path)
    row = bp.measure_point(cfg, 64, 2)
    assert row["partitions"] == 2 and row["length"] == 64
    assert 0 < row["largest_pass"] < row["elements"]
    assert row["peak_total_mib"] >= row["peak_mem_mib"] and row["step_s"] > 0 and row["plan_s"] >= 0
    auto = bp.measure_point(cfg, 64, "auto")
    assert auto["partitions"] == "auto" and auto["budget"] == "4GB"
    if "error" in auto:  # a peagle without the argument: an error row, not a crash
        assert "partition_memory_budget" in auto["error"]
    else:
        assert auto["chosen_partitions"] >= 1 and auto["largest_pass"] <= auto["elements"]


@pytest.mark.slow
def test_script_end_to_end(tmp_path):
    """Two measured points (64 tokens, S = 1 and 2) and, from them, two skipped ones (128 tokens: any predicted
    time is over a 1 us limit), each point in its own process."""
    out = tmp_path / "out"
    cmd = [
        sys.executable, str(SCRIPT), "--device", "cpu", "--lengths", "128,64", "--partitions", "1,2",
        "--layers", "1", "--hidden", "64", "--intermediate", "128", "--vocab", "512", "--draft-vocab", "128",
        "--threads", "1", "--no-warmup", "--time-limit", "1e-6", "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "bench_partition.json").read_text())
    rows = result["rows"]
    assert [(r["length"], r["partitions"]) for r in rows] == [(64, 1), (64, 2), (128, 1), (128, 2)]
    measured, skipped = rows[:2], rows[2:]
    for r in measured:
        assert "error" not in r, r
        assert {"elements", "largest_pass", "step_s", "plan_s", "peak_mem_mib", "peak_total_mib"} <= set(r)
    assert measured[0]["largest_pass"] == measured[0]["elements"] > measured[1]["largest_pass"]
    assert all(r["skipped"] and r["reason"] == "time" and r["predicted_step_s"] > 0 for r in skipped)
    cfg = result["config"]
    assert cfg["max_positions"] >= 32768 and cfg["layers"] == 1 and cfg["heads"] == 1
    assert result["summary"] == {"memory_slope_mib_per_1k_tokens": {}}  # one measured length per S
    md = (out / "bench_partition.md").read_text()
    assert "| tokens | elements | S = 1 | S = 2 |" in md and "s, skipped) |" in md
    assert "| 64 |" in proc.stdout and "skipped (time" in proc.stdout
    assert (out / "bench_partition.png").stat().st_size > 1000
