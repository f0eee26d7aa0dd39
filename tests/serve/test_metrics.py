"""``/metrics`` text: label values escaped per the Prometheus text format."""

from tandem.protocol.generation import EngineMetrics
from tandem.serve.metrics import UNMATCHED_ROUTE, HTTPCounters, escape_label, render_metrics


def test_label_values_are_escaped():
    assert escape_label('a"b\\c\nd') == 'a\\"b\\\\c\\nd'


def test_a_hostile_model_name_stays_inside_its_label():
    counters = HTTPCounters()
    counters.record(UNMATCHED_ROUTE, 404)
    text = render_metrics(EngineMetrics(), counters, 'm"} 1\nfake{x="')
    assert 'tandem_weight_version{model="m\\"} 1\\nfake{x=\\""} 0' in text.splitlines()
    assert not any(line.startswith("fake") for line in text.splitlines())
    assert 'tandem_http_requests_total{route="unmatched",status="404"} 1' in text.splitlines()
