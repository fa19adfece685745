"""The benchmarks that need hardware or time run here at tiny sizes, so a GPU session finds them working."""

import torch

from benchmarks import gpu_check, meta_7b


def test_gpu_check_plans_measures_and_tabulates_at_tiny_size():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = gpu_check.check_model("llama", "tiny", device, shares=(0.7,), repeats=1, profile_repeats=1,
                                 out=lambda line: None)
    assert [r.budget for r in rows] == ["eager", "70%", "uniform"]
    planned = rows[1:]
    assert all(r.predicted_overhead > 0 for r in planned)  # both recompute
    assert all(0.8 < r.peak_ratio <= 1.05 for r in planned)  # predicted peaks hold when measured
    assert (rows[0].reserved is None) == (device == "cpu")
    text = gpu_check.table(rows)
    assert "meas/pred" in text and len(text.splitlines()) == 4


def test_meta_7b_benchmark_runs_at_a_small_shape():
    shape = dict(meta_7b.LLAMA_7B, hidden=256, layers=2, heads=4, intermediate=688, vocab=1024, seq=512)
    result = meta_7b.run(shape, torch.bfloat16, "h100", ["80GB", "40%"])
    assert result["peak_rss_bytes"] > 0 and result["eager_peak_bytes"] > 0
    assert {"capture", "profile", "solve 80GB", "solve 40%"} <= set(result["seconds"])
