"""report.png's panels from a hand-written metrics.jsonl: evaluation points are markers (no line joins two of
them), a step the step guard skipped is marked on the loss panel, and the throughput panel's legend names both
of its curves."""

from shardtrain.train.metrics.chart import draw_figure, panel_series

ENTRIES = [{"step": s, "loss": 4.0 - 0.1 * s, "learning_rate": 1e-3, "grad_norm": 1.0, "tokens_per_second": 100.0,
            "peak_memory_mb": 50.0, "memory_kind": "cpu_peak_rss"} for s in range(1, 7)]
ENTRIES += [{"step": 3, "eval_loss": 3.8}, {"step": 4, "skipped_steps": 1}, {"step": 6, "eval_loss": 3.5}]


def test_skipped_steps_are_found_once_each():
    assert panel_series(ENTRIES)["loss"]["skipped step"] == ([4], [1.0])
    again = [*ENTRIES, {"step": 5, "skipped_steps": 1}, {"step": 6, "skipped_steps": 2}]
    assert panel_series(again)["loss"]["skipped step"][0] == [4, 6]


def test_eval_points_are_markers_and_skips_and_tokens_are_in_the_legends():
    loss, lr, grad, speed, memory = draw_figure(ENTRIES).axes
    evals = next(line for line in loss.get_lines() if line.get_label() == "eval loss")
    assert evals.get_linestyle() == "None" and evals.get_marker() == "o"
    assert list(evals.get_xdata()) == [3, 6]
    legend = [text.get_text() for text in loss.get_legend().get_texts()]
    assert legend == ["train loss", "eval loss", "skipped step (step guard)"]
    skip = next(line for line in loss.get_lines() if line.get_label().startswith("skipped"))
    assert list(skip.get_xdata()) == [4, 4]
    assert [t.get_text() for t in memory.get_legend().get_texts()] == ["tokens/s", "cpu_peak_rss (MiB, max rank)"]
