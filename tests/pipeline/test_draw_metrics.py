"""A step's ``pipeline/*`` metrics merged from its draws (DAPO's dynamic sampling draws again)."""

from tandem.pipeline.source import merge_draw_metrics


def _merged(draws: list[dict[str, float]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for draw in draws:
        total = merge_draw_metrics(total, draw)
    return total


def test_the_most_bytes_in_flight_of_any_draw_is_kept():
    """Each draw reports the peak since the previous draw; the step's peak is their maximum (the
    last draw's peak alone would hide a higher one of an earlier draw)."""
    draws = [
        {"pipeline/inflight_bytes_max": 900.0, "pipeline/inflight_bytes": 300.0},
        {"pipeline/inflight_bytes_max": 400.0, "pipeline/inflight_bytes": 100.0},
        {"pipeline/inflight_bytes_max": 700.0, "pipeline/inflight_bytes": 200.0},
    ]
    merged = _merged(draws)
    assert merged["pipeline/inflight_bytes_max"] == max(d["pipeline/inflight_bytes_max"] for d in draws)
    assert merged["pipeline/inflight_bytes"] == draws[-1]["pipeline/inflight_bytes"]  # a level: the last


def test_waits_add_up_and_the_largest_staleness_is_kept():
    draws = [
        {"pipeline/trainer_idle_s": 1.5, "pipeline/staleness/max": 2.0},
        {"pipeline/trainer_idle_s": 0.5, "pipeline/staleness/max": 1.0},
    ]
    merged = _merged(draws)
    assert merged == {"pipeline/trainer_idle_s": 2.0, "pipeline/staleness/max": 2.0}
